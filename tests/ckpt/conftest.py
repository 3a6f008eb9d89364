"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
NODE = "n1"
"""The node the keeper tests' ranks and keepers say they run on (SLURMD_NODENAME)."""


@pytest.fixture
def nodes() -> Iterator[Path]:
    """A tmpfs folder holding one memory tier per simulated node (``<this>/<node>``)."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = SHM / f"omni-memtest-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A job id of its own on node ``NODE``; the job's folder of the memory tier removed after."""
    from slurm_omni.checkpoint.memtier import job_dir

    monkeypatch.setenv("SLURMD_NODENAME", NODE)
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(job_dir(SHM, name), ignore_errors=True)
