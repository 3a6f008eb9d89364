"""``omni demo --busy``: allocation-mode recovery on a busy cluster, one line per phase.

The job runs in allocation mode, the fastest the demo site allows (docs/allocation-mode.md): one
``salloc --no-shell --no-kill`` allocation of 2 vision + 2 text nodes with two spares for vision and
one for text, no batch script, the step supervisor beside the manager launching with ``srun
--jobid``. Every other node gets a filler job of a few minutes, so that anything that goes through
the queue waits. Then, each recovered inside the same Slurm job with a spare: a vision node lost, a
text node lost, and the allocation's first node lost (the batch host of an in-allocation job, whose
loss there ends the allocation and waits in the queue; here it is a node like any other). Once the
spares are gone, one more node lost: the supervisor relaunches with one data-parallel replica
instead of two, same job, same global batch. Each recovery prints the time from the fault (this
process's clock at ``scontrol update state=DOWN``) to the first step of the relaunch, and the
medians at the end. The loss curve is compared with a run that never failed: bitwise up to the
shrink (the layout is the same), within tolerance after it (fewer replicas reduce in another order).

Then capacity comes back: the supervisor asks Slurm for a pool allocation of the missing node while
the job trains shrunk; the pool waits behind the fillers; when they are cancelled it starts, and the
next relaunch spans the allocation and the pool at two replicas again (docs/allocation-mode.md).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurm_omni.cluster.busy import BusyCluster
from slurm_omni.cluster.local import LocalCluster
from slurm_omni.errors import OmniError
from slurm_omni.formats import to_builtins
from slurm_omni.formats.metrics import read_tree
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import compress, expand
from slurm_omni.supervisor.journal import read_status, status_path

REASON = "omni-demo-busy"
MAX_STEPS = 160
"""Enough for four recoveries, a pool's wait behind the fillers and the grow-back before the end (at
70 the run ended while the pool's standby warmed: about 0.4 s a step here)."""

SITE_EDITS = {"allow_allocation = true": "allow_allocation = true"}
"""The example site already gives allocation mode (one partition, a spare per stage, allowed): kept as it is."""
JOB_EDITS = {'name = "omni-demo"': 'name = "omni-demo-busy"',
             'name = "vision"\nnodes = 1': 'name = "vision"\nnodes = 2\nspares = 2',
             'name = "text"\nnodes = 1': 'name = "text"\nnodes = 2',
             "max_steps = 80": f"max_steps = {MAX_STEPS}", "every_steps = 10": "every_steps = 5",
             # the busy story measures allocation-mode recovery as before: checkpoints on the file system only
             "memory_tier = true\nmemory_every_steps = 1\nfiles_every = 10\n": "memory_tier = false\n"}


def write_files(work: Path, cluster: LocalCluster, examples: Path) -> tuple[Path, Path]:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    values = {"{work}": str(work), "{spool}": str(cluster.paths.spool), "{nodes}": compress(cluster.spec.node_names),
              "{shm}": str(Path("/dev/shm") / f"omni-demo-busy-{os.geteuid()}")}   # unused: the tier is off
    out = []
    for src, edits in (("omni.toml", SITE_EDITS), ("job.toml", JOB_EDITS)):
        text = (examples / src).read_text()
        for key, value in edits.items():
            if key not in text:
                raise OmniError(f"demo: couldn't adapt {examples / src}: {key!r} not found")
            text = text.replace(key, value)
        for key, value in values.items():
            text = text.replace(key, value)
        (work / src).write_text(text)
        out.append(work / src)
    (work / "logs").mkdir()
    return out[0], out[1]


