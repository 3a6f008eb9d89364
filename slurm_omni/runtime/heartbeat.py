"""Per-rank heartbeat file, rewritten atomically from a side thread.

``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json`` holds one JSON object::

    {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42",
     "step": 17, "phase": "training", "time": 1764460000.12, "step_time_s": 0.031,
     "last_checkpoint_step": 10, "beats": 9, "compute_s": 0.021, "data_s": 0.004, "node": "node3"}

``time`` is wall-clock (epoch seconds) of the write; ``step`` is the last completed global step;
``step_time_s`` the mean of the last few steps;
``compute_s`` this rank's own forward, backward and optimizer time of the last step, without its
waits for peers (pipeline receives, collectives), and ``data_s`` its data-loading time of that step
(both null before the first step): the fail-slow detector compares them between nodes of a stage;
``node`` is the node the rank runs on (``SLURMD_NODENAME``; absent outside Slurm); ``last_checkpoint_step`` the newest step whose shard
this rank has made durable (or restored from); ``phase`` one of starting, training, checkpointing,
stopping, done, failed. The file is written to a temporary name and renamed, so a reader never sees a
partial file. The thread keeps beating while the main thread is inside a long collective, which is
what lets level-2 confirmation tell a slow step (beats, no progress) from a dead process (no beats).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from typing import Any

from slurm_omni.checkpoint.format import write_atomic
from slurm_omni.runtime.layout import Layout

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, layout: Layout, *, window: int = 5) -> None:
        self.path = layout.heartbeat_dir / f"rank-{layout.rank}.json"
        self.interval_s = layout.heartbeat_interval_s
        self._lock = threading.Lock()
        self._step_times: collections.deque[float] = collections.deque(maxlen=window)
        self._state: dict[str, Any] = {
            "rank": layout.rank, "stage": layout.stage, "dp_rank": layout.data_parallel_rank,
            "pid": os.getpid(), "incarnation": layout.incarnation, "job_id": layout.job_id,
            "step": -1, "phase": "starting", "step_time_s": None, "last_checkpoint_step": None, "beats": 0,
            "compute_s": None, "data_s": None,
        }
        if layout.node:
            self._state["node"] = layout.node
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-heartbeat", daemon=True)
        layout.heartbeat_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._write()
        self._thread.start()

    def update(self, *, step: int | None = None, step_time_s: float | None = None,
               phase: str | None = None, last_checkpoint_step: int | None = None,
               compute_s: float | None = None, data_s: float | None = None) -> None:
        with self._lock:
            if compute_s is not None:
                self._state["compute_s"] = round(compute_s, 6)
            if data_s is not None:
                self._state["data_s"] = round(data_s, 6)
            if step is not None:
                self._state["step"] = step
            if step_time_s is not None:
                self._step_times.append(step_time_s)
                self._state["step_time_s"] = sum(self._step_times) / len(self._step_times)
            if phase is not None:
                self._state["phase"] = phase
            if last_checkpoint_step is not None:
                self._state["last_checkpoint_step"] = last_checkpoint_step

    def stop(self, phase: str) -> None:
        """Final beat with ``phase`` (done, stopping, failed); the thread ends."""
        self.update(phase=phase)
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
            text = json.dumps(self._state, sort_keys=True)
        try:
            write_atomic(self.path, (text + "\n").encode(), durable=False)
        except OSError as e:
            # A full or flaky shared disk must not kill training; the manager sees stale beats.
            log.warning("heartbeat: couldn't write %s: %s", self.path, e)
