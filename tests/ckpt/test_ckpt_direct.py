"""Reads from a cold page cache go through O_DIRECT, warm ones through the page cache; both check every byte.

The shard files' pages are dropped with posix_fadvise(DONTNEED) (they are clean after the save's
fsync), as after a node replacement, where nothing of the checkpoint is cached yet.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import fileio
from slurm_omni.checkpoint import format as fmt


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("step-*/*.h5"))


def drop_cache(root: Path) -> None:
    """Evict the shard files' pages; skip where this file system cannot say or do that."""
    for file in shard_files(root):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            residency = fileio.Residency(fd, size)
            still = residency.pages(0, size).cached(0, size)
            residency.close()
        finally:
            os.close(fd)
        direct = fileio.open_direct(file)
        if direct is None:
            pytest.skip(f"{file.parent.parent} refuses O_DIRECT")
        os.close(direct)
        if still:
            pytest.skip(f"the page cache keeps {file.name} after DONTNEED here (tmpfs?)")


def warm_up(root: Path) -> None:
    for file in shard_files(root):
        file.read_bytes()


@pytest.fixture
def two(tmp_path: Path) -> Path:
    with engine(tmp_path, critical=("vision_encoder",)) as eng:
        eng.save(100, shard_state(100, scale=8))
        eng.save(200, shard_state(200, scale=8))
    return tmp_path


# 5000: chunks smaller than a page, cut at odd places inside and between datasets
@pytest.mark.parametrize("chunk", [None, 5000])
def test_a_cold_restore_reads_with_o_direct_and_comes_back_bitwise(two: Path, chunk: int | None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk is not None:
        monkeypatch.setattr(fileio, "_CHUNK", chunk)
    drop_cache(two)
    with engine(two) as eng, eng.restore() as r:
        r.wait()
        assert r.step == 200
        assert r.read_bytes["direct"] > 0 and r.read_bytes["buffered"] == 0
        for name, sd in modules(200, scale=8).items():
            assert_same(r.module(name), sd, name)
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))
    warm_up(two)
    with engine(two) as eng, eng.restore() as r:
        r.wait()
        assert r.read_bytes["direct"] == 0 and r.read_bytes["buffered"] > 0
        assert_same(r.module("vision_encoder"), modules(200, scale=8)["vision_encoder"])


def test_a_flipped_byte_read_with_o_direct_falls_back_to_the_previous_step(
        two: Path, caplog: pytest.LogCaptureFixture) -> None:
    step = fmt.step_dir(two, 200)
    piece = fmt.read_manifest(step).units["vision_encoder/model"].tensors["blocks.1.weight"].pieces[0]
    fd = os.open(step / "rank-00000.h5", os.O_RDWR)
    try:
        at = piece.offset + piece.nbytes // 3
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
        os.fsync(fd)   # clean pages, so that DONTNEED drops them and the read goes to the disk
    finally:
        os.close(fd)
    drop_cache(two)
    with engine(two) as eng, eng.restore(critical=("vision_encoder",)) as r:
        assert r.step == 100
        assert r.read_bytes["direct"] > 0
        assert_same(r.module("vision_encoder"), modules(100, scale=8)["vision_encoder"])
    (message,) = [m.getMessage() for m in caplog.records if m.levelno >= logging.WARNING]
    assert "step-200" in message and "checksum mismatch in vision_encoder/model/blocks.1.weight" in message
    assert [e.step for e in fmt.complete(two)] == [100]


def test_direct_io_off_reads_a_cold_cache_through_the_page_cache(two: Path) -> None:
    drop_cache(two)
    with engine(two, direct_io=False) as eng, eng.restore() as r:
        r.wait()
        assert r.read_bytes["direct"] == 0 and r.read_bytes["buffered"] > 0
        assert_same(r.module("text_decoder"), modules(200, scale=8)["text_decoder"])


def warm_every_other(root: Path, stretch: int) -> None:
    """Bring every other ``stretch`` bytes of each shard file into the page cache (no read-ahead)."""
    for file in shard_files(root):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for at in range(0, os.fstat(fd).st_size, 2 * stretch):
                os.pread(fd, stretch, at)
        finally:
            os.close(fd)


# chunk, step: a chunk that starts cached and runs into pages that are not, inside a step and on its edge
@pytest.mark.parametrize(("chunk", "step"), [(64 << 10, 8 << 10), (64 << 10, 6000), (1 << 20, 256 << 10)])
def test_a_partly_cached_file_is_read_from_the_cache_where_it_can_and_with_o_direct_where_not(
        two: Path, chunk: int, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileio, "_CHUNK", chunk)
    monkeypatch.setattr(fileio, "_STEP", step)
    drop_cache(two)
    warm_every_other(two, 16 << 10)
    with engine(two) as eng, eng.restore() as r:
        r.wait()
        assert r.step == 200
        assert r.read_bytes["direct"] > 0 and r.read_bytes["buffered"] > 0
        for name, sd in modules(200, scale=8).items():
            assert_same(r.module(name), sd, name)
        assert_same(r.optimizer("text_decoder"), optimizer_state(200))


def test_a_flipped_byte_in_a_cached_page_read_without_waiting_falls_back_too(
        two: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffered path reads with RWF_NOWAIT where the file system allows direct reads: a mismatch
    found in what it copied is still one clear error and the previous step is used."""
    monkeypatch.setattr(fileio, "_CHUNK", 64 << 10)
    step = fmt.step_dir(two, 200)
    piece = fmt.read_manifest(step).units["vision_encoder/model"].tensors["blocks.1.weight"].pieces[0]
    fd = os.open(step / "rank-00000.h5", os.O_RDWR)
    try:
        at = piece.offset + piece.nbytes // 2
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_cache(two)
    warm_every_other(two, 8 << 10)
    with engine(two) as eng, eng.restore(critical=("vision_encoder",)) as r:
        assert r.step == 100
        assert_same(r.module("vision_encoder"), modules(100, scale=8)["vision_encoder"])
    (message,) = [m.getMessage() for m in caplog.records if m.levelno >= logging.WARNING]
    assert "step-200" in message and "checksum mismatch in vision_encoder/model/blocks.1.weight" in message


def test_host_bytes_are_the_tensors_own_memory_and_only_a_contiguous_host_tensors() -> None:
    import torch

    t = torch.zeros(4, 3)
    view = fileio.host_bytes(t[1:3])
    assert len(view) == 2 * 3 * 4
    view[:4] = torch.tensor([1.5]).numpy().tobytes()
    assert t[1, 0].item() == 1.5 and t.sum().item() == 1.5
    assert len(fileio.host_bytes(torch.empty(0))) == 0
    with pytest.raises(ValueError, match="contiguous host tensor"):
        fileio.host_bytes(t.t())


def test_a_kernel_without_rwf_nowait_for_buffered_reads_reads_resident_chunks_whole(
        two: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    preadv = os.preadv
    refused: list[int] = []

    def no_nowait(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if flags:
            refused.append(flags)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(fileio.os, "preadv", no_nowait)
    warm_up(two)
    with engine(two) as eng, eng.restore() as r:
        r.wait()
        assert refused and r.read_bytes["direct"] == 0 and r.read_bytes["buffered"] > 0
        for name, sd in modules(200, scale=8).items():
            assert_same(r.module(name), sd, name)
