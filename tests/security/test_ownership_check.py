"""The one ownership check (slurm_omni/ownership.py) on the real file system, with bob as the other
user: what each finding's fix stands on. A folder is used through the descriptor that was checked,
so a path swapped after the check leads nowhere."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from multiuser_support import User

from slurm_omni.fsio import write_atomic
from slurm_omni.ownership import (
    NotOwnedError,
    check_own_dir,
    ensure_dir,
    ensure_own_dir,
    open_own_dir,
    user_folder,
)

pytestmark = pytest.mark.multiuser


def test_a_folder_of_bobs_a_link_or_an_open_parent_is_refused_in_one_line(bob: User, tmp_path: Path) -> None:
    bobs = tmp_path / "bobs"
    bobs.mkdir(mode=0o777)
    bob.own(bobs)
    with pytest.raises(NotOwnedError, match=rf"^metrics: couldn't use {bobs}: a directory of uid {bob.uid} "):
        check_own_dir(bobs, "metrics")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(NotOwnedError, match=r"a link of uid \d+ .*someone else made it first"):
        open_own_dir(tmp_path / "link", "standby", private=True)
    with pytest.raises(NotOwnedError, match=rf"couldn't use {bobs}: a directory of uid {bob.uid} .*a folder of root"):
        ensure_own_dir(bobs / "job", what="metrics")              # bob could swap anything made in his folder
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert ensure_own_dir(sticky / "alice" / "job", what="checkpoint") == sticky / "alice" / "job"
    assert stat.S_IMODE((sticky / "alice").stat().st_mode) == 0o700


def test_a_private_folder_of_ours_is_tightened_and_one_others_may_write_is_not(tmp_path: Path) -> None:
    old = tmp_path / "registry"
    old.mkdir(mode=0o755)                                           # what an older release made
    ensure_dir(old, what="registry", private=True).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o700
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    with pytest.raises(NotOwnedError, match=r"with mode 0777 .*chmod 700 it"):
        ensure_dir(open_, what="registry", private=True)


def test_files_go_where_the_check_was_made_whatever_the_path_leads_to_now(bob: User, tmp_path: Path) -> None:
    ours = tmp_path / "metrics"
    with ensure_dir(ours, what="metrics", mode=0o755) as folder:
        os.rename(ours, tmp_path / "moved")                         # swapped after the check
        (tmp_path / "metrics").mkdir(mode=0o777)
        bob.own(tmp_path / "metrics")
        write_atomic(ours / "omni-x.prom", b"1\n", dir_fd=folder.fd)
        fd = folder.open_append("metrics-x.jsonl")
        os.write(fd, b"{}\n")
        os.close(fd)
    assert sorted(os.listdir(tmp_path / "moved")) == ["metrics-x.jsonl", "omni-x.prom"]
    assert os.listdir(tmp_path / "metrics") == []


@pytest.mark.parametrize("planted", ["symlink", "hard link", "bob's file", "fifo"])
def test_a_file_to_append_to_must_be_a_plain_file_of_ours(bob: User, tmp_path: Path, planted: str) -> None:
    target = tmp_path / "job.toml"
    target.write_text("[job]\n")
    with ensure_dir(tmp_path / "m", what="metrics", mode=0o755) as folder:
        name = folder.path / "metrics-x.jsonl"
        if planted == "symlink":
            name.symlink_to(target)
        elif planted == "hard link":
            os.link(target, name)
        elif planted == "fifo":
            os.mkfifo(name)
        else:
            name.write_text("")
            bob.own(name)
        with pytest.raises(NotOwnedError, match=f"couldn't (open|use) {name}"):
            folder.open_append(name.name)
    assert target.read_text() == "[job]\n"


def test_user_folder_splits_the_sites_part_from_the_users() -> None:
    assert user_folder(Path("/var/lib/omni/registry/{user}"), "alice") == (
        Path("/var/lib/omni/registry"), Path("/var/lib/omni/registry/alice"))
    assert user_folder(Path("/srv/{user}/metrics"), "bob") == (Path("/srv"), Path("/srv/bob/metrics"))
    assert user_folder(Path("/srv/metrics"), "bob") == (Path("/srv"), Path("/srv/metrics"))
