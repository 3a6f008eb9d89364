"""Per-rank heartbeat file, rewritten atomically from a side thread; the requeue manager reads it.

``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json`` holds one JSON object::

    {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42",
     "step": 17, "phase": "training", "time": 1764460000.12, "step_time_s": 0.031,
     "compute_s": 0.021, "data_s": 0.002, "node": "node3", "last_checkpoint_step": 10, "beats": 9,
     "metrics": {"loss": 2.31, "samples": 8}}

``time`` is wall-clock (epoch seconds) of the write; ``step`` the last completed global step;
``step_time_s`` the mean of the last few steps' wall time; ``compute_s`` this rank's own compute per
step (its modules' forward and backward and the optimizer step, without the time spent waiting for a
peer in a receive or an all-reduce) and ``data_s`` its data loading per step, both means over the
same last steps as ``step_time_s`` (null until a step reports them; the fail-slow detector compares ``compute_s`` across the ranks of a stage);
``cpu_wait_s`` (same window) the part of ``compute_s + data_s`` the rank's thread was runnable but
waited for a CPU (run-queue delay: another process held the cores; elastic/timing.py);
``node`` the node the rank runs on (``SLURMD_NODENAME``; absent outside Slurm);
``last_checkpoint_step`` the newest step whose shard this rank made durable (or restored from);
``phase`` one of :data:`PHASES`; ``metrics`` (optional) at most :data:`MAX_METRICS` numbers the script
passed with its last step; ``error`` (optional, phase ``failed``) one line saying what went wrong;
``exit_code`` (optional, the last beat) the code the rank exits with (78: bad input, do not restart). The
file is written to a temporary name and renamed, so a reader never sees a partial file. The thread
keeps beating while the main thread is inside a long collective, which is what lets the manager tell
a slow step (beats, no progress) from a dead process (no beats).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import MAX_ERROR_CHARS, MAX_METRICS, PHASES, HeartbeatRecord
from slurm_omni.fsio import write_atomic
from slurm_omni.ownership import ensure_own_dir

log = logging.getLogger(__name__)

__all__ = ["MAX_ERROR_CHARS", "MAX_METRICS", "PHASES", "Heartbeat", "clean_metrics"]


class Heartbeat:
    """One rank's heartbeat file. ``update`` from the training loop; a thread rewrites the file."""

    def __init__(self, heartbeat_dir: Path, *, rank: int, stage: int, dp_rank: int, incarnation: int,
                 job_id: str, interval_s: float = 2.0, window: int = 5, node: str | None = None) -> None:
        self.path = heartbeat_dir / f"rank-{rank}.json"
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._step_times: collections.deque[float] = collections.deque(maxlen=window)
        self._own_times: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=window) for k in ("compute_s", "data_s", "cpu_wait_s")}
        self._state: dict[str, Any] = {
            "rank": rank, "stage": max(0, stage), "dp_rank": dp_rank, "pid": os.getpid(),
            "incarnation": incarnation, "job_id": job_id, "step": -1, "phase": "starting",
            "step_time_s": None, "compute_s": None, "data_s": None, "cpu_wait_s": None, "last_checkpoint_step": None,
            "beats": 0,
        }
        node = os.environ.get("SLURMD_NODENAME", "") if node is None else node
        if node:
            self._state["node"] = node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-heartbeat", daemon=True)
        # the manager trusts only its own user's beats, in a folder only they can use
        ensure_own_dir(heartbeat_dir, what="heartbeat", private=True)

    def start(self) -> None:
        self._write()
        self._thread.start()

    @property
    def phase(self) -> str:
        return str(self._state["phase"])

    def update(self, *, step: int | None = None, step_time_s: float | None = None,
               compute_s: float | None = None, data_s: float | None = None, cpu_wait_s: float | None = None,
               phase: str | None = None,
               last_checkpoint_step: int | None = None, metrics: dict[str, float | int] | None = None,
               error: str | None = None) -> None:
        if phase is not None and phase not in PHASES:
            raise ValueError(f"heartbeat: phase {phase!r} is not one of {', '.join(PHASES)}")
        with self._lock:
            s = self._state
            if step is not None:
                s["step"] = step
            if step_time_s is not None:
                self._step_times.append(step_time_s)
                s["step_time_s"] = sum(self._step_times) / len(self._step_times)
            for key, value in (("compute_s", compute_s), ("data_s", data_s), ("cpu_wait_s", cpu_wait_s)):
                if value is not None:
                    # the mean over the same last steps as step_time_s: with a beat per interval,
                    # the last step alone is one sample in several and too noisy to compare nodes
                    times = self._own_times[key]
                    times.append(max(0.0, float(value)))
                    s[key] = round(sum(times) / len(times), 6)
            if phase is not None:
                s["phase"] = phase
            if last_checkpoint_step is not None:
                s["last_checkpoint_step"] = last_checkpoint_step
            if metrics is not None:
                s["metrics"] = clean_metrics(metrics)
            if error is not None:
                s["error"] = " ".join(error.split())[:MAX_ERROR_CHARS]

    def stop(self, phase: str, *, error: str | None = None, exit_code: int | None = None) -> None:
        """Final beat with ``phase`` (done, stopping, failed) and the exit code the rank is about to
        exit with; the thread ends."""
        self.update(phase=phase, error=error)
        if exit_code is not None:
            with self._lock:
                self._state["exit_code"] = exit_code
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 1)
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def _write(self) -> None:
        with self._lock:
            self._state["beats"] += 1
            self._state["time"] = time.time()
            data = encode(HeartbeatRecord(**self._state))   # the schema the manager reads it with
        try:
            write_atomic(self.path, data, durable=False)
        except OSError as e:
            # A full or flaky shared disk must not kill training; the manager sees stale beats.
            log.warning("heartbeat: couldn't write %s: %s", self.path, e)


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The script's metrics as the heartbeat carries them: finite numbers, short names, a few."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if len(out) == MAX_METRICS:
            break
        if isinstance(value, bool) or not isinstance(key, str) or not 0 < len(key) <= 32:
            continue
        if hasattr(value, "item"):   # a one-element tensor or numpy number
            value = value.item()
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
            out[key] = value
    return out
