"""Start the ranks of a training job on this machine, with the environment srun would give them.

Tests, benchmarks and the demo use it; on a cluster the sbatch template starts ``omni train`` with
srun instead. Ranks are plain subprocesses (argv lists, no shell); stage-major rank order as in
``slurm_omni.elastic.layout``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True)
class LocalJob:
    """The running ranks of one local launch."""

    procs: list[subprocess.Popen[bytes]]
    log_dir: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout_s: float) -> list[int]:
        """Exit codes of every rank; ranks still running at the deadline are killed (code -9)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def send(self, sig: signal.Signals) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def kill(self) -> list[int]:
        self.send(signal.SIGKILL)
        return [p.wait() for p in self.procs]

    def logs(self) -> str:
        return "\n".join(f"--- rank {i} ---\n{(self.log_dir / f'rank-{i}.log').read_text(errors='replace')[-3000:]}"
                         for i in range(len(self.procs)))


def launch_local(config: Path, *, data_parallel_size: int, run_dir: Path, incarnation: int = 0,
                 extra_env: Mapping[str, str] | None = None, threads_per_rank: int = 1,
                 colocated: bool = False, command: Sequence[str] = (),
                 stages: Sequence[str] = ("vision", "text")) -> LocalJob:
    """Start ``2 * data_parallel_size`` ranks of ``omni train --config config`` (``data_parallel_size``
    ranks running both stages when ``colocated``), or of ``command`` (a job file's own script, which
    also gets ``OMNI_STAGES``).

    ``run_dir`` gets ckpt/, heartbeat/, metrics/ and logs/ (shared by incarnations, as on a cluster
    where the job's folders outlive its processes)."""
    world = data_parallel_size if colocated else len(stages) * data_parallel_size
    port = free_port()
    log_dir = run_dir / "logs" / f"incarnation-{incarnation}"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMNI_DP_SIZE": str(data_parallel_size),
            "OMNI_DP_RANK": str(rank % data_parallel_size),
            "OMNI_CKPT_DIR": str(run_dir / "ckpt"), "OMNI_HEARTBEAT_DIR": str(run_dir / "heartbeat"),
            "OMNI_METRICS_DIR": str(run_dir / "metrics"), "OMNI_INCARNATION": str(incarnation),
            "OMP_NUM_THREADS": str(threads_per_rank), "OMNI_LOG_LEVEL": env.get("OMNI_LOG_LEVEL", "INFO"),
        })
        if colocated:
            env["OMNI_COLOCATE"] = "1"
        else:
            env["OMNI_STAGE"] = str(rank // data_parallel_size)
        env.setdefault("OMNI_DEVICE", "cpu")
        if command:
            env["OMNI_STAGES"] = ",".join(stages)
        env.update(extra_env or {})
        argv = list(command) or [sys.executable, "-m", "slurm_omni.cli.main", "train", "--config", str(config)]
        with open(log_dir / f"rank-{rank}.log", "wb") as out:
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return LocalJob(procs=procs, log_dir=log_dir)
