"""What the fail-slow cluster tests share: the heartbeat recorder (the highest step each life of a
Slurm job reached: the next life rewrites the same files) and the slow-node drill as a context."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from manager_cluster_support import BIN

from slurm_omni.manager.events import read_heartbeats

# Shorter windows than the shipped ones (docs/failslow.md) so that a cluster test fits in minutes:
# beats every 0.5 s give 20 samples per node in a 10 s window; so short a window lets a healthy
# node's data loading wander to 1.3x its peer's (seen once), hence a margin of 0.5. The restart is a
# notional 1 s, and a migration must still pay for it.
FAILSLOW_TABLES = ("[failslow]\nmargin = 0.5\nclear_margin = 0.3\nwindow_s = 10\nsustain_s = 5\nclear_s = 10\n"
                   "restart_cost_s = 1\nmin_gain = 1.0\n[drills]\nallowed_nodes = \"node[1-8]\"\n"
                   "[detection]\nheartbeat_interval_s = 0.5\n")


class BeatRecorder:
    """Reads the heartbeats every 0.2 s while it runs: (Slurm job id, incarnation) -> highest step."""

    def __init__(self, heartbeat_dir: Path) -> None:
        self.heartbeat_dir = heartbeat_dir
        self.reached: dict[tuple[str, int], int] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            for b in read_heartbeats(self.heartbeat_dir):   # per rank or per node (formats/heartbeat.py)
                key = (b.job_id, b.incarnation)
                self.reached[key] = max(self.reached.get(key, -1), b.step)

    def highest(self, job_id: str | int, incarnation: int | None = None) -> int:
        steps = [s for (j, i), s in self.reached.items() if j == str(job_id) and incarnation in (None, i)]
        return max(steps)


@contextmanager
def slow_node(run: Any, job: str, node: str, factor: float) -> Iterator[list[str]]:
    """``omni drill slow-node`` on ``node`` while the block runs, undone (SIGTERM) at its end; the
    list holds the drill's output afterwards, and the drill must have exited 0."""
    out: list[str] = []
    drill = subprocess.Popen([str(BIN / "omni"), "drill", "slow-node", "--job", job, "--node", node,
                              "--factor", str(factor), "--site", str(run.site)], env=run.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield out
    finally:
        drill.send_signal(signal.SIGTERM)
        out.append(drill.communicate(timeout=30)[0].decode())
    assert drill.returncode == 0, out[0]
