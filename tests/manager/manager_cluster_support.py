"""Running the manager and real training jobs on the embedded cluster: site and job files, the
manager as a subprocess (``omni manager run``), journal and heartbeat probes, node state restore."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from omni_configs import site_toml
from support import wait_until

from slurm_omni.manager.events import read_heartbeats
from slurm_omni.manager.journal import Journal, Recovery
from slurm_omni.ownership import current_user
from slurm_omni.runtime.synth import SynthSpec, write_shards
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import Job

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

def site_text(tmp: Path, spool: Path, *, spare_policy: str = "any_switch", quarantine_s: float = 3600,
              drain_failed: bool = False) -> str:
    """The embedded cluster's site config (tests/omni_configs.py) with its folders under ``tmp``,
    the spool at ``spool`` and an ``[elasticity]`` table."""
    return site_toml(tmp, spool_dir=spool, tables=(f'[elasticity]\nspare_policy = "{spare_policy}"\n'
                                                   f"quarantine_s = {quarantine_s}\n"
                                                   f"drain_failed = {str(drain_failed).lower()}\n"))


JOB = """
[job]
name = "{name}"
data_parallel_size = {dp}
time_limit = "00:10:00"
signal_before_s = 60
max_requeues = 3
log_dir = "{tmp}/logs"
[[stages]]
name = "vision"
nodes = {dp}
[[stages]]
name = "text"
nodes = {dp}
[training]
max_steps = {max_steps}
[training.model]
preset = "tiny"
[training.parallel]
global_batch_size = 4
micro_batch_size = 1
[training.data]
shard_dir = "{shards}"
[training.checkpoint]
every_steps = 5
keep_last = 3
"""

JOB_ENV = {"OMNI_STEP_DELAY_S": "0.2", "OMNI_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1"}


def job_file_text(name: str, tmp: Path, shards: Path, *, dp: int = 1, max_steps: int = 2000) -> str:
    return JOB.format(name=name, dp=dp, tmp=tmp, shards=shards, max_steps=max_steps)


def make_shards(root: Path) -> Path:
    write_shards(SynthSpec(out_dir=root / "shards", pairs=32, text=16, shard_size=16))
    return root / "shards"


@dataclass
class ManagerRun:
    """One job on the cluster and the manager watching it."""

    tmp: Path
    env: dict[str, str]
    name: str
    job_id: int = 0
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    restore_nodes: set[str] = field(default_factory=set)
    extra_jobs: set[int] = field(default_factory=set)
    """Slurm jobs the test made besides ``name``'s (array jobs, sleep jobs): cancelled at the end."""
    user: str | None = None
    """Run ``omni submit``, sbatch and the manager as this unprivileged user (tests/multiuser)."""
    ckpt_root: Path | None = None
    """The site's checkpoint root; default ``tmp/ckpt``."""

    def as_user(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """``argv`` and ``env`` to run as ``user`` (setpriv keeps the environment; HOME is theirs)."""
        if self.user is None:
            return argv, env
        home = f"/home/{self.user}"
        return (["setpriv", f"--reuid={self.user}", f"--regid={self.user}", "--init-groups", *argv],
                {**env, "HOME": home, "USER": self.user, "LOGNAME": self.user})

    @property
    def site(self) -> Path:
        return self.tmp / "site.toml"

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    @property
    def key(self) -> str:
        return f"{self.name}-{self.job_id}"

    @property
    def heartbeat_dir(self) -> Path:
        return (self.ckpt_root or self.tmp / "ckpt") / (self.user or current_user()) / self.name / "heartbeat"

    def runner(self) -> CommandRunner:
        return CommandRunner(self.env, timeout_s=20)

    def submit(self, *job_files: Path, extra_env: dict[str, str] | None = None) -> int:
        """``omni submit`` of the run's job file (or of ``job_files``: several make a sweep), from the
        run's environment plus ``extra_env``."""
        files = [str(f) for f in job_files] or [str(self.tmp / "job.toml")]
        argv, env = self.as_user([str(BIN / "omni"), "submit", *files, "--site", str(self.site)],
                                 {**self.env, **(extra_env or {})})
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise AssertionError(f"omni submit exited {done.returncode}: {done.stderr.strip()}")
        out = done.stdout
        self.job_id = int(out.split("submitted job ")[1].split()[0])
        self.extra_jobs.add(self.job_id)
        return self.job_id

    def sbatch(self, *argv: str) -> int:
        """A plain ``sbatch --parsable`` job (cancelled at the end)."""
        (self.tmp / "logs").mkdir(exist_ok=True)
        out = self.runner().run(["sbatch", "--parsable", f"--output={self.tmp}/logs/sbatch-%j.out", *argv]).stdout
        job_id = int(out.strip().split(";")[0])
        self.extra_jobs.add(job_id)
        return job_id

    def start_manager(self, **extra_env: str) -> None:
        log = open(self.tmp / f"manager-{self.starts}.log", "wb")   # noqa: SIM115 (closed with the process)
        self.starts += 1
        argv = [sys.executable, "-m", "slurm_omni.cli.main", "-v", "manager", "run", "--site-config",
                str(self.site), "--state-dir", str(self.state_dir), "--poll-interval", "1", "--tick", "0.25"]
        argv, env = self.as_user(argv, {**self.env, **extra_env})
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def wait_watching(self, slurm_job_id: int, timeout_s: float = 90) -> None:
        """Until the manager journaled the job's incarnation running (it watches it): a fault
        drilled before a slow start (a loaded machine takes seconds to import) would be a past the
        manager never saw."""
        def probe() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"manager exited {self.proc.returncode}\n{self.manager_log()}")
            return bool(self.rows("SELECT 1 FROM incarnations WHERE slurm_job_id = ? AND started_at IS NOT NULL",
                                  str(slurm_job_id)))
        wait_until(probe, timeout_s, f"the manager to watch job {slurm_job_id}", interval_s=0.5)

    def stop_manager(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def manager_log(self) -> str:
        return "\n".join((self.tmp / f"manager-{i}.log").read_text(errors="replace")[-16000:]
                         for i in range(self.starts))

    # -- probes --------------------------------------------------------------------------------
    def journal(self) -> Journal:
        return Journal(self.state_dir / "journal.sqlite", readonly=True)

    def recoveries(self, key: str | None = None) -> list[Recovery]:
        if not (self.state_dir / "journal.sqlite").exists():
            return []
        with self.journal() as j:
            return j.recoveries(key or self.key)

    def rows(self, query: str, *args: object) -> list[tuple[Any, ...]]:
        """Rows of a read-only query on the journal ([] before the manager made it)."""
        path = self.state_dir / "journal.sqlite"
        if not path.exists():
            return []
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(query, args).fetchall()
        except sqlite3.OperationalError:   # the manager has not made its tables yet
            return []
        finally:
            con.close()

    def incarnations(self) -> list[dict[str, Any]]:
        with self.journal() as j:
            return j.incarnations(self.key)

    def beats(self, slurm_job_id: int | None = None, heartbeat_dir: Path | None = None) -> dict[int, dict[str, Any]]:
        """Rank -> its heartbeat, for ranks of ``slurm_job_id`` (default: the registered job)."""
        wanted = str(slurm_job_id or self.job_id)
        # the package's reader: a file per rank, or per node where the job aggregates its beats
        return {hb.rank: msgspec.to_builtins(hb) for hb in read_heartbeats(heartbeat_dir or self.heartbeat_dir)
                if hb.job_id == wanted}

    def wait_steps(self, slurm_job_id: int, ranks: int, step: int, timeout_s: float = 120,
                   heartbeat_dir: Path | None = None) -> dict[int, dict[str, Any]]:
        def probe() -> dict[int, dict[str, Any]] | None:
            b = self.beats(slurm_job_id, heartbeat_dir)
            ok = len(b) == ranks and all(r["phase"] == "training" and r["step"] >= step for r in b.values())
            return b if ok else None
        return wait_until(probe, timeout_s, f"{ranks} ranks of job {slurm_job_id} at step {step}\n"
                          + self.job_log(slurm_job_id), interval_s=0.5)

    def wait_recovery(self, count: int, phase: str, timeout_s: float = 120, key: str | None = None) -> list[Recovery]:
        def probe() -> list[Recovery] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"manager exited {self.proc.returncode}\n{self.manager_log()}")
            recs = self.recoveries(key)
            return recs if len(recs) >= count and recs[count - 1].times[phase] is not None else None
        try:
            return wait_until(probe, timeout_s, f"recovery {count} to reach {phase}", interval_s=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.manager_log()}") from None

    def job_log(self, slurm_job_id: int) -> str:
        path = self.tmp / "logs" / f"{self.name}-{slurm_job_id}.out"
        return path.read_text(errors="replace")[-3000:] if path.exists() else f"(no {path.name})"

    def components(self, slurm_job_id: int) -> list[list[str]]:
        from slurm_omni.slurm.cli_backend import CliBackend
        job = next(j for j in CliBackend(env=self.env).jobs() if j.job_id == slurm_job_id)
        return [list(c.nodes) for c in job.components]

    def set_node(self, node: str, state: str, reason: str = "omni-test") -> None:
        argv = ["scontrol", "update", f"nodename={node}", f"state={state}"]
        if state.upper() in ("DOWN", "DRAIN"):
            argv.append(f"reason={reason}")
            self.restore_nodes.add(node)
        self.runner().run(argv)

    def cleanup(self) -> None:
        self.stop_manager()
        runner = self.runner()
        # twice: a job may be requeuing (after USR1, or by Slurm for a lost node) while it is cancelled
        for _ in range(2):
            for job in list_jobs(self.env):
                if job.name == self.name or job.job_id in self.extra_jobs or job.array_job_id in self.extra_jobs:
                    runner.run(["scancel", str(job.job_id)], check=False)
            time.sleep(2)
        for node in sorted(self.restore_nodes):
            runner.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)


