"""The phases of ``omni demo``, each a function: files, data, submission, manager, drill, checks, report.

The demo's folder (``.omni/demo`` beside the cluster's state, ``~/omni-demo`` with ``--user``) is
rebuilt on every run: the job must not resume from a checkpoint of an earlier demo. Every command the
story runs is the user's own (``omni submit``, ``omni manager run``, ``omni report``), started as a
subprocess with an argv list, by the process telling the story: with ``--user`` that process already
runs as the user (drill/user_session.py), so nothing here switches users or hands files over.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.cluster.local import LocalCluster
from slurm_omni.config.site import SiteConfig, load_site
from slurm_omni.drill.equivalence import Equivalence, check_equivalence
from slurm_omni.drill.history import load_history
from slurm_omni.drill.inject import REASON, DrillError, Injector
from slurm_omni.drill.job import JobHandle, find_registration
from slurm_omni.drill.reference import JOB_ENV
from slurm_omni.manager.journal import incarnation_tag
from slurm_omni.ownership import current_user
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import compress

log = logging.getLogger(__name__)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "demo"
STEP_DELAY_S = "0.25"
"""Pacing of the demo job's steps, so a fault lands mid-run and the curve has room after it."""


@dataclass(frozen=True, slots=True)
class DemoFiles:
    work: Path

    @property
    def site(self) -> Path: return self.work / "omni.toml"
    @property
    def job(self) -> Path: return self.work / "job.toml"
    @property
    def shards(self) -> Path: return self.work / "shards"
    @property
    def manager_dir(self) -> Path: return self.work / "manager"
    @property
    def reference(self) -> Path: return self.work / "reference"
    @property
    def drills(self) -> Path: return self.work / "drills"
    @property
    def report(self) -> Path: return self.work / "report"


def omni_argv(*args: str) -> list[str]:
    """``omni ARGS`` with this interpreter (no reliance on PATH for the demo's own commands)."""
    return [sys.executable, "-m", "slurm_omni.cli.main", *args]


def job_environment(cluster: LocalCluster) -> dict[str, str]:
    """What ``omni submit`` passes on to the ranks: traced ids, one thread, pacing, ``omni`` on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    # The cluster's PATH when it has one (the wrappers of a Slurm from a Debian root come first).
    path = cluster.env.get("PATH") or os.environ.get("PATH", "")
    return {**os.environ, **cluster.env, **JOB_ENV, "OMNI_STEP_DELAY_S": STEP_DELAY_S,
            "PATH": path if path.split(os.pathsep)[0] == bin_dir else f"{bin_dir}{os.pathsep}{path}"}


def write_files(files: DemoFiles, cluster: LocalCluster, examples: Path = EXAMPLES,
                job_file: Path | None = None, recovery: str | None = None) -> None:
    """A fresh demo folder with the example job file and site config filled in. ``job_file``: another
    job (``omni demo --job-file``), copied with the files beside it (its script), in place of the demo's.
    ``recovery``: the site's default recovery path (None: the example site's own, the fastest it
    allows: allocation mode; a job file's ``[job] recovery`` wins)."""
    if files.work.exists():
        shutil.rmtree(files.work)
    files.work.mkdir(parents=True)
    values = {"{work}": str(files.work), "{spool}": str(cluster.paths.spool),
              "{nodes}": compress(cluster.spec.node_names)}
    job_src = examples / "job.toml"
    if job_file is not None:
        job_src = job_file
        copy_job_folder(job_file.parent, files.work)
    for src, dst in ((job_src, files.job), (examples / "omni.toml", files.site)):
        text = src.read_text()
        if dst == files.site and recovery is not None:
            text = _site_for(recovery, text, src)
        for key, value in values.items():
            text = text.replace(key, value)
        dst.write_text(text)
    load_site(files.site)   # a broken example fails here, with the file and key named


MAX_JOB_FOLDER_BYTES = 512 << 20
MAX_JOB_FOLDER_FILES = 20000
_NOT_COPIED = ("__pycache__", "logs", "omni-run")


