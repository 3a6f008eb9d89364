"""The chunked verification of the reader (``fileio.py``): a piece's bytes land a step at a time and each
step is checksummed as it lands, from a copy in memory (a tmpfs file) or from a peer's stream. A single
flipped byte in the first, a middle or the last step is found; a short copy, a short stream and a broken
connection are errors of the copy (``CheckpointCorrupt``: the restore reads the file system), never a
partly filled tensor handed on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckpt.states import engine
from slurm_omni.checkpoint import ShardState, fileio
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.format import CheckpointCorrupt

STEP = fileio._MEM_STEP   # the step of a copy in memory and of a stream
BIG = 5 * STEP // 4 + 1000   # float32 elements: about 5 steps, the last one short


class FakeStream:
    """A keeper's stream of ``data``, arriving in pieces of at most ``piece`` bytes; ``broken_at``: the
    connection breaks once that many bytes were sent."""

    def __init__(self, data: bytes, *, size: int | None = None, piece: int = 100_000,
                 broken_at: int | None = None) -> None:
        self.data, self.size, self.piece, self.broken_at = data, len(data) if size is None else size, piece, broken_at
        self.at = 0
        self.node = "B"
        self.closed = False

    def recv_into(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            if self.broken_at is not None and self.at >= self.broken_at:
                raise ConnectionResetError(104, "Connection reset by peer")
            chunk = self.data[self.at:self.at + min(self.piece, len(view) - got)]
            if not chunk:
                break
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
            self.at += len(chunk)
        return got

    def abort(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, fmt.Manifest, torch.Tensor]:
    root = tmp_path_factory.mktemp("chunked")
    big = torch.randn(BIG, generator=torch.Generator().manual_seed(1))
    with engine(root) as eng:
        eng.save(1, ShardState(modules={"m": {"a.small": torch.arange(10.0), "big": big}}), sync=True)
    path = fmt.step_dir(root, 1)
    return path, fmt.read_manifest(path), big


def big_piece(manifest: fmt.Manifest) -> fmt.Piece:
    (piece,) = manifest.units["m/model"].tensors["big"].pieces
    assert piece.nbytes == BIG * 4 and piece.nbytes > 4 * STEP
    return piece


def job(piece: fmt.Piece) -> fileio.Job:
    out = torch.zeros(piece.shape, dtype=torch.float32)
    return fileio.Job("m/model/big", "big", piece, out, fileio.host_bytes(out), None, nbytes=piece.nbytes)


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


def spots(piece: fmt.Piece) -> dict[str, int]:
    """A byte in the first step, in a middle one, and the very last byte of the piece."""
    return {"first": piece.offset, "middle": piece.offset + 2 * STEP + 12_345, "last": piece.offset + piece.nbytes - 1}


def shard_bytes(path: Path, manifest: fmt.Manifest) -> bytes:
    return (path / str(manifest.shards["rank-00000"].file)).read_bytes()


def test_a_clean_stream_lands_bitwise_in_the_tensor(saved: tuple[Path, fmt.Manifest, torch.Tensor]) -> None:
    path, manifest, big = saved
    piece = big_piece(manifest)
    stream = FakeStream(shard_bytes(path, manifest), piece=70_001)   # receives that cut steps anywhere
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": stream})
    j = job(piece)
    files.read_stream("rank-00000", j)
    assert torch.equal(j.out, big) and files.read_bytes["peer"] == piece.nbytes
    files.close()
    assert stream.closed


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_a_stream_is_found(saved: tuple[Path, fmt.Manifest, torch.Tensor], where: str) -> None:
    path, manifest, _ = saved
    piece = big_piece(manifest)
    data = flipped(shard_bytes(path, manifest), spots(piece)[where])
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": FakeStream(data)})
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch in m/model/big .*from B's memory"):
        files.read_stream("rank-00000", job(piece))


@pytest.mark.parametrize("cut", ["before", "first", "middle", "last"])
def test_a_short_stream_is_an_error_of_the_copy(saved: tuple[Path, fmt.Manifest, torch.Tensor], cut: str) -> None:
    path, manifest, _ = saved
    piece = big_piece(manifest)
    data = shard_bytes(path, manifest)
    end = piece.offset - 10 if cut == "before" else spots(piece)[cut]
    files = fileio.ShardFiles(path, manifest, direct_io=False,
                              sources={"rank-00000": FakeStream(data[:end], size=len(data))})
    with pytest.raises(CheckpointCorrupt, match=f"ended at {end} of {len(data)} bytes, "
                                                f"{'before' if cut == 'before' else 'inside'} m/model/big"):
        files.read_stream("rank-00000", job(piece))


def test_a_broken_connection_is_an_error_of_the_copy(saved: tuple[Path, fmt.Manifest, torch.Tensor]) -> None:
    path, manifest, _ = saved
    piece = big_piece(manifest)
    stream = FakeStream(shard_bytes(path, manifest), broken_at=piece.offset + 3 * STEP)
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": stream})
    with pytest.raises(CheckpointCorrupt, match="Connection reset by peer, inside m/model/big"):
        files.read_stream("rank-00000", job(piece))


def test_pieces_asked_out_of_order_are_refused(saved: tuple[Path, fmt.Manifest, torch.Tensor]) -> None:
    path, manifest, _ = saved
    piece = big_piece(manifest)
    small = manifest.units["m/model"].tensors["a.small"].pieces[0]
    assert small.offset < piece.offset
    files = fileio.ShardFiles(path, manifest, direct_io=False,
                              sources={"rank-00000": FakeStream(shard_bytes(path, manifest))})
    files.read_stream("rank-00000", job(piece))
    out = torch.zeros(10)
    with pytest.raises(CheckpointCorrupt, match="outside what is left"):
        files.read_stream("rank-00000", fileio.Job("m/model/a.small", "a.small", small, out, fileio.host_bytes(out),
                                                   None, nbytes=small.nbytes))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_a_copy_in_memory_is_found(saved: tuple[Path, fmt.Manifest, torch.Tensor],
                                                     tmp_path: Path, where: str) -> None:
    path, manifest, big = saved
    piece = big_piece(manifest)
    copy = tmp_path / "copy.h5"
    shutil.copyfile(path / str(manifest.shards["rank-00000"].file), copy)
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": copy})
    j = job(piece)
    assert files.read_run([j], stop=lambda: False)   # the clean copy first
    assert torch.equal(j.out, big)
    files.close()
    copy.write_bytes(flipped(copy.read_bytes(), spots(piece)[where]))
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": copy})
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch in m/model/big"):
        files.read_run([job(piece)], stop=lambda: False)
    files.close()


def test_a_short_copy_in_memory_is_found(saved: tuple[Path, fmt.Manifest, torch.Tensor], tmp_path: Path) -> None:
    path, manifest, _ = saved
    piece = big_piece(manifest)
    copy = tmp_path / "copy.h5"
    copy.write_bytes(shard_bytes(path, manifest)[:spots(piece)["middle"]])
    files = fileio.ShardFiles(path, manifest, direct_io=False, sources={"rank-00000": copy})
    with pytest.raises(CheckpointCorrupt, match="truncated inside m/model/big"):
        files.read_run([job(piece)], stop=lambda: False)
    files.close()
