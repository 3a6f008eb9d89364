"""Restore, critical module first: which checkpoint, and which of its units this rank loads first.

The units (a module's weights, a module's optimizer state) this rank needs are queued in the order the
first step needs them: the critical modules' weights, the other modules' weights in load order, then
the optimizer states (``reader.Restore`` reads them). ``open_restore`` returns once the critical units
are ready; a bad checkpoint found until then is marked and the previous complete one is used.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.format import CheckpointCorrupt
from slurm_omni.checkpoint.held import HeldCopy
from slurm_omni.checkpoint.memtier import MemoryTier
from slurm_omni.checkpoint.peer import PeerStream, Replicas, close_streams
from slurm_omni.checkpoint.reader import Restore
from slurm_omni.checkpoint.snapshot import MODEL, OPTIM, ShardLayout
from slurm_omni.errors import CheckpointError
from slurm_omni.formats.memtier_keeper import HeldCopyRecord

log = logging.getLogger(__name__)

Source = Path | HeldCopy | PeerStream
"""Where a shard's bytes come from besides the checkpoint's own file: a tmpfs copy, the node keeper's
memory (``held.py``), a peer keeper's stream (``peer.py``)."""

__all__ = ["Restore", "open_restore"]


def open_restore(root: Path, layout: ShardLayout, *, step: int | None = None, max_step: int | None = None,
                 critical: Iterable[str] | None = None, modules: Iterable[str] | None = None,
                 into: Mapping[str, Mapping[str, Any]] | None = None, device: torch.device | str = "cpu",
                 threads: int = 4, direct_io: bool = True, apply_rng: bool = True,
                 memory: MemoryTier | None = None, peers: Replicas | None = None,
                 memo: fmt.ManifestMemo | None = None) -> Restore | None:
    """Load the newest complete checkpoint that verifies; None when there is none at all.

    A truncated file or a checksum mismatch in the manifest or a critical unit marks that checkpoint
    CORRUPT, logs one line, and the previous complete checkpoint is tried. A mismatch found later, while
    the rest streams in, surfaces as CheckpointCorrupt on first use of that unit (and the mark makes the
    next attempt skip the checkpoint).

    ``memory``: this node's memory tier; the shards it holds a copy of (by the committing incarnation)
    are read from there, checked the same way; a bad copy is dropped (one line) and the step read again
    from the files, so a bad copy never fails a restore nor marks the checkpoint.

    ``peers``: the shards this node lacks are read from the node that keeps their replica (``peer.py``):
    its keeper sends the copy and the reader receives it straight into the tensors, checking each
    tensor's xxh3 as it lands (one pass over the bytes; no copy is kept on this node), a bad or broken
    stream handled like a bad copy in memory.

    A memory-only step (some shards only in the memory tier: ``ShardInfo.memory_only``) whose shards
    this rank needs and no memory it reaches holds (or holds a bad copy of, or streams badly) is passed
    over, not marked: the previous step is tried, and the agreement (``agree.py``) takes every rank to
    the newest step each of them can restore from some valid source.

    ``memo``: manifests this restore parsed already (``fmt.read_manifest``).
    """
    candidates = fmt.complete(root)
    if max_step is not None:   # the ranks agreed on no newer step (checkpoint/agree.py)
        candidates = [e for e in candidates if e.step <= max_step]
    if step is not None:
        candidates = [e for e in candidates if e.step == step]
        if not candidates:
            raise CheckpointError(f"checkpoint: couldn't restore step {step}: no complete step-{step} in {root}")
    if not candidates:
        return None
    skipped = []
    reasons: list[str] = []
    passed: list[str] = []
    held = memory.where_soon() if memory is not None else None   # answered while the manifest is parsed
    for entry in candidates:
        session = None
        sources: dict[str, Source] = {}
        fetched: frozenset[str] = frozenset()
        try:
            manifest = fmt.read_manifest(entry.path, memo=memo)
            units, wanted = _select(manifest, layout, critical, modules)
            sources, fetched = _memory_sources(memory, manifest, units, peers, held)
            lacking = _memory_only_lacking(manifest, units, sources)
            if lacking:
                close_streams(sources)
                log.warning("checkpoint: step-%d: %s only in memory, and no memory this rank reaches holds %s; "
                            "trying the previous checkpoint", entry.step, _names(lacking),
                            "it" if len(lacking) == 1 else "them")
                passed.append(f"step-{entry.step}")
                continue
            session = _open(entry.path, manifest, layout, units, wanted, sources, into=into, device=device,
                            threads=threads, direct_io=direct_io, fetched=fetched)
        except CheckpointCorrupt as e:
            if session is not None:
                session.close()
            close_streams(sources)
            if sources and memory is not None:
                # the copy in memory, not the checkpoint, may be what is bad: drop it, read the files
                copies = {k: v for k, v in sources.items() if isinstance(v, Path | HeldCopy)}
                memory.drop(copies)
                if any(manifest.shards[s].memory_only for s in sources if s in manifest.shards):
                    # no file to read it from: not the checkpoint's fault, nothing to mark
                    log.warning("%s (read from %s); %sstep-%d is only in memory, trying the previous checkpoint",
                                e, "a peer's memory" if fetched else "this node's memory",
                                "dropped the copy: " if copies else "", entry.step)
                    passed.append(f"step-{entry.step}")
                    continue
                log.warning("%s (read from %s); %sreading step-%d from the file system", e,
                            "a peer's memory" if fetched else "this node's memory",
                            "dropped the copy and " if copies else "", entry.step)
                try:
                    session = _open(entry.path, manifest, layout, units, wanted, {}, into=into,
                                    device=device, threads=threads, direct_io=direct_io)
                except CheckpointCorrupt as again:
                    e, session = again, None
            if session is None:
                fmt.mark_corrupt(entry.path, str(e))
                log.warning("%s; marked it CORRUPT and trying the previous checkpoint", e)
                skipped.append(f"step-{entry.step}")
                reasons.append(str(e))
                continue
        except BaseException:
            if session is not None:
                session.close()
            close_streams(sources)
            raise
        session.fallbacks = tuple(reasons)
        if apply_rng:
            session.apply_rng()
        inherited = session.inherited
        log.info("checkpoint: restoring step-%d from %s%s (%s ready in %.2f s; %d units streaming)%s", session.step,
                 session.source, f" ({inherited} shard{'s' * (inherited != 1)} inherited from the standby)"
                 if inherited else "", ", ".join(wanted) or "nothing critical", time.monotonic() - session.started,
                 len(units) - len(wanted), f"; skipped {', '.join(skipped)}" if skipped else "")
        return session
    if passed and not skipped:
        raise CheckpointError(f"checkpoint: couldn't restore from {root}: {', '.join(passed)} only in memory, "
                              f"which no memory this rank reaches holds, and no older checkpoint with files")
    raise CheckpointError(f"checkpoint: couldn't restore from {root}: every complete checkpoint is corrupt "
                          f"({', '.join(skipped)}; see the CORRUPT file in each)"
                          + (f"; {', '.join(passed)} only in memory, which no memory this rank reaches holds"
                             if passed else ""))


