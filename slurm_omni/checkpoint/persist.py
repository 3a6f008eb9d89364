"""Phase two of a save, in the background: shard files, the commit, retention.

Each rank writes ``rank-R.h5`` and then its record ``rank-R.json``, both fsynced, into its
incarnation's own staging folder (``step-N.tmp.i<number>``, ``format.staging_dir``). The HDF5 file is
laid out first (h5py, metadata only: contiguous datasets allocated early, never filled), then the
tensor bytes go straight from the host buffer to their offsets with ``pwrite``, which releases the GIL
and moves the bytes once. Rank 0 then waits for every rank's record of the same incarnation, writes the
manifest, fsyncs, renames the folder to ``step-N`` and writes ``COMPLETE`` last, into the folder it
renamed (an open descriptor, not the name). An incarnation that a newer one fenced out of the root
(``fence.py``) writes nothing more: its shards are dropped, rank 0 removes its own staging folder, and
the save is reported ``fenced``.

What an incarnation removes, it or an older incarnation wrote: its own staging folder; a staging
folder of an older incarnation (named by its number) or a published step whose marker or manifest
names an older one, once its own commit went through and the fence still names it. A newer
incarnation's folders are never touched, and a fenced incarnation sweeps nothing: an old rank stopped
in its commit (a partition, SIGSTOP) and resumed after the next incarnation began the same step
leaves that step alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import h5py

from slurm_omni import __version__
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.dtypes import h5_type, name_of
from slurm_omni.checkpoint.fence import fenced_by, read_fence
from slurm_omni.checkpoint.snapshot import Item, ShardLayout, Snapshot
from slurm_omni.checkpoint.tree import tensor_paths
from slurm_omni.errors import CheckpointError
from slurm_omni.fsio import fsync_dir, write_atomic

if TYPE_CHECKING:
    from slurm_omni.checkpoint.memtier import MemoryTier

log = logging.getLogger(__name__)

_CHUNK = 1 << 30   # Linux moves at most 2 GiB - 4 KiB per read or write call
WRITERS = 2        # pwrite into the page cache is CPU-bound; two threads keep the disk and a core busy


@dataclass(frozen=True, slots=True)
class PersistStats:
    step: int
    bytes: int          # tensor bytes this rank wrote
    persist_s: float    # shard written and durable (and, on rank 0, the commit)
    committed: bool     # this process wrote the COMPLETE marker
    fenced: bool = False   # refused: a newer incarnation started on the root (nothing committed)
    memory_only: bool = False   # a memory-only step (its shard file in the memory tier, if it had room)


def persist(root: Path, snap: Snapshot, layout: ShardLayout, *, incarnation: str, keep_last: int,
            commit_timeout_s: float, number: int | None = None,
            abort: threading.Event | None = None,
            on_shard: Callable[[Path], object] | None = None, memory: MemoryTier | None = None,
            replicate: Callable[[Path], object] | None = None, tier_lock: threading.Lock | None = None,
            in_flight: int | None = None) -> PersistStats:
    """``number``: this incarnation's OMNI_INCARNATION, checked against the root's fence (None: unfenced);
    ``abort``: once set, rank 0 stops waiting for the other ranks' shards (the run is ending);
    ``on_shard``: called with this rank's shard file once it is durable (the memory tier copies it).

    ``memory``: a memory-only step: this rank's shard file is written into the memory tier instead of
    the staging folder (its record, the manifest and the marker still go to the file system, the
    manifest marking the shard ``memory_only``), then handed to ``replicate`` (the ring peer's copy).
    Where the tier has no room, the shard goes to the file system as usual. ``tier_lock``: held while
    this rank's copy enters the tier and the ring peer's (the engine's other lane copies there too).

    ``in_flight``: a step this process is still writing in its other lane (the engine's file system
    write while this is a memory-only step, or the reverse): retention sweeps nothing at or above it."""
    started = time.monotonic()
    if _fenced(root, snap.step, number, "before writing"):
        return PersistStats(snap.step, 0, time.monotonic() - started, False, fenced=True)
    tmp = fmt.staging_dir(root, snap.step, incarnation, number)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        written = write_shard(tmp, snap, layout, incarnation, root=root, number=number, on_shard=on_shard,
                              memory=memory, replicate=replicate, tier_lock=tier_lock)
    except FileNotFoundError:
        # a newer incarnation swept this one's staging folder: fenced, not a failure of this node
        if not _fenced(root, snap.step, number, "while writing its shard"):
            raise
        written = False
    except OSError:
        _mark_failed(tmp, layout.rank, incarnation)
        raise
    if not written:
        return PersistStats(snap.step, 0, time.monotonic() - started, False, fenced=True)
    committed = False
    if layout.rank == 0:
        if commit(root, snap.step, layout.world_size, incarnation, commit_timeout_s, number=number,
                  abort=abort) is None:
            return PersistStats(snap.step, snap.nbytes, time.monotonic() - started, False, fenced=True)
        committed = True
    persist_s = time.monotonic() - started   # durable and complete: what the figure means
    if committed:
        retire(root, keep_last=keep_last, newest=snap.step if in_flight is None else min(snap.step, in_flight),
               number=number)
    return PersistStats(snap.step, snap.nbytes, persist_s, committed, memory_only=memory is not None)


def _failed_name(rank: int, incarnation: str) -> str:
    return f"{fmt.shard_name(rank)}.{fmt.safe_name(incarnation)}.failed"


def _mark_failed(tmp: Path, rank: int, incarnation: str) -> None:
    """An empty file that tells rank 0's commit this rank's shard is not coming (no block is needed:
    it can be made on a full file system), so that the commit fails at once instead of waiting for it
    until ``commit_timeout_s``."""
    try:
        os.close(os.open(tmp / _failed_name(rank, incarnation), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except OSError as e:
        log.debug("checkpoint: couldn't mark rank %d's shard failed in %s: %s", rank, tmp, e)


def _fenced(root: Path, step: int, number: int | None, when: str) -> bool:
    fence = fenced_by(root, number)
    if fence is not None:
        log.warning("checkpoint: step %d of incarnation %s fenced %s: incarnation %d (%s) started on %s since; "
                    "not saved", step, number, when, fence.incarnation, fence.run, root)
    return fence is not None


def write_shard(tmp: Path, snap: Snapshot, layout: ShardLayout, incarnation: str, *, root: Path | None = None,
                number: int | None = None, on_shard: Callable[[Path], object] | None = None,
                memory: MemoryTier | None = None, replicate: Callable[[Path], object] | None = None,
                tier_lock: threading.Lock | None = None) -> bool:
    """This rank's shard file and record in ``tmp`` (the file in ``memory`` instead, for a memory-only
    step: see :func:`persist`); False (nothing left behind) when fenced out of ``root``."""
    name = fmt.shard_name(layout.rank)
    owned = [i for i in snap.items if i.owned]
    file_name, file_bytes, offsets, sums = None, 0, [-1] * len(owned), [""] * len(owned)
    in_memory = False
    if owned:
        file_name = f"{name}.h5"
        if memory is not None:
            with tier_lock or contextlib.nullcontext():
                kept = _memory_shard(memory, snap, layout, incarnation, offsets, sums, root=root, number=number,
                                     replicate=replicate)
            if kept is False:
                return False
            if kept is not None:
                in_memory, file_bytes = True, kept
        if not in_memory:
            # named by incarnation: two incarnations saving the same step never write the same file
            path = tmp / f"{file_name}.{fmt.safe_name(incarnation)}.partial"
            try:
                file_bytes = _write_file(path, snap, owned, offsets, sums, layout, incarnation)
            except BaseException:
                path.unlink(missing_ok=True)   # a full file system gets its space back
                raise
            if root is not None and _fenced(root, snap.step, number, "after writing its shard"):
                path.unlink(missing_ok=True)
                return False
            if on_shard is not None:
                on_shard(path)   # before the rename: once the record is there, rank 0 may move the folder
            os.replace(path, tmp / file_name)
    units: dict[str, Any] = {}
    for unit in snap.skeletons:
        units[unit] = {"stage": snap.stages[unit], "spec": snap.spec_digest.get(unit, ""), "datasets": []}
        if layout.data_parallel_rank == 0:
            units[unit]["skeleton"] = snap.skeletons[unit]
    for item, offset, xxh in zip(owned, offsets, sums, strict=True):
        units[item.unit]["datasets"].append({
            "path": item.path, "dataset": f"/{item.unit}/{item.path}", "dtype": name_of(item.dtype),
            "shape": list(item.shape), "split_dim": item.split_dim, "offset": offset,
            "nbytes": item.nbytes, fmt.CHECKSUM: xxh,
        })
    record = {
        "step": snap.step, "incarnation": incarnation, "shard": name, "rank": layout.rank,
        "world_size": layout.world_size, "stage": layout.stage,
        "data_parallel_rank": layout.data_parallel_rank, "data_parallel_size": layout.data_parallel_size,
        "file": file_name, "file_bytes": file_bytes, "load_order": list(snap.load_order),
        **({"memory_only": True} if in_memory else {}),
        "units": units, "state": json.loads(snap.state_json), "rng": snap.rng,
    }
    # Not fsynced: only the commit reads it, and the commit makes the directory durable as a whole.
    write_atomic(tmp / f"{name}.json", json.dumps(record).encode(), durable=False, owner=incarnation)
    return True


def _memory_shard(memory: MemoryTier, snap: Snapshot, layout: ShardLayout, incarnation: str, offsets: list[int],
                  sums: list[str], *, root: Path | None, number: int | None,
                  replicate: Callable[[Path], object] | None) -> int | Literal[False] | None:
    """This rank's shard of a memory-only step written into the memory tier, published, and handed to
    ``replicate`` (the ring peer's copy): its size; None where the tier has no room (the caller writes
    it to the file system); False when fenced out of ``root`` (nothing kept)."""
    written = _memory_file(memory, snap, layout, incarnation, offsets, sums,
                           sum(i.nbytes for i in snap.items if i.owned))
    if written is None:
        return None
    path, size = written
    if root is not None and _fenced(root, snap.step, number, "after writing its shard"):
        path.unlink(missing_ok=True)
        return False
    placed = memory.place(path, step=snap.step, root=root, number=number)
    if placed is None:
        return False
    if replicate is not None:
        replicate(placed)
    return size


def _memory_file(memory: MemoryTier, snap: Snapshot, layout: ShardLayout, incarnation: str, offsets: list[int],
                 sums: list[str], nbytes: int) -> tuple[Path, int] | None:
    """This rank's shard of a memory-only step written into the memory tier (not yet published): its
    ``.partial`` path and size; None where the tier has no room for it (one line; the caller writes
    it to the file system)."""
    owned = [i for i in snap.items if i.owned]
    partial = memory.staging(snap.step, layout.rank, incarnation, nbytes + (1 << 20))
    if partial is None:
        return None
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        return partial, _write_file(partial, snap, owned, offsets, sums, layout, incarnation)
    except OSError as e:
        partial.unlink(missing_ok=True)
        # one line per kind of trouble, then debug (a full tmpfs would say so every step)
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            memory._say("full", f"checkpoint: couldn't keep step {snap.step} in memory only: {memory.base} is full; "
                                "writing it to the file system")
        else:
            memory._say("copy", f"checkpoint: couldn't keep step {snap.step} in memory only: "
                                f"{' '.join(str(e).split())[:200]}; writing it to the file system")
        return None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _write_file(path: Path, snap: Snapshot, owned: list[Item], offsets: list[int], sums: list[str],
                layout: ShardLayout, incarnation: str) -> int:
    """Lay the HDF5 file out and fill it; return its size once durable.

    h5py creates each dataset (contiguous, allocated early, never filled: HDF5 itself writes no tensor
    byte) and hands its offset to writer threads that ``pwrite`` the bytes from the host buffer and
    checksum them, so the layout work overlaps the writes. The checksum attributes go in last.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    with h5py.File(path, "w") as f:
        fd = os.open(path, os.O_WRONLY)
        try:
            with ThreadPoolExecutor(WRITERS, thread_name_prefix="omni-ckpt-write") as pool:
                f.attrs.update({"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION,
                                "step": snap.step, "rank": layout.rank, "stage": layout.stage,
                                "data_parallel_rank": layout.data_parallel_rank, "incarnation": incarnation,
                                "writer_version": __version__})
                datasets, writes = [], []
                for k, item in enumerate(owned):
                    group_name, _, leaf = f"{item.unit}/{item.path}".rpartition("/")
                    group = f.require_group(group_name)
                    space = h5py.h5s.create_simple(item.shape) if item.shape else h5py.h5s.create(h5py.h5s.SCALAR)
                    dset = h5py.h5d.create(group.id, leaf.encode(), h5_type(item.dtype), space, dcpl=dcpl)
                    offset = dset.get_offset()
                    offsets[k] = -1 if offset is None else int(offset)
                    datasets.append(dset)
                    writes.append(pool.submit(_write_and_sum, fd, snap.view(item), offsets[k]))
                for k, (item, dset, write) in enumerate(zip(owned, datasets, writes, strict=True)):
                    sums[k] = write.result()
                    attrs = h5py.AttributeManager(h5py.Dataset(dset))
                    attrs["dtype"] = name_of(item.dtype)
                    attrs[fmt.CHECKSUM] = sums[k]
                    if item.split_dim is not None:
                        attrs["split_dim"] = item.split_dim
        except BaseException:
            os.close(fd)
            raise
    try:
        os.fsync(fd)   # after h5py closed the file: its metadata is on disk too
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _write_and_sum(fd: int, data: memoryview, offset: int) -> str:
    if len(data):
        _pwrite_all(fd, data, offset)
    return fmt.checksum(data)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:done + _CHUNK], offset + done)
        if n <= 0:
            raise CheckpointError(f"checkpoint: couldn't write: pwrite returned {n}")
        done += n


