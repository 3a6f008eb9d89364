"""The light rank's own CPU, Python against C side by side (issue 19's emulation cost).

    python bench/light_cost.py [--lives 15] [--ranks 16] [--seconds 10]

start: CPU milliseconds of a rank's start alone (exec to its exit 78 on a bad WORLD_SIZE: the
interpreter or loader, the environment read) and of its whole life of one step (the start, its beats,
a durable marker, the end), medians of --lives, the kinds in turn (children's rusage); steady: CPU
milliseconds per rank per second of --ranks ranks (4 per node name, beats per node in /dev/shm as the
scale bench's ranks do, its pace: 1 s heartbeat, 0.5 s steps, a marker every 3), /proc/PID/stat over
--seconds once they all stepped, user and system apart. The 1-minute load is printed beside each:
the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.light_build import PYTHON_RANK, build

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _env(work: Path, rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), OMNI_DP_SIZE=str(world), OMNI_DP_RANK=str(rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMNI_CKPT_DIR=str(work / "ckpt"),
               OMNI_HEARTBEAT_DIR=str(work / "hb"), OMNI_METRICS_DIR=str(work / "metrics"),
               OMNI_HEARTBEAT_INTERVAL="1", OMNI_STEP_DELAY_S="0.5", OMNI_LIGHT_CKPT_EVERY="3",
               SLURMD_NODENAME=f"node{rank // 4}", OMNI_JOB_ID=f"cost-{os.getpid()}-{work.name}")
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def start_cpu(argv: list[str], work: Path, lives: int, *, bare: bool) -> float:
    runs = []
    for i in range(lives):
        extra = {"WORLD_SIZE": "x"} if bare else {"OMNI_MAX_STEPS": "1", "OMNI_STEP_DELAY_S": "0"}
        before = _children_cpu()
        proc = subprocess.run(argv, env=_env(work / f"life-{i}", 0, 1, 0, **extra), stderr=subprocess.DEVNULL,
                              check=False, timeout=60)
        runs.append(_children_cpu() - before)
        if proc.returncode != (78 if bare else 0):
            raise SystemExit(f"light_cost: {argv[-1]} exited {proc.returncode}")
    return statistics.median(runs) * 1000


def _proc_cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def steady_cpu_ms(argv: list[str], work: Path, ranks: int, seconds: float) -> tuple[float, float]:
    """User and system CPU milliseconds per rank per second."""
    port = _free_port()
    procs = [subprocess.Popen(argv, env=_env(work, r, ranks, port, OMNI_MAX_STEPS="100000"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(ranks)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (work / "ckpt" / "light" / f"rank-{ranks - 1}").exists():
            time.sleep(0.2)   # every rank past the rendezvous and its first marker
        time.sleep(1.0)
        t0, c0 = time.monotonic(), [_proc_cpu(p.pid) for p in procs]
        time.sleep(seconds)
        t1, c1 = time.monotonic(), [_proc_cpu(p.pid) for p in procs]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    return tuple(sum(b[k] - a[k] for a, b in zip(c0, c1)) / ranks / (t1 - t0) * 1000 for k in (0, 1))  # type: ignore[return-value]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lives", type=int, default=15)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="light-cost-") as tmp:
        work = Path(tmp)
        kinds = {"python": [sys.executable, "-S", str(PYTHON_RANK)], "c": [str(build(work / "bin"))]}
        for bare, what in ((True, "start alone (exec to exit 78)"), (False, "a life of one step")):
            ms = {k: start_cpu(argv, work / f"start-{k}-{bare}", args.lives, bare=bare) for k, argv in kinds.items()}
            print(f"{what}, CPU, median of {args.lives}: python {ms['python']:.1f} ms, c {ms['c']:.2f} ms "
                  f"(c/python {ms['c'] / ms['python']:.3f}; load {os.getloadavg()[0]:.1f})", flush=True)
        steady = {k: steady_cpu_ms(argv, work / f"steady-{k}", args.ranks, args.seconds) for k, argv in kinds.items()}
        total = {k: sum(v) for k, v in steady.items()}
        print(f"steady ({args.ranks} ranks, 4 per node, 1 s beats, 0.5 s steps, over {args.seconds:g} s), CPU per rank: "
              + ", ".join(f"{k} {total[k]:.3f} ms/s (user {u:.3f}, system {s:.3f})" for k, (u, s) in steady.items())
              + f" (c/python {total['c'] / total['python']:.3f}; load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
