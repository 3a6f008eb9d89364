"""The phases of ``omni demo``, each a function: files, data, submission, manager, drill, checks, report.

The demo's folder (``.omni/demo`` beside the cluster's state, ``~/omni-demo`` with ``--user``) is
rebuilt on every run: the job must not resume from a checkpoint of an earlier demo. Every command the
story runs is the user's own (``omni submit``, ``omni manager run``, ``omni report``), started as a
subprocess with an argv list, by the process telling the story: with ``--user`` that process already
runs as the user (drill/user_session.py), so nothing here switches users or hands files over.
"""

from __future__ import annotations

import hashlib
import json
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
from slurm_omni.formats.metrics import read_folder
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
    @property
    def shm(self) -> Path:
        """The demo job's memory tier, one folder per node below it (the demo site's ``memory_dir``)."""
        digest = hashlib.sha256(str(self.work).encode()).hexdigest()[:10]
        return Path("/dev/shm") / f"omni-demo-{os.geteuid()}-{digest}"


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
    free_memory(files)   # an earlier demo's, should one have been stopped before its end
    values = {"{work}": str(files.work), "{shm}": str(files.shm), "{spool}": str(cluster.paths.spool),
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


def free_memory(files: DemoFiles, lost: Collection[str] = ()) -> str | None:
    """Remove the demo's memory tier folder (``files.shm``, one folder per node) once its jobs ended,
    and say what was left in it: the job's folders are its standbys' to free (``memtier.free_job``),
    so files on a node other than one the drill took down (``lost``: its standby was killed with it, as
    a node lost for real takes its memory along) are a leak, and the line says so."""
    if not files.shm.is_dir() or files.shm.is_symlink():
        return None
    left: dict[str, int] = {}
    for path in files.shm.rglob("*"):
        if not path.is_dir():
            node = path.relative_to(files.shm).parts[0]
            left[node] = left.get(node, 0) + 1
    shutil.rmtree(files.shm, ignore_errors=True)
    leaked = {n: c for n, c in left.items() if n not in lost}
    downed = {n: c for n, c in left.items() if n in lost}
    parts = [f"{c} file(s) on {n}, the node the drill took down (its standby went with it)" for n, c in downed.items()]
    parts += [f"{c} file(s) on {n} NOT freed by its standby" for n, c in leaked.items()]
    if not parts:
        return f"nothing of the job left in {files.shm} (its standbys freed it); folder removed"
    return f"memory tier {files.shm}: " + "; ".join(parts) + "; removed"


def restore_line(metrics: Path) -> str | None:
    """Where each rank of the life after the first fault restored from and how many steps were lost,
    from the ranks' own metrics lines (the new life's first line per rank: ``restore_source``; steps
    lost: the faulted life's last step minus the step the next life restored). None before a relaunch."""
    by_life: dict[int, list[dict[str, object]]] = {}
    for lines in read_folder(metrics).values():   # own files and node files (formats/metrics)
        for _, line in lines:
            try:
                doc = json.loads(line)
                by_life.setdefault(int(doc["incarnation"]), []).append(doc)
            except (ValueError, KeyError, TypeError):
                continue
    lives = sorted(by_life)
    if len(lives) < 2:
        return None
    old, new = by_life[lives[0]], by_life[lives[1]]
    firsts: dict[int, dict[str, object]] = {}
    for doc in sorted(new, key=lambda d: int(d["step"])):  # type: ignore[call-overload]
        firsts.setdefault(int(doc["rank"]), doc)  # type: ignore[call-overload]
    last = max(int(d["step"]) for d in old)  # type: ignore[call-overload]
    restored = min(int(d["step"]) for d in firsts.values()) - 1  # type: ignore[call-overload]
    groups: dict[str, list[int]] = {}
    for rank, doc in sorted(firsts.items()):
        groups.setdefault(str(doc.get("restore_source") or "nothing"), []).append(rank)
    where = "; ".join(f"rank{'s' if len(r) > 1 else ''} {compress_ranks(r)} from {src}" for src, r in groups.items())
    lost = last - restored
    inherited = [rank for rank, doc in sorted(firsts.items()) if doc.get("restore_inherited")]
    return (f"restored step {restored}: {where}; {lost} step{'' if lost == 1 else 's'} lost "
            f"(life {lives[0]} reached step {last})"
            + (f"; rank{'s' if len(inherited) > 1 else ''} {compress_ranks(inherited)} read the copies "
               f"{'they' if len(inherited) > 1 else 'it'} inherited from {'their' if len(inherited) > 1 else 'its'} "
               f"node's standby" if inherited else ""))


def compress_ranks(ranks: list[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)