def _open(path: Path, manifest: fmt.Manifest, layout: ShardLayout, units: list[fmt.Unit], wanted: list[str],
          sources: dict[str, Source], *, into: Mapping[str, Mapping[str, Any]] | None, device: torch.device | str,
          threads: int, direct_io: bool, fetched: frozenset[str] = frozenset()) -> Restore:
    """A session whose critical units are in memory (all units when some come from the memory tier:
    reading them is fast, and a bad copy must be found before training starts on it)."""
    _check_files(path, manifest, sources)
    session = Restore(path, manifest, layout, units=units, into=into or {}, device=torch.device(device),
                      threads=threads, direct_io=direct_io, sources=sources)
    try:
        needed = {p.shard for u in units for e in u.tensors.values() for p in e.pieces}
        if sources:
            here = "peer memory" if fetched & needed else "memory"
            session.source = here if needed <= set(sources) else f"{here} and file system"
        session.wait(session.units if sources else wanted)
        session.release_inherited()   # every byte from this node's memory is read
        early = session.hand_out()
        if isinstance(early, CheckpointCorrupt):
            raise early   # found while the critical units loaded: still time to fall back
    except BaseException:
        session.close()
        raise
    return session


def _memory_sources(memory: MemoryTier | None, manifest: fmt.Manifest, units: list[fmt.Unit],
                    peers: Replicas | None = None,
                    held: Callable[[list[str]], list[tuple[HeldCopyRecord, int]]] | None = None,
                    ) -> tuple[dict[str, Source], frozenset[str]]:
    """The shards this rank reads that its node's memory holds a copy of (else a peer's: a stream from
    its keeper), and which of them come from a peer. ``held``: the keeper's copies, asked for early
    (``MemoryTier.where_soon``)."""
    if memory is None:
        return {}, frozenset()
    needed = {p.shard for u in units for e in u.tensors.values() for p in e.pieces}
    found: dict[str, Source] = {shard: path for shard, path in memory.sources(manifest, held=held).items()
                                if shard in needed}
    fetched: dict[str, Source] = {}
    if peers is not None and needed - set(found):
        fetched = dict(peers.fetch(manifest, needed - set(found)))
    return {**found, **fetched}, frozenset(fetched)


