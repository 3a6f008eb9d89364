"""``omni demo --busy`` whole (allocation mode on a busy cluster): a vision node, a text node and the
allocation's first node lost in turn, each recovered inside the same Slurm job with a spare, then a
shrink once the spares are gone, a pool allocation of the missing node that waits behind the
fillers and the grow-back onto it (dp 1 -> 2, same Slurm job), the loss bitwise equal to the reference
before the shrink. About 6 minutes at load 10-20, so it runs only in its lane: ``OMNI_BUSY_DEMO=1`` (README.md, "Test
lanes"); the default suite keeps the demo's short tests (test_demo_phases.py, test_shapes_demo.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(os.environ.get("OMNI_BUSY_DEMO") != "1",
                                 reason="OMNI_BUSY_DEMO=1 runs omni demo --busy (a few minutes)")]


def test_busy_demo_recovers_every_node_in_the_allocation_the_first_included(slurm_cluster) -> None:
    argv = [sys.executable, "-m", "slurm_omni.cli.main", "demo", "--busy", "--state-dir",
            str(slurm_cluster.state_dir), "--timeout", "300"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1400, check=False,
                          env={**os.environ, **slurm_cluster.env})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    job = re.search(r"omni submit: job (\d+), one salloc --no-shell --no-kill allocation", out)
    assert job, out
    relaunches = [line for line in out.splitlines() if "relaunch in the allocation:" in line]
    assert len(relaunches) == 4, out
    for line in relaunches:        # never a trip through the queue: the same Slurm job, still running
        assert f"Slurm job {job[1]} before and {job[1]} after" in line, line
    assert "(the allocation's first node)" in out and "first node lost:" in out, out
    assert all("dp 2 -> 2" in line for line in relaunches[:3]) and "dp 2 -> 1" in relaunches[3], relaunches
    assert "0 spare(s) left" in relaunches[2], relaunches
    assert re.search(r"fault to first step: [\d.]+ s, [\d.]+ s, [\d.]+ s, [\d.]+ s; median", out), out
    assert re.search(r"pool asked: pool allocation \d+ for the missing node: PENDING", out), out
    grow = [line for line in out.splitlines() if "grow-back: pool" in line]
    assert len(grow) == 1 and "dp 1 -> 2 across the allocation and the pool" in grow[0], out
    assert "loss bitwise equal to the reference over" in out and "before the shrink at step" in out, out
