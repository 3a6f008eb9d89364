"""``omni drill slow-node``: the ranks of a job on one node run F times slower until the drill ends.

The ranks are found by their heartbeats (each names its pid and node), for the job's newest Slurm
job; each pid must be ours and its environment must name the node (a pid the kernel reused for
something else is refused). The throttle (drill/throttle.py) is undone when the drill ends: after
``duration_s``, on Ctrl-C or on SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from slurm_omni.drill.inject import DrillError
from slurm_omni.drill.throttle import CgroupQuota, Method, Throttle, check_owned, throttle
from slurm_omni.manager.events import read_heartbeats

log = logging.getLogger(__name__)


def rank_pids(heartbeat_dir: Path, node: str) -> tuple[str, dict[int, int], dict[int, float]]:
    """(Slurm job id, rank -> pid, pid -> busy fraction) of the newest job's training ranks on
    ``node``; the busy fraction is the rank's own time (compute + data) over its step time."""
    beats = [hb for hb in read_heartbeats(heartbeat_dir) if hb.phase in ("training", "checkpointing")]
    if not beats:
        raise DrillError(f"drill: couldn't find training ranks in {heartbeat_dir} (is the job running?)")
    job = max(beats, key=lambda hb: hb.time).job_id
    mine = [hb for hb in beats if hb.job_id == job and hb.node == node]
    on_node = {hb.rank: hb.pid for hb in mine}
    busy = {hb.pid: (hb.compute_s + (hb.data_s or 0.0)) / hb.step_time_s for hb in mine
            if hb.compute_s is not None and hb.step_time_s}
    if not on_node:
        nodes = sorted({hb.node or "?" for hb in beats if hb.job_id == job})
        raise DrillError(f"drill: couldn't find ranks of Slurm job {job} on {node} (it runs on {', '.join(nodes)})")
    for pid in on_node.values():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError as e:
            raise DrillError(f"drill: couldn't read the environment of pid {pid}: {e.strerror} (the rank runs "
                             "on another host, or exited: run the drill on the node's host)") from e
        if f"SLURMD_NODENAME={node}".encode() not in environ or f"SLURM_JOB_ID={job}".encode() not in environ:
            raise DrillError(f"drill: couldn't trust pid {pid}: it is not a task of Slurm job {job} on {node}")
    return job, on_node, busy


def slow_node(heartbeat_dir: Path, nodes: list[str], factor: float, *, method: Method = "auto",
              duration_s: float = 0.0, say: Callable[[str], None] = print) -> Throttle:
    """Throttle the job's ranks on ``nodes`` by ``factor`` for ``duration_s`` (0: until a signal).
    Several nodes share one throttle, so their ranks stop and run in step (a whole-job slowdown)."""
    pids: dict[int, int] = {}
    busy: dict[int, float] = {}
    job = ""
    for node in nodes:
        job, on_node, on_busy = rank_pids(heartbeat_dir, node)
        pids.update(on_node)
        busy.update(on_busy)
    check_owned(list(pids.values()))
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    where = ",".join(nodes)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t = throttle(list(pids.values()), factor, method, busy=busy)
    try:
        t.start()
        how = t.method
        if isinstance(t, CgroupQuota):
            how += ", CPUs " + ", ".join(f"{q:.3f}" for q in t.quotas.values())
        say(f"drill: ranks {sorted(pids)} of Slurm job {job} on {where} run {factor}x slower ({how}); "
            f"{'for ' + format(duration_s, '.0f') + 's' if duration_s else 'until Ctrl-C or SIGTERM'}")
        done.wait(duration_s or None)
    finally:
        t.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        say(f"drill: {where} back to full speed")
    return t