def copy_job_folder(src: Path, dst: Path, *, max_bytes: int = MAX_JOB_FOLDER_BYTES,
                    max_files: int = MAX_JOB_FOLDER_FILES) -> int:
    """The job file's whole folder into the demo's (its script, the script's ``data/``, its configs),
    as the job's workdir finds them: regular files and folders only, no symlink followed (its target
    may lie outside the folder), hidden entries, ``__pycache__``, ``logs`` and ``omni-run`` (a local
    run's state) left out; bounded in size and count (a DrillError names the limit). Returns the
    number of files copied."""
    planned: list[tuple[Path, Path]] = []
    size = 0
    for root, dirs, names in os.walk(src, followlinks=False):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _NOT_COPIED
                         and not (here / d).is_symlink())
        for name in sorted(names):
            path = here / name
            if name.startswith(".") or path.is_symlink() or not path.is_file():
                continue
            size += path.stat().st_size
            planned.append((path, dst / path.relative_to(src)))
            if size > max_bytes or len(planned) > max_files:
                raise DrillError(f"demo: couldn't copy the job's folder {src}: more than {max_bytes >> 20} MiB or "
                                 f"{max_files} files (give the demo a job file in a folder of its own)")
    for path, target in planned:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target, follow_symlinks=False)
    return len(planned)


def _site_for(recovery: str, text: str, src: Path) -> str:
    """The demo's site config with ``recovery`` as its default path. The example's own default is the
    fastest its site allows (allocation mode: one partition, a spare per stage, ``allow_allocation``);
    ``in_allocation`` and ``resubmit`` are set in its ``[elasticity]`` table."""
    if recovery not in ("allocation", "in_allocation", "resubmit"):
        raise DrillError(f"demo: couldn't use recovery {recovery!r} (allocation, in_allocation, resubmit)")
    if "[elasticity]\n" not in text:
        raise DrillError(f"demo: couldn't set the recovery path in {src}: no [elasticity] table")
    if recovery == "allocation":
        return text.replace("allow_allocation = false", "allow_allocation = true")
    return text.replace("[elasticity]\n", f'[elasticity]\nrecovery = "{recovery}"\n', 1)


def describe_job(files: DemoFiles, site: SiteConfig) -> str:
    """The submitted job in a few words, from its job file: its stages by their own names, the replicas,
    the recovery path (``gpt stage, 2 replicas; ordinary job, recovery by resubmission``)."""
    from slurm_omni.config.job import load_job
    from slurm_omni.render import HetJobRequest, plan_stages

    job = load_job(files.job)
    plans = plan_stages(job, site)
    names = " | ".join(p.name for p in plans)
    many = len(plans) > 1
    replicas = f"{job.job.data_parallel_size} replica{'s' if job.job.data_parallel_size > 1 else ''}" + (
        " each" if many else "")
    request = HetJobRequest(job=job, site=site, job_file=files.job, job_sha256="")
    shape, _ = request.in_allocation()
    if shape is not None:
        spares = sum(p.spares for p in plans)
        how = "no batch script, " if request.recovery == "allocation" else ""
        road = (f"one allocation of {shape.nodes} nodes ({spares} spare{'s' if spares != 1 else ''}), "
                f"{how}recovery in it")
    else:
        road = f"{'het' if many else 'ordinary'} job, recovery by resubmission"
    return f"{names} stage{'s' if many else ''}, {replicas}; {road}"


def builtin_trainer(files: DemoFiles) -> bool:
    """The job runs the built-in trainer (no ``[training] command``), which reads the demo's shards."""
    from slurm_omni.config.job import load_job

    return not load_job(files.job).training.command


def synthesize(files: DemoFiles) -> int:
    """Image-text pairs and text-only samples for the job (``omni data synth``); returns the sample count."""
    from slurm_omni.runtime.synth import SynthSpec, write_shards

    spec = SynthSpec(out_dir=files.shards, pairs=96, text=32, shard_size=32)
    write_shards(spec)
    return spec.pairs + spec.text


