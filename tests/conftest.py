"""Shared fixtures. ``slurm_cluster`` brings the embedded Slurm cluster up once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@dataclass(frozen=True)
class ClusterHandle:
    cluster: object          # slurm_omni.cluster.local.LocalCluster
    env: dict[str, str]      # SLURM_CONF for clients
    state_dir: Path
    spool: Path
    nodes: list[str]

    def backend(self):  # -> CliBackend
        from slurm_omni.slurm.cli_backend import CliBackend
        return CliBackend(env=self.env, timeout_s=20, retries=3)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[ClusterHandle]:
    """The real local cluster (8 nodes, two leaf switches, gpu:h100:4). Left running for the next
    session; `.ci/run` stops it with `omni cluster down`. Tests that change node states restore them."""
    if shutil.which("slurmctld") is None and not Path("/usr/sbin/slurmctld").exists():
        pytest.skip("Slurm packages missing: run scripts/setup.sh")
    from slurm_omni.cluster.local import LocalCluster

    state_dir = Path(os.environ.get("OMNI_CLUSTER_DIR", REPO / ".omni" / "cluster"))
    lc = LocalCluster(state_dir)
    lc.up(wait_s=120)
    os.environ.update(lc.env)
    yield ClusterHandle(lc, lc.env, lc.paths.root, lc.paths.spool, lc.spec.node_names)