# -- the commit (rank 0) ------------------------------------------------------------------------------


def commit(root: Path, step: int, world_size: int, incarnation: str, timeout_s: float, *,
           number: int | None = None, abort: threading.Event | None = None) -> fmt.Manifest | None:
    """Rank 0: the manifest, the rename, the marker; None when fenced (its own staging folder removed)."""
    tmp = fmt.staging_dir(root, step, incarnation, number)
    try:
        records = _await_records(tmp, step, world_size, incarnation, timeout_s, abort)
    except CheckpointError:
        if not tmp.is_dir() and _fenced(root, step, number, "at its commit"):
            return None   # a newer incarnation took the folder over (``finish_orphaned``)
        raise
    if _fenced(root, step, number, "at its commit"):
        shutil.rmtree(tmp, ignore_errors=True)   # this incarnation's folder: nobody else's shards
        return None
    manifest, raw = _write_manifest(tmp, records, step, incarnation, number)
    folder = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # follows it through the rename
    try:
        if not _publish(root, tmp, step, number):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        fsync_dir(root)
        fmt.write_marker(fmt.step_dir(root, step), step, raw, number, dir_fd=folder)
    finally:
        os.close(folder)
    return manifest


def finish_orphaned(root: Path, number: int) -> int | None:
    """Rank 0 of incarnation ``number``, its fence pending (``fence.raise_fence``: no older incarnation
    commits any more): commit the newest step that every rank of an older incarnation wrote (shard and
    record) but whose commit that incarnation's rank 0 never made, its node lost between its own
    record and its commit. Without it losing rank 0's node costs a step more than losing any other.

    Only a staging folder of an older incarnation, newer than the newest step that counts, that the
    fence lets count (no incarnation in between fixed a lower horizon), with a record of the same
    incarnation and step from every rank. The folder is taken over by a rename first, so its own rank
    0 (stopped, not dead) finds it gone and, fenced, touches nothing of it; the manifest, the rename
    to ``step-N`` and the marker are those of that incarnation, as its rank 0 would have written them
    (the memory tier's copies are named by it). The step committed, or None (one line when one is)."""
    fence = read_fence(root)
    newest = fmt.latest_step(root)
    orphans = [e for e in fmt.scan(root) if e.status is fmt.Status.WRITING and e.incarnation is not None
               and e.incarnation < number and (newest is None or e.step > newest)
               and (fence is None or fence.counts(e.step, e.incarnation))]
    for entry in sorted(orphans, key=lambda e: -e.step):
        if _all_records(entry.path, entry.step) is None:
            continue
        taken = entry.path.with_name(f"step-{entry.step}.tmp.finish-i{number}")
        try:
            os.rename(entry.path, taken)
        except OSError as e:
            log.warning("checkpoint: couldn't take over %s to commit it: %s", entry.path, e.strerror)
            continue
        records = _all_records(taken, entry.step)   # again: nothing can join or leave it now
        try:
            if records is None or not _commit_records(root, taken, entry.step, records, entry.incarnation):
                shutil.rmtree(taken, ignore_errors=True)
                continue
        except (CheckpointError, OSError) as e:
            log.warning("checkpoint: couldn't commit step %d of incarnation %d for it: %s", entry.step,
                        entry.incarnation, e)
            shutil.rmtree(taken, ignore_errors=True)
            continue
        log.warning("checkpoint: step %d committed for incarnation %d, whose ranks had all written it but whose "
                    "rank 0 had not committed it (its node lost?)", entry.step, entry.incarnation)
        return entry.step
    return None