def submit(files: DemoFiles, env: dict[str, str]) -> int:
    """``omni submit job.toml --site omni.toml``; the Slurm job id."""
    proc = subprocess.run(omni_argv("submit", str(files.job), "--site", str(files.site)), env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise DrillError(f"demo: couldn't submit: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    # "submitted job 123 (name); registered in ..."
    return parse_sbatch_id(line.split()[2] if line.startswith("submitted job ") else line)


@dataclass
class ManagerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "no output"


def start_manager(files: DemoFiles, env: dict[str, str]) -> ManagerProcess:
    """``omni manager run`` in the background, its output in manager/manager.log."""
    files.manager_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = files.manager_dir / "manager.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(omni_argv("-v", "manager", "run", "--site-config", str(files.site),
                                          "--state-dir", str(files.manager_dir), "--poll-interval", "1"),
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    manager = ManagerProcess(proc, log_path)
    time.sleep(1.0)
    if not manager.alive():
        raise DrillError(f"demo: couldn't start the manager: {manager.tail()} (see {log_path})")
    return manager


def handle(files: DemoFiles, job_id: int) -> JobHandle:
    site = load_site(files.site)
    return JobHandle.from_registration(find_registration(site, str(job_id)), site)


def compare(files: DemoFiles, metrics: Path, reference_metrics: Path, stages: tuple[str, ...] = ()) -> Equivalence:
    """The run against the reference by the job's data contract (``[training.parallel] data_order``),
    which the line names (drill/equivalence.py); ``stages``: the job's stage names in pipeline order."""
    from slurm_omni.config.job import load_job

    order = load_job(files.job).training.parallel.data_order
    return check_equivalence(load_history(metrics, stages), load_history(reference_metrics, stages),
                             data_order=order)


def recovery_path(timeline: Path) -> str:
    """The newest recovery's road as the manager's timeline says it: ``in_allocation`` (the same
    Slurm job), ``resubmitted`` or ``requeued``, and the Slurm job before and after."""
    from slurm_omni.errors import OmniError
    from slurm_omni.report.timeline import load_timeline

    try:
        recoveries = load_timeline(timeline).recoveries
    except OmniError as e:
        return f"path unknown ({e})"
    if not recoveries:
        return "path unknown (no recovery in the timeline)"
    r = recoveries[-1]
    return f"path {r.path or '?'}: Slurm job {r.job_id} -> {r.new_job_id or '?'}"


def report(files: DemoFiles, h: JobHandle, reference_metrics: Path, env: dict[str, str],
           timeline: Path | None) -> str:
    """``omni report``; its summary text."""
    argv = omni_argv("report", "-m", str(h.metrics_dir), "-r", str(reference_metrics), "--heartbeats",
                     str(h.heartbeat_dir), "-o", str(files.report), "--job-id", str(h.job_id),
                     "--title", "omni demo: node down mid-run, automatic recovery")
    if timeline is not None:
        argv += ["--timeline", str(timeline)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)
    if proc.returncode != 0:
        raise DrillError(f"demo: couldn't write the report: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return proc.stdout


def cleanup(backend: CliBackend, injector: Injector, job_ids: Collection[int], manager: ManagerProcess | None,
            *, keys: Collection[str] = ()) -> list[str]:
    """Manager stopped, the demo's jobs cancelled, nodes a drill left down resumed; what was done.

    The jobs are the ones the demo submitted (``job_ids``) and the manager's resubmissions of them
    (their comment carries the incarnation tag of a registration in ``keys``, ``<name>-<job id>``),
    and only the current user's: never a job because of its name (another user's job may have it).
    The nodes: those the injector set down, and those the manager drained for one of ``keys``."""
    done = []
    if manager is not None and manager.alive():
        manager.stop()
        done.append("manager stopped")
    ids = set(job_ids)
    tags = tuple(incarnation_tag(key, 0)[:-1] for key in keys)      # "omni.<key>."
    try:
        for job in backend.jobs(user=current_user()):
            ours = job.job_id in ids or any(c.job_id in ids for c in job.components) or \
                bool(tags and job.comment.startswith(tags))
            if ours and not job.state.finished:
                backend.cancel(str(job.job_id))
                done.append(f"job {job.job_id} cancelled")
        for node in backend.nodes():
            drained = any(node.reason.endswith(f" in {key}") for key in keys)
            if node.name in injector.allowed and ((node.name in injector.downed and REASON in node.reason)
                                                  or drained):
                injector.resume(node.name)
                done.append(f"{node.name} resumed")
    except Exception as e:  # noqa: BLE001 (cleanup reports, it never hides the first failure)
        done.append(f"cleanup incomplete: {e}")
    return done
