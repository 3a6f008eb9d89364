"""Builds the plugin (``make -C spank``) and the harness of its pure parts once per session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from spank_support import HARDENING, SPANK


@pytest.fixture(scope="session")
def plugin() -> Path:
    subprocess.run(["make", "-s", "-C", str(SPANK)], check=True, capture_output=True, text=True, timeout=120)
    return SPANK / "omni_spank.so"


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("spank") / "harness"
    sources = [Path(__file__).with_name("harness.c"), SPANK / "args.c", SPANK / "fault.c", SPANK / "shm.c"]
    subprocess.run(["cc", *HARDENING, "-std=gnu11", f"-I{SPANK}", "-o", str(out), *map(str, sources)],
                   check=True, capture_output=True, text=True, timeout=120)
    return out
