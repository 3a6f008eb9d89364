"""Paths and helpers of the SPANK tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SPANK = REPO / "spank"
HARDENING = ["-O2", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong", "-Wall", "-Wextra", "-Werror"]


def run_harness(harness: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(harness), *args], capture_output=True, text=True, timeout=10, check=False)
