"""The security suite: one user (``bob``) against another's (``alice``) job, manager and folders, as a
shared centre runs them (docs/deployment.md, the threat model). The users and their folders are the
multiuser suite's fixtures (tests/multiuser/conftest.py: ``users``, ``alice``, ``bob``, ``shared``,
``alice_dir``), shared here rather than copied; small helpers are in ``security_support.py``; each
test file keeps its own scenario."""

from __future__ import annotations

import sys
from pathlib import Path

# the multiuser suite's modules import each other by bare name (pytest puts their folder on the path
# only when it collects that folder)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiuser"))

from multiuser.conftest import alice, alice_dir, bob, shared, users  # noqa: F401 (fixtures)
