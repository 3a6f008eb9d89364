"""The slow-node drill's throttles on a real child process: they slow it, they are undone (the
process runs again, it is back in its own cgroup, the drill's cgroup is gone), and they refuse
processes of another user."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_omni.drill.inject import DrillError, DrillRefused
from slurm_omni.drill.throttle import (
    CgroupQuota,
    SignalThrottle,
    cgroup_of,
    cgroup_root,
    check_owned,
    cpu_seconds_of,
    throttle,
)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait()


def test_signal_throttle_stops_a_busy_process_part_of_the_time_and_always_continues_it(busy) -> None:
    t = SignalThrottle([busy.pid], 2.0)
    t.start()
    seen = set()
    deadline = time.monotonic() + 20   # the stops are owed from its CPU: on a loaded machine it gets little
    while not ("T" in seen and seen & {"R", "S"}) and time.monotonic() < deadline:
        seen.add(_state(busy.pid))
        time.sleep(0.013)
    t.stop()
    assert "T" in seen and seen & {"R", "S"}, seen
    time.sleep(0.05)
    assert _state(busy.pid) in ("R", "S")
    used = cpu_seconds_of(busy.pid)
    assert used is not None and used > 0          # what the stops are owed from: all its threads' CPU
    busy.kill()
    busy.wait()
    assert cpu_seconds_of(busy.pid) is None


@pytest.mark.skipif(cgroup_root() is None, reason="no writable cgroup with a cpu controller here")
def test_cgroup_quota_moves_the_process_and_puts_it_back(busy) -> None:
    root = cgroup_root()
    assert root is not None
    origin = cgroup_of(busy.pid, root[1])
    t = throttle([busy.pid], 2.0, "cgroup", busy={busy.pid: 1.0})
    assert isinstance(t, CgroupQuota)
    t.calibrate_s = 0.3
    t.start()
    inside = cgroup_of(busy.pid, root[1])
    made = [p for p in root[0].iterdir() if p.name.startswith("omni-drill-")]
    t.stop()
    assert inside != origin and inside.lstrip("/").startswith("omni-drill-")
    assert 0 < t.quotas[busy.pid] <= 0.5 + 1e-9   # a busy loop uses one CPU: half of it at factor 2
    assert cgroup_of(busy.pid, root[1]) == origin
    assert all(not p.exists() for p in made)


def test_foreign_processes_and_bad_factors_are_refused(busy) -> None:
    with pytest.raises(DrillRefused, match="belongs to uid"):
        check_owned([busy.pid], uid=12345)
    with pytest.raises(DrillError, match="factor 1.0 is not allowed"):
        throttle([busy.pid], 1.0)
    with pytest.raises(DrillError, match="method 'fast' is not allowed"):
        throttle([busy.pid], 2.0, "fast")  # type: ignore[arg-type]
