"""``omni demo`` as it ships (issue 22's bar): its default job in allocation mode keeps its checkpoints in
memory too; the node the drill takes down costs at most one step, every surviving rank restores from
its own node's memory and the replacement node's ranks from their ring peer's, as the ranks' own
records say (the demo's restore line, from their metrics lines' restore_source); the loss equals the
reference bitwise; nothing of the job is left in memory but the downed node's copies. About a minute."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_default_demo_restores_every_rank_from_memory_with_at_most_one_step_lost(slurm_cluster) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    argv = [sys.executable, "-m", "slurm_omni.cli.main", "demo", "--state-dir", str(slurm_cluster.state_dir),
            "--timeout", "300"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=580, check=False,
                          env={**os.environ, **slurm_cluster.env})
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-2000:]
    drill = next(line for line in out.splitlines() if "/11 drill:" in line)
    downed = re.search(r"drill: (\S+) DOWN", drill)
    assert downed is not None, drill
    line = next(line for line in out.splitlines() if "restored step " in line)
    m = re.search(r"restored step (\d+): (.*); (\d+) steps? lost \(life 0 reached step (\d+)\)", line)
    assert m is not None, line
    assert int(m.group(3)) <= 1 and int(m.group(4)) - int(m.group(1)) == int(m.group(3)), line
    # the vision ranks (0-1) survived on their node: their own memory; the text ranks (2-3) ran on the
    # node taken down: their replacement node fetched their shards from its ring peer's keeper
    assert m.group(2) == "ranks 0-1 from memory; ranks 2-3 from peer memory", line
    # the survivors' trainers were forked by their node's standby, which holds the node's copies: they
    # read them in their own memory (docs/checkpoint.md "Restore from inherited memory")
    assert line.endswith("; ranks 0-1 read the copies they inherited from their node's standby"), line
    compare = next(line for line in out.splitlines() if "/11 compare:" in line)
    assert "compare: equivalent: contract bitwise" in compare and "loss bitwise over 80 steps" in compare, compare
    freed = next(line for line in out.splitlines() if "cleanup: " in line and "/dev/shm/omni-demo-" in line)
    assert "NOT freed" not in freed, freed
    assert "nothing of the job left" in freed or f"on {downed.group(1)}, the node the drill took down" in freed, freed
