"""The session's cluster is the version it claims (22.05 by default; the version lane's otherwise):
its clients, its nodes with their gres, and a SPANK plugin that version's srun accepts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slurm_omni.slurm.types import Gres

pytestmark = pytest.mark.cluster


def test_clients_nodes_and_plugin_of_that_version(slurm_cluster) -> None:
    lc = slurm_cluster.cluster
    version = lc.spec.slurm_version
    env = {**os.environ, **lc.env}
    out = subprocess.run(["sinfo", "--version"], env=env, capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.split()[1].startswith(version + ".")
    nodes = slurm_cluster.backend().nodes()
    assert sorted(n.name for n in nodes) == sorted(slurm_cluster.nodes)
    assert all(n.gres == (Gres("gpu", "h100", 4),) for n in nodes)
    status = subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", "cluster", "status", "--json",
                             "--state-dir", str(lc.paths.root)], env=env, capture_output=True, text=True,
                            check=True, timeout=60)
    doc = json.loads(status.stdout)
    assert doc["slurm_version"] == version and doc["slurm_release"] == out.stdout.split()[1]
    # SPANK_PLUGIN() stamps the headers' version and srun drops a plugin of another version: our
    # options in its help show the plugin built for this version was loaded.
    assert str(lc.plugin) in (lc.paths.etc / "plugstack.conf").read_text()
    if lc.spec.in_root:
        assert lc.plugin == lc.paths.plugin
    srun = subprocess.run(["srun", "--help"], env=env, capture_output=True, text=True, check=False, timeout=30)
    assert "--omni-stage" in srun.stdout, srun.stderr[-400:]