def _memory_only_lacking(manifest: fmt.Manifest, units: list[fmt.Unit],
                         sources: Mapping[str, Source]) -> list[str]:
    """The shards this rank reads that are only in memory and that no memory it reaches holds."""
    needed = {p.shard for u in units for e in u.tensors.values() for p in e.pieces if p.nbytes}
    return sorted(s for s in needed if s in manifest.shards and manifest.shards[s].memory_only and s not in sources)


def _names(shards: list[str]) -> str:
    return (", ".join(shards[:4]) + (f" and {len(shards) - 4} more" if len(shards) > 4 else "")
            + (" is" if len(shards) == 1 else " are"))


def _check_files(path: Path, manifest: fmt.Manifest, sources: Mapping[str, Source] | None = None) -> None:
    for name, shard in manifest.shards.items():
        source = (sources or {}).get(name)
        if shard.file is None or isinstance(source, PeerStream | HeldCopy):
            continue   # a stream's or held copy's size is the keeper's, checked against the manifest already
        if shard.memory_only and source is None:
            continue   # no file: a memory-only shard this rank does not read (_memory_only_lacking)
        try:
            st = os.lstat(source or path / shard.file)
        except FileNotFoundError as e:
            raise CheckpointCorrupt(f"checkpoint: {path.name}: {shard.file} is missing") from e
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorrupt(f"checkpoint: {path.name}: {shard.file} is not a regular file")
        size = st.st_size
        if size != shard.file_bytes:
            raise CheckpointCorrupt(f"checkpoint: {path.name}: {shard.file} is truncated or damaged "
                                    f"({size} bytes on disk, {shard.file_bytes} written)")


def _select(manifest: fmt.Manifest, layout: ShardLayout, critical: Iterable[str] | None,
            modules: Iterable[str] | None) -> tuple[list[fmt.Unit], list[str]]:
    """This rank's units in loading order, and the names of the critical ones."""
    if modules is None:
        mine = {u.module for u in manifest.units.values() if u.stage == layout.stage}
        if not mine and manifest.units:
            stages = sorted({u.stage for u in manifest.units.values()})
            raise CheckpointError(f"checkpoint: step-{manifest.step} has no modules for stage "
                                  f"{layout.stage!r} (saved stages: {', '.join(stages)}; pass modules=)")
    else:
        mine = set(modules)
        unknown = mine - {u.module for u in manifest.units.values()}
        if unknown:
            raise CheckpointError(f"checkpoint: step-{manifest.step} has no module {min(unknown)!r}")
    order = [m for m in manifest.load_order if m in mine] + sorted(mine - set(manifest.load_order))
    first = [m for m in (order if critical is None else critical)]
    unknown = set(first) - mine
    if unknown:
        raise CheckpointError(f"checkpoint: critical module {min(unknown)!r} is not among "
                              f"this rank's modules ({', '.join(order)})")
    names = [f"{m}/{MODEL}" for m in first]
    names += [f"{m}/{MODEL}" for m in order if m not in first]
    names += [f"{m}/{OPTIM}" for m in order]
    units = [manifest.units[n] for n in names if n in manifest.units]
    return units, [f"{m}/{MODEL}" for m in first if f"{m}/{MODEL}" in manifest.units]
