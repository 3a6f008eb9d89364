"""On the embedded cluster: the busy cluster's fillers hold every idle node, and the queued ones take
a node that another job frees before a job submitted after them can (a resubmission waits in the
queue, it does not start on the nodes its cancelled predecessor left)."""

from __future__ import annotations

import pytest
from support import wait_until

from slurm_omni.cluster.busy import BusyCluster
from slurm_omni.slurm.hostlist import expand

pytestmark = pytest.mark.cluster


def _squeue(backend, job: int) -> tuple[str, str]:
    out = backend.runner.run(["squeue", "-h", f"--jobs={job}", "-o", "%T %N"], check=False).stdout.split()
    return (out[0], out[1] if len(out) > 1 else "") if out else ("", "")


def _sbatch(backend, *args: str) -> int:
    out = backend.runner.run(["sbatch", "--parsable", "--output=/dev/null", "--time=2", *args]).stdout
    return int(out.strip().split(";")[0])


def test_queued_fillers_take_a_freed_node_before_a_later_job(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    holder = _sbatch(backend, "--job-name=busy-holder", "--nodes=2", "--exclusive", "--wrap=sleep 120")
    filler = BusyCluster(backend, seconds=60, tag="test-busy-queued", queued=2)
    late = 0
    try:
        held = wait_until(lambda: _squeue(backend, holder)[1] if _squeue(backend, holder)[0] == "RUNNING" else None,
                          60, "the holder job running")
        filled = filler.fill()
        assert filled and not set(filled) & set(expand(held))
        queued = filler.jobs[-2:]
        assert all(_squeue(backend, j)[0] == "PENDING" for j in queued)
        late = _sbatch(backend, "--job-name=busy-late", "--nodes=1", "--wrap=sleep 30")
        backend.runner.run(["scancel", str(holder)])
        wait_until(lambda: all(_squeue(backend, j)[0] == "RUNNING" for j in queued) or None, 60,
                   "both queued fillers running on the freed nodes")
        assert _squeue(backend, late)[0] == "PENDING"
    finally:
        filler.clear()
        backend.runner.run(["scancel", str(holder), *([str(late)] if late else [])], check=False)
