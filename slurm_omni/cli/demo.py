"""``omni demo``: the whole story on the embedded cluster, one line per phase with the elapsed time.

cluster up -> where a het job's components land (two leaf switches) -> synthetic data -> manager ->
``omni submit`` of a multimodal heterogeneous job -> a node drilled DOWN mid-run -> automatic
recovery -> the job finishes -> a reference run that never failed -> loss curve and data compared
-> ``omni report``. Cleans up whatever happens (manager stopped, jobs cancelled, nodes resumed) and
exits non-zero with one line naming the phase that failed.

``--user NAME`` (as root): root brings the cluster up and the rest of the story runs in a process of
NAME's, with a clean environment (drill/user_session.py): root writes nothing in NAME's home and
submits nothing; the drill asks root to set its node DOWN and back.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.cluster.spec import DEFAULT_STATE_DIR
from slurm_omni.errors import OmniError
from slurm_omni.fsio import write_atomic
from slurm_omni.ownership import current_user
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.types import JobState, NodeState

if TYPE_CHECKING:
    from slurm_omni.drill.story import DemoFiles
    from slurm_omni.drill.user_session import RootNodes

T = TypeVar("T")

HET_SAMPLE = """#!/bin/bash
#SBATCH --job-name=omni-demo-het
#SBATCH --output={output}
#SBATCH --partition=vision --nodes=1 --ntasks=2 --ntasks-per-node=2 --gres=gpu:h100:2 --nodelist={vision}
#SBATCH hetjob
#SBATCH --partition=text --nodes=2 --ntasks=2 --ntasks-per-node=1 --gres=gpu:h100:4 --nodelist={text}
# Slurm names no component per task in a het step: tasks of component 0 come first. --ntasks on each
# component: 24.11 and 26.05 set SLURM_NTASKS_HET_GROUP_<n> (and srun's task count) only from it.
srun --het-group=0,1 bash -c 'c=$(( SLURM_PROCID < SLURM_NTASKS_HET_GROUP_0 ? 0 : 1 )); \
echo "task=$SLURM_PROCID component=$c node=$SLURMD_NODENAME switch=$SLURM_TOPOLOGY_ADDR \
gpus=$CUDA_VISIBLE_DEVICES"' | sort
"""


class Story:
    """Numbered phases; each prints one line when it ends, with the time since the start."""

    def __init__(self, total: int) -> None:
        self.start = time.monotonic()
        self.total = total
        self.n = 0

    def say(self, line: str) -> None:
        click.echo(f"[{time.monotonic() - self.start:6.1f}s]     {line}")

    def phase(self, name: str, fn: Callable[[], T], done: Callable[[T], str]) -> T:
        self.n += 1
        try:
            value = fn()
        except OmniError as e:
            raise OmniError(f"demo: phase {self.n} ({name}) failed: {str(e).removeprefix('demo: ')}") from e
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            raise OmniError(f"demo: phase {self.n} ({name}) failed: {type(e).__name__}: {e}") from e
        click.echo(f"[{time.monotonic() - self.start:6.1f}s] {self.n}/{self.total} {name}: {done(value)}")
        return value


def het_sample(backend: CliBackend, work: Path, timeout_s: float = 120.0) -> list[str]:
    """A heterogeneous job across two leaf switches; what each task printed (node, switch, GPUs)."""
    topo = backend.topology(refresh=True)
    nodes = backend.nodes()
    idle = {n.name for n in nodes if n.state is NodeState.IDLE and not n.flags}
    healthy = {n.name for n in nodes if n.state.usable}
    # Idle nodes first: the sample must not wait behind other jobs on a shared cluster.
    leaves = [sorted(set(s.nodes) & healthy, key=lambda n: (n not in idle, n))
              for s in topo.switches.values() if s.nodes]
    leaves = [nodes for nodes in leaves if nodes]
    if len(leaves) < 2 or len(leaves[1]) < 2:
        raise OmniError("demo: couldn't find two leaf switches with healthy nodes (omni cluster status)")
    vision, text = leaves[0][:1], leaves[1][:2]
    work.mkdir(parents=True, exist_ok=True)
    output = work / "het-sample.out"
    output.unlink(missing_ok=True)
    script = work / "het-sample.sbatch"
    # A new file in place of whatever the path holds (a FIFO, a link): sbatch reads what we wrote.
    write_atomic(script, HET_SAMPLE.format(output=shlex.quote(str(output)), vision=compress(vision),
                                           text=compress(text)), mode=0o644)
    job_id = backend.submit(str(script))
    deadline = time.monotonic() + timeout_s
    state = JobState.PENDING
    while time.monotonic() < deadline:
        job = next((j for j in backend.jobs() if j.job_id == job_id), None)
        state = job.state if job else JobState.COMPLETED
        if state.finished:
            break
        time.sleep(0.5)
    else:
        backend.cancel(str(job_id))
        raise OmniError(f"demo: couldn't finish job {job_id} within {timeout_s:.0f}s (squeue; {output})")
    if state is not JobState.COMPLETED or not output.exists():
        raise OmniError(f"demo: job {job_id} ended {state.value} (see {output})")
    return output.read_text().splitlines()


@click.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              default=lambda: os.environ.get("OMNI_CLUSTER_DIR", str(DEFAULT_STATE_DIR)))
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Per waiting phase (job start, recovery, finish).")
@click.option("--sample-only", is_flag=True, help="Only the heterogeneous placement sample (the old demo).")
@click.option("--job-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Run the story on this job (e.g. examples/own-script/job.toml: your own script) "
                   "instead of the demo's built-in trainer; its folder (the script, its data/) is copied along.")
@click.option("--busy", is_flag=True, help="Allocation-mode recovery on a busy cluster (every free node runs another "
              "job): a vision node, a text node and the allocation's first node lost, each recovered inside the "
              "same Slurm job, then a shrink once the spares are gone.")
@click.option("--user", default="", help="Run the story as this unprivileged user (run as root; the demo's folder is "
              "~USER/omni-demo), as a site runs them: Slurm, the plugin and the drill's node changes stay root's.")
@click.option("--user-session", "session_fd", type=int, default=None, hidden=True,
              help="Internal: the user's side of --user, started by root (FD: its socket to root).")
@click.option("--node", default="", help="The node to set DOWN mid-run (default: the job's last node that runs "
              "ranks, never a spare of an in-allocation job).")
@click.option("--recovery", type=click.Choice(["allocation", "in_allocation", "resubmit"]), default=None,
              help="The demo site's default recovery path (a job file's own [job] recovery wins). Default: the "
                   "fastest the demo site allows, allocation (one allocation with a spare node per stage and no "
                   "batch script, the step supervisor beside the manager); in_allocation: the supervisor in the "
                   "batch script; resubmit: the manager resubmits a heterogeneous job.")
def demo(state_dir: Path, timeout_s: float, sample_only: bool, job_file: Path | None, busy: bool, user: str,
         session_fd: int | None, node: str, recovery: str | None) -> None:
    """Cluster up, your job (or a multimodal het job), a node failure drilled mid-run, automatic recovery,
    report."""
    from slurm_omni.drill import story

    if (busy or sample_only) and (node or recovery):
        raise click.UsageError("--node and --recovery are for the full story (not with --busy or --sample-only)")
    # one folder per job: a demo of another job file leaves the last one's files alone
    suffix = f"-{_job_name(job_file)}" if job_file is not None else ""
    if session_fd is not None:
        _user_side(session_fd, state_dir, timeout_s, sample_only, job_file, suffix, node, recovery)
        return
    if user:
        import pwd
        if os.geteuid() != 0:
            raise click.UsageError(f"--user {user}: run omni demo as root (it switches to {user} for the story)")
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise click.UsageError(f"--user {user}: no such user (scripts/setup.sh creates alice and bob)") from None
        if busy:
            raise click.UsageError("--user runs the full story or the sample (not with --busy)")

    if busy:
        from slurm_omni.drill.busy_demo import run_busy_demo

        s = Story(21)
        lc = LocalCluster(state_dir)
        s.phase("cluster", lambda: lc.up(), lambda started: f"{lc.spec.nodes} nodes "
                f"{'started' if started else 'already up'} in {lc.paths.root}")
        backend = CliBackend(env=lc.env, timeout_s=20, retries=3)
        run_busy_demo(s, lc, backend, lc.paths.root.parent / "demo-busy", story.EXAMPLES, timeout_s)
        return
    s = Story(2 if sample_only else 11)
    lc = LocalCluster(state_dir)
    s.phase("cluster", lambda: lc.up(), lambda started: f"{lc.spec.nodes} nodes "
            f"{'started' if started else 'already up'} in {lc.paths.root}")
    if user:
        from slurm_omni.drill.user_session import run_user_side
        from slurm_omni.formats.demo_session import SessionStart

        argv = story.omni_argv("demo", "--state-dir", str(lc.paths.root), "--timeout", str(timeout_s),
                               *(["--sample-only"] if sample_only else []),
                               *(["--job-file", str(job_file.resolve())] if job_file else []),
                               *(["--node", node] if node else []), *(["--recovery", recovery] if recovery else []))
        code = run_user_side(user, lc, argv, SessionStart(started=s.start, phases_done=s.n, total=s.total),
                             s.say)
        if code:
            sys.exit(code)     # the user's side said why, in one line
        return
    backend = CliBackend(env=lc.env, timeout_s=20, retries=3)
    _story(s, lc, backend, lc.paths.root.parent / f"demo{suffix}", timeout_s, sample_only, job_file,
           node=node, recovery=recovery)


def _user_side(fd: int, state_dir: Path, timeout_s: float, sample_only: bool, job_file: Path | None,
               suffix: str = "", node: str = "", recovery: str | None = None) -> None:
    """The story after the cluster phase, in the process root started as the user (``--user``)."""
    import pwd
    import signal

    from slurm_omni.drill.user_session import RootNodes

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)     # root passes its SIGTERM on: clean up (finally) and end

    signal.signal(signal.SIGTERM, stop)
    root = RootNodes(fd)
    s = Story(root.start.total)
    s.start, s.n = root.start.started, root.start.phases_done
    lc = LocalCluster(state_dir)
    backend = CliBackend(env=lc.env, timeout_s=20, retries=3)
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    _story(s, lc, backend, home / f"omni-demo{suffix}", timeout_s, sample_only, job_file, root, node=node,
           recovery=recovery)


def _story(s: Story, lc: LocalCluster, backend: CliBackend, work: Path, timeout_s: float, sample_only: bool,
           job_file: Path | None, root: RootNodes | None = None, *, node: str = "",
           recovery: str | None = None) -> None:
    from slurm_omni.drill import story

    lines = s.phase("placement", lambda: het_sample(backend, work / "sample"),
                    lambda out: f"a het job ran {len(out)} tasks across two leaf switches")
    for line in lines:
        s.say(line)
    if sample_only:
        return
    _full_story(s, lc, backend, story.DemoFiles(work), timeout_s, job_file.resolve() if job_file else None, root,
                node=node, recovery=recovery)


def _full_story(s: Story, lc: LocalCluster, backend: CliBackend, files: DemoFiles, timeout_s: float,
                job_file: Path | None = None, root: RootNodes | None = None, *, node: str = "",
                recovery: str | None = None) -> None:
    from slurm_omni.config.site import load_site
    from slurm_omni.drill import story
    from slurm_omni.drill.faults import fill_faults
    from slurm_omni.drill.inject import Injector
    from slurm_omni.drill.measure import goodput_document, render_table
    from slurm_omni.drill.reference import finish_reference, start_reference
    from slurm_omni.drill.run import DrillRunner, DrillSpec
    from slurm_omni.drill.verify import wait_done

    s.phase("files", lambda: story.write_files(files, lc, job_file=job_file, recovery=recovery),
            lambda _: f"job file{' and its script' if job_file else ''} and site config in {files.work}")
    s.phase("data", lambda: story.synthesize(files) if story.builtin_trainer(files) else 0,
            lambda n: f"{n} synthetic samples (image-text pairs, text)" if n else
            "none synthesized: the job's [training] command reads its own")
    site = load_site(files.site)
    injector: Injector
    if root is not None:   # --user: the node changes through root, the rest as the user
        from slurm_omni.drill.user_session import BrokeredInjector
        injector = BrokeredInjector(root, allowed=site.drills.nodes, site=str(files.site), backend=backend)
    else:
        injector = Injector(allowed=site.drills.nodes, site=str(files.site), backend=backend, cluster=lc)
    env = story.job_environment(lc)
    manager = None
    submitted: list[int] = []
    try:
        who = f" as {current_user()}" if root is not None else ""
        manager = s.phase("manager", lambda: story.start_manager(files, env),
                          lambda m: f"omni manager run{who} (pid {m.proc.pid}), journal in {files.manager_dir}")
        job_id = s.phase("submit", lambda: story.submit(files, env),
                         lambda j: f"omni submit{who}: job {j} ({story.describe_job(files, site)})")
        submitted.append(job_id)
        h = story.handle(files, job_id)
        runner = DrillRunner(injector, backend, h, timeline=files.manager_dir / "timeline.json", on_event=s.say)
        spec = DrillSpec(kind="node-down", node=node, after_steps=30, timeout_s=timeout_s)
        result = s.phase("drill", lambda: runner.run(spec),
                         lambda r: f"{r.node} DOWN at step {r.progress.last_step_before if r.progress else '?'}: "
                                   f"confirmed in {_s(r.detection_s)}, training again {_s(r.recovery_s)} later "
                                   f"({r.times.source}), {r.node} resumed; "
                                   f"{story.recovery_path(files.manager_dir / 'timeline.json')}")
        if not result.ok:
            raise OmniError(f"demo: phase {s.n} (drill) failed: {result.error or 'no recovery'} "
                            f"(manager log: {manager.log_path})")
        reference = start_reference(files.job, files.reference)
        s.phase("finish", lambda: wait_done(runner, timeout_s),
                lambda _: f"job {h.name} reached step {h.max_steps}; reference run alongside")
        restored = story.restore_line(h.metrics_dir)   # the ranks' own records (restore_source)
        if restored:
            s.say(restored)
        ref_metrics = s.phase("reference", lambda: finish_reference(reference, files.reference, timeout_s),
                              lambda p: f"a run that never failed, in {p}")
        eq = s.phase("compare", lambda: story.compare(files, h.metrics_dir, ref_metrics, h.stages),
                     lambda e: ("equivalent: " if e.ok else "NOT equivalent: ") + e.summary())
        if not eq.ok:
            raise OmniError(f"demo: phase {s.n} (compare) failed: {eq.summary()}")
        result = result.with_equivalence(eq.to_json())
        files.drills.mkdir(exist_ok=True)
        (files.drills / "drills.json").write_text(json.dumps(
            goodput_document([result], source="omni demo"), indent=1, sort_keys=True) + "\n")
        timeline = fill_faults(files.manager_dir / "timeline.json", [result], files.drills / "timeline.json")
        text = s.phase("report", lambda: story.report(files, h, ref_metrics, env, timeline),
                       lambda _: f"omni report: {files.report}/report.html, report.png")
        for line in (render_table([result]) + "\n" + text).rstrip().splitlines():
            s.say(line)
    finally:
        name = _job_name(files.job)
        for line in story.cleanup(backend, injector, submitted, manager, keys=[f"{name}-{j}" for j in submitted]):
            s.say(f"cleanup: {line}")
        freed = story.free_memory(files, lost=[node for node in injector.downed])
        if freed:
            s.say(f"cleanup: {freed}")


def _job_name(job_file: Path) -> str:
    from slurm_omni.config.job import load_job

    try:
        return load_job(job_file).job.name
    except OmniError:
        return "omni-demo"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"
