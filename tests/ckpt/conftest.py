"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


@pytest.fixture
def nodes() -> Iterator[Path]:
    """A tmpfs folder holding one memory tier per simulated node (``<this>/<node>``)."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    path = SHM / f"omni-memtest-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)
