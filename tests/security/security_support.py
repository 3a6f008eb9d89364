"""Helpers of the security suite (tests/security): ``omni`` run as one of the two users."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from multiuser_support import User

BIN = Path(sys.executable).parent
"""``omni`` and the Python every user runs (the tests' own)."""


def omni(user: User, *argv: str, env: dict[str, str] | None = None, timeout: float = 120,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``omni ARGV...`` as ``user`` with the tests' environment (plus ``env``)."""
    return user.run(str(BIN / "omni"), *argv, env={**os.environ, **(env or {})}, timeout=timeout, cwd=cwd)


def open_to_all(path: Path) -> Path:
    """``path`` and what is below it readable by every user (data shards a site shares)."""
    for root, dirs, files in os.walk(path):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    os.chmod(path, 0o755)
    return path
