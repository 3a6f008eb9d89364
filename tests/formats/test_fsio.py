"""fsio: atomic writes (mode, no symlink followed, nothing left behind) and bounded reads."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from slurm_omni.fsio import PARTIAL, FileRejected, read_bounded, read_text, write_atomic


def test_write_atomic_replaces_with_the_given_mode_and_leaves_no_partial(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    target.write_text("old")
    write_atomic(target, "new")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    old = os.umask(0o077)
    try:
        write_atomic(target, b"public", mode=0o644, durable=False)   # exactly the mode, not through the umask
    finally:
        os.umask(old)
    assert target.read_bytes() == b"public" and stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_write_atomic_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    write_atomic(tmp_path / "link", "mine")
    assert victim.read_text() == "keep" and not (tmp_path / "link").is_symlink()


def test_write_atomic_cleans_up_when_the_rename_fails(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("occupied")
    with pytest.raises(OSError):
        write_atomic(tmp_path / "dir", "text")   # a non-empty folder cannot be replaced by a file
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(PARTIAL)]


def test_write_atomic_at_a_folder_descriptor_follows_the_folder_through_a_rename(tmp_path: Path) -> None:
    mine = tmp_path / "step-30.tmp"
    mine.mkdir()
    fd = os.open(mine, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename(mine, tmp_path / "step-30")
        os.rename(tmp_path / "step-30", tmp_path / "step-30.old")   # another writer took the name since
        (tmp_path / "step-30").mkdir()
        write_atomic(tmp_path / "step-30" / "COMPLETE", "mine", dir_fd=fd)
    finally:
        os.close(fd)
    assert sorted(p.name for p in (tmp_path / "step-30.old").iterdir()) == ["COMPLETE"]
    assert list((tmp_path / "step-30").iterdir()) == []
    with pytest.raises(FileNotFoundError):   # a folder gone: an error, nothing written elsewhere
        fd = os.open(tmp_path / "step-30", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.rmdir(tmp_path / "step-30")
            write_atomic(tmp_path / "x" / "COMPLETE", "mine", dir_fd=fd)
        finally:
            os.close(fd)


def test_read_bounded_refuses_big_links_fifos_and_folders(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 11)
    assert read_bounded(big, 11) == b"x" * 11
    with pytest.raises(FileRejected, match=r"11 bytes \(limit 10\)"):
        read_bounded(big, 10)
    (tmp_path / "link").symlink_to(big)
    with pytest.raises(FileRejected, match="symlink"):
        read_bounded(tmp_path / "link", 100)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileRejected, match="not a regular file"):
        read_bounded(tmp_path / "fifo", 100)
    with pytest.raises(FileRejected, match="not a regular file"):
        read_bounded(tmp_path, 100)
    with pytest.raises(FileRejected, match="couldn't read missing: no such file"):
        read_bounded(tmp_path / "missing", 100)


def test_read_text_names_the_first_byte_that_is_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "latin1.toml").write_bytes("name = 'café'".encode("latin-1"))
    with pytest.raises(FileRejected, match=r"couldn't read job.toml: byte 11 is not UTF-8"):
        read_text(tmp_path / "latin1.toml", 1000, what="job.toml")
    (tmp_path / "ok").write_text("café")
    assert read_text(tmp_path / "ok", 100) == "café"


def test_read_bounded_reads_a_file_that_grew_after_its_fstat_up_to_the_limit(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read asks for the size fstat saw (not the limit: a 1 MiB buffer per small file was
    most of a heartbeat poll's CPU); a file that grew since is read on, and refused past the limit."""
    path = tmp_path / "grows"
    path.write_bytes(b"x" * 100)
    real = os.fstat

    def smaller(fd: int) -> os.stat_result:   # fstat saw it at 10 bytes; 90 came after
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 10,
                               int(st.st_atime), int(st.st_mtime), int(st.st_ctime)))

    monkeypatch.setattr(os, "fstat", smaller)
    assert read_bounded(path, 200) == b"x" * 100
    assert read_bounded(path, 100) == b"x" * 100
    with pytest.raises(FileRejected, match="more than 50 bytes"):
        read_bounded(path, 50)
