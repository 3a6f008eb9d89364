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


LANE_PORTS = {"24.11": (17017, 17100), "26.05": (17217, 17300)}
"""Default ports of the version lanes' clusters (22.05 keeps ClusterSpec's 16817/16900)."""
LANE_FIRST_JOB_ID = {"24.11": 5001, "26.05": 10001}
"""And their first job ids (22.05 starts at 1): a job's first MASTER_PORT guesses follow from its
id (a taken one is skipped), so a lane's cluster beside the default one hands out other ids."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the real cluster is a cluster test, whether or not it says so: without
    this, ``-m "not cluster"`` (the unit run) brought the cluster up on the default ports for
    tests/slurm/test_runner.py's one test that takes ``slurm_cluster``, and left it running."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and item.get_closest_marker("cluster") is None:
            item.add_marker(pytest.mark.cluster)


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
    from slurm_omni.cluster.spec import ClusterSpec
    from slurm_omni.cluster.versions import HOST_VERSION

    # The version lane (OMNI_SLURM_VERSION=24.11|26.05, README): that version's cluster, in its own
    # state directory, on its own ports unless the directory records others.
    version = os.environ.get("OMNI_SLURM_VERSION") or HOST_VERSION
    default_dir = REPO / ".omni" / ("cluster" if version == HOST_VERSION else f"cluster-{version}")
    state_dir = Path(os.environ.get("OMNI_CLUSTER_DIR", default_dir))
    lc = LocalCluster(state_dir)
    recorded = lc.recorded_spec()
    if recorded is not None and recorded.slurm_version != version:
        pytest.exit(f"{state_dir} holds a Slurm {recorded.slurm_version} cluster, not {version} "
                    "(OMNI_SLURM_VERSION / OMNI_CLUSTER_DIR)", returncode=2)
    if recorded is None and version != HOST_VERSION:
        ctld, slurmd = LANE_PORTS[version]
        lc = LocalCluster(state_dir, ClusterSpec(slurm_version=version, ctld_port=ctld, slurmd_base_port=slurmd,
                                                 first_job_id=LANE_FIRST_JOB_ID[version]))
    lc.up(wait_s=120)
    os.environ.update(lc.env)
    yield ClusterHandle(lc, lc.env, lc.paths.root, lc.paths.spool, lc.spec.node_names)