def _all_records(tmp: Path, step: int) -> list[dict[str, Any]] | None:
    """Every rank's record of ``step`` in ``tmp``, all of one incarnation and world size; else None."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith("rank-") and n.endswith(".json")]
    except OSError:
        return None
    records: dict[int, dict[str, Any]] = {}
    for name in names:
        try:
            record = json.loads((tmp / name).read_bytes())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            return None
    if not records:
        return None
    first = next(iter(records.values()))
    size, incarnation = first.get("world_size"), first.get("incarnation")
    if not isinstance(size, int) or sorted(records) != list(range(size)) or any(
            r.get("incarnation") != incarnation or r.get("step") != step or r.get("world_size") != size
            or r.get("shard") != fmt.shard_name(k) for k, r in records.items()):
        return None
    return [records[k] for k in range(size)]


def _commit_records(root: Path, tmp: Path, step: int, records: list[dict[str, Any]], number: int | None) -> bool:
    """The manifest of ``records``, the rename of ``tmp`` to ``step-N`` and the marker, as incarnation
    ``number`` commits; False when ``step-N`` is there already (nothing replaced)."""
    _, raw = _write_manifest(tmp, records, step, records[0]["incarnation"], number)
    folder = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # follows it through the rename
    try:
        final = fmt.step_dir(root, step)
        if os.path.lexists(final):
            return False
        os.rename(tmp, final)
        fsync_dir(root)
        fmt.write_marker(final, step, raw, number, dir_fd=folder)
    finally:
        os.close(folder)
    return True


def _write_manifest(tmp: Path, records: list[dict[str, Any]], step: int, incarnation: str,
                    number: int | None) -> tuple[fmt.Manifest, bytes]:
    """Merge ``records`` into the manifest and write it (and ``MEMORY_ONLY``) into ``tmp``; its bytes."""
    manifest = merge(records, step=step, incarnation=incarnation)
    if any(s.memory_only for s in manifest.shards.values()):
        # retention and ``omni ckpt ls`` tell it from a directory that holds every shard file
        write_atomic(tmp / fmt.MEMORY_ONLY, b"some shard files of this step are only in the memory tier\n",
                     durable=False)
    raw = json.dumps({**manifest.to_json(), **({"incarnation_number": number} if number is not None else {})}).encode()
    write_atomic(tmp / fmt.MANIFEST, raw)   # fsyncs the directory: every shard's entry with it
    return manifest, raw


def _publish(root: Path, tmp: Path, step: int, number: int | None) -> bool:
    """Rename ``tmp`` to ``step-N``; False when this incarnation turns out fenced. A copy of the step
    already there (a restore fell back past it, or an older incarnation's late commit) is retired
    first, never a newer incarnation's: a rename does not replace a folder that holds files."""
    final = fmt.step_dir(root, step)
    for _ in range(3):
        try:
            os.rename(tmp, final)
            return True
        except FileNotFoundError:
            if _fenced(root, step, number, "at its rename"):   # a newer incarnation swept its folder
                return False
            raise
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if not _retire_copy(root, final, step, number):
            return False
    raise CheckpointError(f"checkpoint: couldn't commit step {step}: {final} came back each time it was "
                          f"retired (another writer on {root}?)")


def _retire_copy(root: Path, final: Path, step: int, number: int | None) -> bool:
    """Take the copy of ``step`` at ``final`` out of use and remove it, if it is this incarnation's
    or an older one's; a newer one's goes back where it was and this incarnation is fenced (False)."""
    aside = root / f"step-{step}.old-{time.time_ns()}"
    try:
        os.rename(final, aside)   # first out of use: a reader sees no step-N, then the new one
    except FileNotFoundError:
        return True
    writer = _writer(aside)
    if number is not None and writer is not None and writer > number:
        log.warning("checkpoint: step %d of incarnation %d not committed: incarnation %d committed it "
                    "since; left as it was", step, number, writer)
        try:
            os.rename(aside, final)
        except OSError as e:
            log.error("checkpoint: couldn't put step %d of incarnation %d back at %s: %s (it is in %s)",
                      step, writer, final, e, aside)
        return False
    _remove(aside)
    return True


def _writer(path: Path) -> int | None:
    """The number of the incarnation that committed ``path``: its marker's, else its manifest's."""
    for name, key in ((fmt.MARKER, "incarnation"), (fmt.MANIFEST, "incarnation_number")):
        try:
            value = json.loads((path / name).read_bytes()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return value
    return None


def _await_records(tmp: Path, step: int, world_size: int, incarnation: str,
                   timeout_s: float, abort: threading.Event | None = None) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    found: dict[int, dict[str, Any]] = {}
    delay = 0.01
    while True:
        for rank in range(world_size):
            if rank in found:
                continue
            try:
                record = json.loads((tmp / f"{fmt.shard_name(rank)}.json").read_bytes())
            except (FileNotFoundError, ValueError):
                continue
            if record.get("incarnation") == incarnation and record.get("step") == step:
                found[rank] = record
        if len(found) == world_size:
            return [found[r] for r in range(world_size)]
        failed = [r for r in range(world_size) if r not in found and (tmp / _failed_name(r, incarnation)).exists()]
        if failed:
            raise CheckpointError(f"checkpoint: couldn't commit step {step}: rank(s) {_ranges(failed)} couldn't "
                                  "write their shards (the previous checkpoint stays in use)")
        if not tmp.is_dir():
            raise CheckpointError(f"checkpoint: couldn't commit step {step}: its folder {tmp} is gone (not "
                                  "committed; the previous checkpoint stays in use)")
        if abort is not None and abort.is_set():
            raise CheckpointError(f"checkpoint: couldn't commit step {step}: the run is ending (not committed; "
                                  "the previous checkpoint stays in use)")
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(found))
            raise CheckpointError(
                f"checkpoint: couldn't commit step {step}: no shard from rank(s) {_ranges(missing)} after "
                f"{timeout_s:.0f} s (those ranks died or are slow; the previous checkpoint stays in use)")
        if abort is not None:
            abort.wait(delay)
        else:
            time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _ranges(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks[:16]) + (",..." if len(ranks) > 16 else "")


def merge(records: list[dict[str, Any]], *, step: int, incarnation: str) -> fmt.Manifest:
    """Join the shard records into one manifest; replicas that disagree are an error, not a checkpoint."""
    stages: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        stages.setdefault(r["stage"], []).append(r)
    for stage, rs in stages.items():
        sizes = {r["data_parallel_size"] for r in rs}
        dp_ranks = sorted(r["data_parallel_rank"] for r in rs)
        if len(sizes) != 1 or dp_ranks != list(range(len(rs))) or len(rs) != sizes.pop():
            raise CheckpointError(f"checkpoint: couldn't commit step {step}: stage {stage!r} has "
                                  f"data-parallel ranks {dp_ranks} (each of 0..size-1 exactly once expected)")
        specs = {json.dumps({u: v["spec"] for u, v in r["units"].items()}, sort_keys=True) for r in rs}
        if len(specs) != 1:
            raise CheckpointError(f"checkpoint: couldn't commit step {step}: the replicas of stage "
                                  f"{stage!r} saved different tensors (same modules, keys, shapes expected)")
    units: dict[str, dict[str, Any]] = {}
    pieces: dict[tuple[str, str], list[tuple[fmt.Piece, str, tuple[int, ...], int | None]]] = {}
    for r in records:
        for name, u in r["units"].items():
            if name in units and units[name]["stage"] != r["stage"]:
                raise CheckpointError(f"checkpoint: couldn't commit step {step}: module unit {name!r} "
                                      f"is saved by two stages ({units[name]['stage']!r}, {r['stage']!r})")
            entry = units.setdefault(name, {"stage": r["stage"], "skeleton": None})
            if "skeleton" in u:
                entry["skeleton"] = u["skeleton"]
            for d in u["datasets"]:
                piece = fmt.Piece(shard=r["shard"], dataset=d["dataset"], offset=d["offset"],
                                  nbytes=d["nbytes"], xxh3=d[fmt.CHECKSUM], shape=tuple(d["shape"]),
                                  index=r["data_parallel_rank"] if d["split_dim"] is not None else 0)
                pieces.setdefault((name, d["path"]), []).append((piece, d["dtype"], piece.shape, d["split_dim"]))
    built: dict[str, fmt.Unit] = {}
    for name, entry in units.items():
        module, _, part = name.rpartition("/")
        tensors: dict[str, fmt.TensorEntry] = {}
        for path in tensor_paths(entry["skeleton"]):
            got = sorted(pieces.get((name, path), []), key=lambda p: p[0].index)
            if not got:
                raise CheckpointError(f"checkpoint: couldn't commit step {step}: no rank wrote {name}/{path}")
            dtype, split_dim = got[0][1], got[0][3]
            shape = list(got[0][2])
            if split_dim is not None:
                shape[split_dim] = sum(p[2][split_dim] for p in got)
            elif len(got) != 1:
                raise CheckpointError(f"checkpoint: couldn't commit step {step}: {name}/{path} written twice")
            tensors[path] = fmt.TensorEntry(dtype=dtype, shape=tuple(shape), split_dim=split_dim,
                                            pieces=tuple(p[0] for p in got))
        built[name] = fmt.Unit(module=module, part=part, stage=entry["stage"], skeleton=entry["skeleton"],
                               tensors=tensors)
    shards = {
        r["shard"]: fmt.ShardInfo(name=r["shard"], rank=r["rank"], stage=r["stage"],
                                  data_parallel_rank=r["data_parallel_rank"],
                                  data_parallel_size=r["data_parallel_size"], file=r["file"],
                                  file_bytes=r["file_bytes"], state=r["state"], rng=r["rng"],
                                  memory_only=r.get("memory_only") is True)
        for r in records
    }
    order: list[str] = []
    for r in sorted(records, key=lambda r: r["rank"]):
        order += [m for m in r["load_order"] if m not in order]
    return fmt.Manifest(step=step, world_size=len(records), incarnation=incarnation, created=time.time(),
                        writer_version=__version__, load_order=tuple(order), units=built, shards=shards)


# -- retention (rank 0) -------------------------------------------------------------------------------


_RETIRING = threading.Lock()
"""The engine's two lanes both commit on rank 0: one sweep at a time."""


def retire(root: Path, *, keep_last: int, newest: int, number: int | None = None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints (0 keeps all); sweep what crashes left behind.

    Only steps older than ``newest`` are swept: other ranks may already be writing a later step. An
    older incarnation's staging folder goes whatever its step (that incarnation is fenced out). With
    ``number`` (this incarnation's), nothing a newer incarnation wrote is removed, and nothing at all
    once a newer one started on the root.
    """
    with _RETIRING:
        _retire(root, keep_last=keep_last, newest=newest, number=number)


def _retire(root: Path, *, keep_last: int, newest: int, number: int | None = None) -> None:
    fence = fenced_by(root, number)
    if fence is not None:
        log.info("checkpoint: incarnation %d leaves %s to incarnation %d: nothing retired", number, root,
                 fence.incarnation)
        return
    entries = fmt.scan(root)
    counted = {e.path for e in fmt.complete(root)}
    done = [e for e in entries if e.path in counted]
    # ``keep_last`` counts the steps whose files are all there; a memory-only step (its shards in the
    # tier, which keeps two steps per rank) is kept while it is one of the two newest and newer than
    # the newest step with files: an older one is never restored (that step is newer and complete)
    in_memory = {e.path for e in done if fmt.memory_only(e.path)}
    with_files = [e for e in done if e.path not in in_memory]
    newest_files = with_files[-1].step if with_files else -1
    doomed = with_files[:-keep_last] if keep_last > 0 else []
    doomed += [e for e in done if e.path in in_memory and (e.step < newest_files or e not in done[-2:])]
    oldest_kept = min((e.step for e in done if e not in doomed), default=newest)
    for e in entries:
        older_staging = (e.status is fmt.Status.WRITING and number is not None and e.incarnation is not None
                         and e.incarnation < number)
        stale = e.status in (fmt.Status.INCOMPLETE, fmt.Status.WRITING, fmt.Status.RETIRED) and e.step < newest
        # corrupt, or a late commit the fence shuts out (marked or not yet)
        out = e.status in (fmt.Status.CORRUPT, fmt.Status.FENCED) or (
            e.status is fmt.Status.COMPLETE and e.path not in counted)
        old_corrupt = out and e.step < oldest_kept
        if (e in doomed or stale or old_corrupt or older_staging) and not _newer(e, number):
            _remove(e.path)


def _newer(e: fmt.Entry, number: int | None) -> bool:
    """Did an incarnation newer than ``number`` write ``e`` (never, without a number)?"""
    if number is None:
        return False
    writer = e.incarnation if e.status in (fmt.Status.WRITING, fmt.Status.COMPLETE) else _writer(e.path)
    return writer is not None and writer > number


def _remove(path: Path) -> None:
    try:
        (path / fmt.MARKER).unlink(missing_ok=True)   # no longer complete before anything else goes
        shutil.rmtree(path)
    except OSError as e:
        log.warning("checkpoint: couldn't remove %s: %s", path, e)