class BusyDemo:
    def __init__(self, cluster: LocalCluster, backend: CliBackend, work: Path, *, say: Callable[[str], None],
                 timeout_s: float) -> None:
        self.cluster, self.backend, self.work, self.say, self.timeout_s = cluster, backend, work, say, timeout_s
        self.filler = BusyCluster(backend, seconds=180, tag=REASON)
        self.job_id = 0
        self.resubmitted_id = 0
        self.down: list[str] = []
        self.faults: dict[str, float] = {}
        """Node -> when this demo set it DOWN."""

    @property
    def ckpt(self) -> Path:
        from slurm_omni.ownership import current_user

        return self.work / "ckpt" / current_user() / "omni-demo-busy"

    def status(self, run: str = "") -> dict[str, Any]:
        status = read_status(status_path(self.ckpt, run or str(self.job_id)))
        return {} if status is None else dict(to_builtins(status))

    def wait(self, what: str, probe: Callable[[], Any], timeout_s: float | None = None) -> Any:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while time.monotonic() < deadline:
            got = probe()
            if got:
                return got
            time.sleep(0.5)
        raise OmniError(f"demo: couldn't see {what} within {timeout_s or self.timeout_s:.0f}s "
                        f"(logs in {self.work / 'logs'}, {self.ckpt / 'supervisor'})")

    def submit(self, env: dict[str, str]) -> int:
        """``omni submit``: rendered in-allocation (the job file says so) and registered with the manager."""
        from slurm_omni.drill import story

        self.job_id = story.submit(story.DemoFiles(self.work), env)
        return self.job_id

    def resubmitted(self) -> int:
        """The manager's resubmission of the job: a later Slurm job of this user's carrying the incarnation
        tag of the job's registration in its comment (never a job found by its name: anyone may use it)."""
        from slurm_omni.manager.journal import incarnation_tag
        from slurm_omni.ownership import current_user

        tag = incarnation_tag(f"omni-demo-busy-{self.job_id}", 0)[:-1]
        for job in self.backend.jobs(user=current_user()):
            if job.job_id > self.job_id and job.comment.startswith(tag):
                self.resubmitted_id = job.job_id
                return job.job_id
        return 0

    def step(self) -> int:
        steps = [-1]
        for lines in read_tree(self.work / "metrics").values():   # own files and node files
            for _, line in lines[-3:]:
                try:
                    steps.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    continue
        return max(steps)

    def steps_more(self, n: int) -> None:
        target = self.step() + n
        self.wait(f"step {target}", lambda: self.step() >= target)

    def lose(self, node: str) -> float:
        """``node`` set DOWN; the time just before (the fault, on this process's clock)."""
        fault = time.time()
        self.backend.runner.run(["scontrol", "update", f"nodename={node}", "state=DOWN", f"reason={REASON}"])
        self.down.append(node)
        self.faults[node] = fault
        return fault

    def resume(self) -> None:
        for node in self.down:
            self.backend.runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], check=False)
        self.down = []

    def recovery_of(self, node: str) -> dict[str, Any]:
        """The recovery that took ``node`` out, once the step trains again (empty before). When that
        launch ended before its first step and the supervisor relaunched it again in place, the
        record of the loss with the first step of the launch that trained; ``relaunches`` counts the
        launches it took (1 when the first one trained)."""
        recs = self.status().get("recoveries") or []
        for i, rec in enumerate(recs):
            if node not in (rec.get("removed") or []):
                continue
            for n, later in enumerate(recs[i:], start=1):
                if later.get("first_step_at"):
                    return {**rec, "first_step_at": later["first_step_at"], "relaunches": n,
                            "data_parallel_size_after": later["data_parallel_size_after"],
                            "spares_left": later["spares_left"],
                            "causes_after": [r.get("cause", "?") for r in recs[i + 1:i + n]]}
        return {}

    def first_node(self) -> str:
        """The allocation's first node as Slurm lists it now (an in-allocation job's batch host; 22.05
        still names it BatchHost for an allocation with no batch script)."""
        out = self.backend.runner.run(["scontrol", "show", "job", "-o", str(self.job_id)]).stdout
        nodes = expand(out.split(" NodeList=")[1].split()[0]) if " NodeList=" in out else []
        return nodes[0] if nodes else ""

    def job_state(self) -> str:
        out = self.backend.runner.run(["squeue", "-h", f"--jobs={self.job_id}", "--format=%T %r"], check=False)
        return out.stdout.strip()

    def fillers_running(self) -> str:
        if not self.filler.jobs:
            return "none"
        out = self.backend.runner.run(["squeue", "-h", f"--jobs={','.join(map(str, self.filler.jobs))}",
                                       "--states=RUNNING", "--format=%N"], check=False)
        return compress(out.stdout.split()) or "none"

    def waited(self, job: int) -> str:
        """How long ``job`` waited in the queue (Slurm's SubmitTime to StartTime)."""
        out = self.backend.runner.run(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
        times = dict(kv.split("=", 1) for kv in out.split() if kv.startswith(("SubmitTime=", "StartTime=")))
        try:
            from datetime import datetime
            start = datetime.fromisoformat(times["StartTime"])
            submit = datetime.fromisoformat(times["SubmitTime"])
        except (KeyError, ValueError):
            return "?"
        return f"{(start - submit).total_seconds():.0f} s"

    def job_state_of(self, job: int) -> str:
        out = self.backend.runner.run(["squeue", "-h", f"--jobs={job}", "--format=%T (%r)"], check=False)
        return out.stdout.strip() or "gone"

    def cleanup(self) -> list[str]:
        done = []
        self.filler.clear()
        done.append("filler jobs cancelled")
        # The jobs this demo submitted and the manager's resubmission of it, by id: never by name.
        for job in (self.job_id, self.resubmitted_id or self.resubmitted()):
            if job:
                self.backend.runner.run(["scancel", str(job)], check=False)
        if self.down:
            done.append(f"{compress(self.down)} resumed")
        self.resume()
        return done


def run_busy_demo(s: Any, lc: LocalCluster, backend: CliBackend, work: Path, examples: Path,
                  timeout_s: float) -> None:
    """The phases (``s`` is cli.demo.Story)."""
    from slurm_omni.drill import story
    from slurm_omni.drill.equivalence import check_equivalence, compare_losses
    from slurm_omni.drill.history import load_history
    from slurm_omni.drill.reference import finish_reference, start_reference

    d = BusyDemo(lc, backend, work, say=s.say, timeout_s=timeout_s)
    manager = None
    _, job = s.phase("files", lambda: write_files(work, lc, examples),
                        lambda f: f"allocation-mode job file and site config in {work}")
    s.phase("data", lambda: story.synthesize(story.DemoFiles(work)), lambda n: f"{n} synthetic samples")
    env = story.job_environment(lc)
    try:
        files = story.DemoFiles(work)
        manager = s.phase("manager", lambda: story.start_manager(files, env),
                          lambda m: f"omni manager run (pid {m.proc.pid}): restarts the step supervisor if it dies, "
                                    "resubmits if the allocation itself is lost")
        job_id = s.phase("submit", lambda: d.submit(env),
                         lambda j: f"omni submit: job {j}, one salloc --no-shell --no-kill allocation with no batch "
                                   "script, 2+2 nodes, 2 vision spares and 1 text spare; the step supervisor "
                                   "runs here, beside the manager")
        s.phase("running", lambda: d.wait("the first steps", lambda: d.step() >= 8 and d.status()),
                lambda st: f"launch 0: vision on {compress(st['components'][0])}, text on "
                           f"{compress(st['components'][1])}, spares {compress(st['spares'])}")
        s.phase("busy", lambda: d.filler.fill(), lambda nodes: f"{len(nodes)} filler job(s) of {d.filler.seconds} s "
                f"on every free node ({compress(nodes) or 'none free'}): a resubmission would wait")
        times: list[float] = []
        losses = [("vision node lost", 0), ("text node lost", 1), ("first node lost", -1), ("no spare left", 1)]
        for n, (what, comp) in enumerate(losses, start=1):
            st = d.status()
            first = d.first_node()
            if comp < 0:
                victim = first
                if victim not in {x for c in st["components"] for x in c}:
                    raise OmniError(f"demo: the allocation's first node {victim or '?'} runs no ranks "
                                    f"(components {st['components']})")
            else:
                nodes = [x for x in st["components"][comp] if x != first]
                if not nodes:
                    raise OmniError(f"demo: no node of component {comp} besides the allocation's first to lose")
                victim = nodes[-1]
            if comp == 1 and n == len(losses) and st.get("spares_left"):
                raise OmniError(f"demo: {st['spares_left']} spare(s) left before the shrink (spares {st['spares']})")
            d.steps_more(4)
            s.phase(what, lambda v=victim: d.lose(v),
                    lambda _, v=victim, f=first: f"{v} DOWN" + (" (the allocation's first node)" if v == f else ""))
            rec: dict[str, Any] = s.phase("relaunch in the allocation",
                                          lambda k=n, v=victim: d.wait(f"recovery {k} ({v} out, training again)",
                                                                       lambda: d.recovery_of(v)),
                                          lambda r, v=victim: _recovery_line(r, d.job_id, d.job_state(),
                                                                             d.faults[v]))
            if rec["slurm_job_id_after"] != str(job_id):
                raise OmniError("demo: the recovery left the Slurm job")
            if rec.get("first_step_at"):
                times.append(float(rec["first_step_at"]) - d.faults[victim])
            if n < len(losses):
                d.resume()       # back to the cluster (never to this job): a filler takes it
                d.filler.fill()
            # the last one stays DOWN (cleanup resumes it): the pool asked for next must wait behind the
            # fillers, not start at once on the node that came back
        s.say("fault to first step: " + ", ".join(f"{t:.2f} s" for t in times) +
              (f"; median {statistics.median(times):.2f} s, the three with a spare "
               f"{statistics.median(times[:3]):.2f} s" if len(times) >= 3 else ""))
        # Capacity coming back (issue 20 item 2, docs/allocation-mode.md "Pool allocations"): the
        # supervisor asks for a pool of the missing node while the job trains shrunk; it waits behind
        # the fillers; when they go, the next relaunch spans both allocations at full size.
        pool: dict[str, Any] = s.phase(
            "pool asked", lambda: d.wait("the pool allocation asked for", lambda: next(
                (p for p in d.status().get("pools") or [] if p.get("state") == "requested"), None)),
            lambda p: f"pool allocation {p['slurm_job_id']} for the missing node: "
                      f"{d.job_state_of(int(p['slurm_job_id']))}; training goes on shrunk")
        d.steps_more(3)
        s.phase("fillers gone", lambda: d.filler.clear(), lambda _: "filler jobs cancelled: the pool can start")
        grow: dict[str, Any] = s.phase(
            "grow-back", lambda: d.wait("the grow-back relaunch", lambda: next(
                (r for r in d.status().get("recoveries") or [] if r.get("cause") == "grow" and r.get("first_step_at")),
                None)),
            lambda r: f"pool {pool['slurm_job_id']} started ({d.waited(int(pool['slurm_job_id']))} in the queue); "
                      f"{','.join(r['added']) or '?'} in, dp {r['data_parallel_size_before']} -> "
                      f"{r['data_parallel_size_after']} across the allocation and the pool, relaunch to first step "
                      f"{_since(r.get('first_step_at'), r.get('relaunched_at') or r['first_step_at'])}")
        if grow["slurm_job_id_after"] != str(job_id):
            raise OmniError("demo: the grow-back left the Slurm job")
        s.phase("finish", lambda: d.wait("the last step", lambda: d.step() >= MAX_STEPS - 1, 900),
                lambda _: f"trained to step {MAX_STEPS}")
        ref = start_reference(job, work / "reference")
        ref_metrics = s.phase("reference", lambda: finish_reference(ref, work / "reference", 900),
                              lambda p: f"a run that never failed, in {p}")
        run, reference = load_history(work / "metrics" / "omni-demo-busy"), load_history(ref_metrics)
        shrink_at = _shrink_step(d)
        before = {k: v for k, v in run.losses().items() if k < shrink_at}
        exact = compare_losses(before, {k: v for k, v in reference.losses().items() if k < shrink_at},
                               bitwise=True, rtol=0.0)
        eq = check_equivalence(run, reference)
        s.phase("compare", lambda: exact, lambda e: f"loss bitwise equal to the reference over {e.steps_compared} "
                f"steps before the shrink at step {shrink_at}" if e.ok else "loss NOT bitwise equal before the shrink")
        s.say(("whole run: " if eq.ok else "whole run NOT equivalent: ") + eq.summary())
        if not exact.ok:
            raise OmniError("demo: the loss before the shrink differs from the reference")
    finally:
        if manager is not None and manager.alive():
            manager.stop()
            s.say("cleanup: manager stopped")
        for line in d.cleanup():
            s.say(f"cleanup: {line}")


def _recovery_line(rec: dict[str, Any], job_id: int, state: str, fault: float) -> str:
    """One recovery as the supervisor's status file records it; the times as the full demo words them:
    fault to confirmed ("confirmed in"), confirmed to the first step after the restore ("training
    again"); ``fault``: when this demo set the node DOWN (the supervisor's own ``fault_at`` is its
    estimate)."""
    def span(a: str, b: str) -> str:
        return f"{rec[b] - rec[a]:.1f} s" if rec.get(a) and rec.get(b) else "?"

    first = f"{rec['first_step_at'] - fault:.2f} s" if rec.get("first_step_at") else "?"
    return (f"Slurm job {job_id} before and {rec.get('slurm_job_id_after', '?')} after "
            f"({state.split()[0] if state else '?'}): "
            f"{','.join(rec['removed']) or '-'} out, {','.join(rec['added']) or 'no spare'} in, dp "
            f"{rec['data_parallel_size_before']} -> {rec['data_parallel_size_after']}, {rec['spares_left']} spare(s) "
            f"left; confirmed {_since(rec.get('confirmed_at'), fault)} after the fault, training again "
            f"{span('confirmed_at', 'first_step_at')} later (fault to first step {first})"
            + (f"; {rec['relaunches'] - 1} more relaunch(es) in place before it trained "
               f"({', '.join(rec.get('causes_after') or [])})" if rec.get("relaunches", 1) > 1 else ""))


def _since(at: float | None, fault: float) -> str:
    return f"{at - fault:.1f} s" if at else "?"


def _shrink_step(d: BusyDemo) -> int:
    """The first step trained with fewer replicas (the metrics' own data_parallel_size)."""
    steps = []
    for lines in read_tree(d.work / "metrics").values():
        for _, line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("data_parallel_size") == 1:
                steps.append(int(r["step"]))
    return min(steps) if steps else 1 << 30

