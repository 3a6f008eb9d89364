"""Nothing of a job stays in /dev/shm when a node's slurmd dies under it (issues 19 and 22): a 3-node
``--no-kill`` job with a rank per node that beats per node (the runtime's Heartbeat), the slurmd of
one node SIGKILLed (Slurm takes the node out of the job; its rank runs on, orphaned), the job
cancelled (the other nodes' epilog removes every node's folder of the job: the embedded cluster's
nodes share one /dev/shm), then slurmd back (it kills the orphan). The orphan must not make its folder
again: it did, and omni-beats-<uid>-<job>-<node> stayed with rank-N.json, leader, lock, published."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.drill.inject import Injector
from slurm_omni.slurm.types import NodeState

pytestmark = pytest.mark.cluster

RANK = """\
import os, sys, time
from pathlib import Path
from slurm_omni.elastic.heartbeat import Heartbeat
rank = int(os.environ["SLURM_PROCID"])
hb = Heartbeat(Path(sys.argv[1]), rank=rank, stage=0, dp_rank=rank, incarnation=0,
               job_id=os.environ["SLURM_JOB_ID"], interval_s=0.2)
hb.update(step=1, phase="training")
hb.start()
Path(sys.argv[1], f"ready-{rank}").write_text("")
while True:
    time.sleep(0.1)
"""


def test_a_rank_orphaned_by_its_slurmd_leaves_no_node_folder(slurm_cluster, tmp_path: Path) -> None:
    backend = slurm_cluster.backend()
    nodes = wait_until(lambda: (idle := sorted((n.name for n in backend.nodes() if n.state is NodeState.IDLE
                                                and not n.flags), key=lambda n: -int(n.removeprefix("node"))))
                       and len(idle) >= 3 and idle[:3], 120, "3 idle nodes", interval_s=1.0)
    lost = nodes[1]
    hb = tmp_path / "hb"
    hb.mkdir(mode=0o700)
    (tmp_path / "rank.py").write_text(RANK)
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=3 --nodelist={','.join(nodes)} --ntasks-per-node=1 --time=5 --no-kill
        #SBATCH --output={tmp_path}/job.out
        srun --no-kill {sys.executable} {tmp_path}/rank.py {hb}
        """))
    job = backend.submit(str(script))
    folders = [Path("/dev/shm") / f"omni-beats-{os.geteuid()}-{job}-{n}" for n in nodes]
    injector = Injector(allowed=(lost,), site="test site", backend=backend, cluster=slurm_cluster.cluster)
    try:
        wait_until(lambda: len(list(hb.glob("ready-*"))) == 3 and all(f.is_dir() for f in folders), 60,
                   "every rank beating on its node")
        injector.slurmd_crash(lost)
        wait_until(lambda: next(n for n in backend.nodes() if n.name == lost).state is NodeState.DOWN, 60,
                   f"{lost} DOWN (not responding)")
        backend.cancel(str(job))
        wait_until(lambda: not any(f.exists() for f in folders), 30, "the job's node folders removed")
    finally:
        injector.restart_slurmd(lost)   # kills the orphan
    wait_until(lambda: not _running(tmp_path / "rank.py"), 60, "the orphaned rank killed")
    assert [f.name for f in folders if f.exists()] == []


def _running(script: Path) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(script).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False