def list_jobs(env: dict[str, str]) -> list[Job]:
    """Every job, parsed (squeue --json's raw records differ by version: 24.11+ numbers are objects)."""
    from slurm_omni.slurm.cli_backend import CliBackend
    return CliBackend(env=env, timeout_s=20).jobs()


@contextmanager
def manager_run(tmp: Path, cluster_env: dict[str, str], spool: Path, shards: Path, *, name: str, dp: int = 1,
                spare_policy: str = "any_switch", quarantine_s: float = 3600, drain_failed: bool = False,
                max_steps: int = 2000) -> Iterator[ManagerRun]:
    (tmp / "site.toml").write_text(site_text(tmp, spool, spare_policy=spare_policy, quarantine_s=quarantine_s,
                                             drain_failed=drain_failed))
    (tmp / "job.toml").write_text(job_file_text(name, tmp, shards, dp=dp, max_steps=max_steps))
    env = {**os.environ, **cluster_env, **JOB_ENV, "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = ManagerRun(tmp, env, name)
    try:
        yield run
    finally:
        run.cleanup()


def step_time(run: ManagerRun, slurm_job_id: int, rank: int, seconds: float = 3.0) -> float:
    """Wall seconds per global step as the heartbeats show it (the confirmer's own measure)."""
    first = run.beats(slurm_job_id)[rank]
    time.sleep(seconds)
    last = run.beats(slurm_job_id)[rank]
    return (last["time"] - first["time"]) / max(1, last["step"] - first["step"])


def allocation_site(tmp: Path, spool: Path, *, extra: str = "") -> str:
    """A site in allocation mode with no spares, every stage in the ``debug`` partition (the grow-back
    and time-limit tests); ``extra``: more ``[elasticity]`` lines."""
    text = site_toml(tmp, spool_dir=spool, tables='[elasticity]\nrecovery = "allocation"\nallow_allocation = true\n'
                                                  'default_spares = 0\n' + extra)
    return text.replace('partition = "vision"', 'partition = "debug"').replace('partition = "text"',
                                                                                'partition = "debug"')
