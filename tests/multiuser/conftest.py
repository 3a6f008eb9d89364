"""The way a site runs: Slurm and the SPANK plugin as root, ``omni submit``, the jobs and the manager
as the unprivileged users ``alice`` and ``bob`` (scripts/setup.sh creates them).

Every folder a user needs is theirs: ``/home/<user>/omni-tests/<id>`` (0700) for the site and job
files, logs, registry, metrics and the manager's state; the checkpoint root is shared and 1777 (as
/tmp, the layout docs/deployment.md allows), the data shards are readable by everyone."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from multiuser_support import User, lookup

USERS = ("alice", "bob")


@pytest.fixture(scope="session")
def users() -> dict[str, User]:
    if os.geteuid() != 0:
        pytest.skip("multiuser tests switch users: run them as root")
    try:
        found = {name: lookup(name) for name in USERS}
    except KeyError:
        pytest.skip("users alice and bob are missing: run scripts/setup.sh as root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    return found


@pytest.fixture
def alice(users: dict[str, User]) -> User:
    return users["alice"]


@pytest.fixture
def bob(users: dict[str, User]) -> User:
    return users["bob"]


@pytest.fixture
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A site area every user reaches: ``ckpt/`` (1777) and read-only data."""
    base = Path("/tmp") / f"omni-multiuser-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    (base / "ckpt").mkdir()
    (base / "ckpt").chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def alice_dir(alice: User) -> Iterator[Path]:
    """alice's own folder for one test (0700)."""
    path = alice.home / "omni-tests" / uuid.uuid4().hex[:8]
    path.mkdir(parents=True)
    alice.own(alice.home / "omni-tests")
    path.chmod(0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
