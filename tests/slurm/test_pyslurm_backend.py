from __future__ import annotations

import pytest

from slurm_omni.slurm import pyslurm_backend
from slurm_omni.slurm.backend import get_backend

needs_pyslurm = pytest.mark.skipif(
    not pyslurm_backend.available(),
    reason="pyslurm does not import here: PyPI has only pyslurm 25.11, built for Slurm 25.11, and this "
           f"machine runs Debian 12's Slurm 22.05 ({pyslurm_backend.unavailable_reason()})")


def test_cli_backend_chosen_without_pyslurm() -> None:
    if pyslurm_backend.available():
        pytest.skip("pyslurm imports here")
    assert get_backend().name == "cli"


@needs_pyslurm
def test_pyslurm_backend_reads_the_same_cluster(slurm_cluster) -> None:
    ours = get_backend("pyslurm", env=slurm_cluster.env)
    cli = get_backend("cli", env=slurm_cluster.env)
    assert ours.name == "pyslurm"
    assert {n.name: (n.state, n.gres, n.switch_path) for n in ours.nodes()} == \
        {n.name: (n.state, n.gres, n.switch_path) for n in cli.nodes()}
