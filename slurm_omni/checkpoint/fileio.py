"""How the reader gets a shard file's bytes: from the page cache where they are already there, with
``O_DIRECT`` where they are not.

From a cold cache, a buffered read spends most of its CPU time in the page cache (allocating pages,
filling and copying them), and on two cores that is the restore's bottleneck, not the disk: reading
the same file with ``O_DIRECT`` into an aligned buffer took about 0.6 of the buffered time here. From
a warm cache, a buffered read is one copy and ``O_DIRECT`` would go back to the disk. So the reader
asks the kernel whether a chunk's first page is resident (``mincore`` on a read-only mapping of the
file, which reads nothing), reads from there with ``RWF_NOWAIT`` (the kernel copies only what it holds
and says where that ends) and reads the rest with ``O_DIRECT``. Anything this module cannot do (no
``mincore``, no ``RWF_NOWAIT``, a file system without ``O_DIRECT``) falls back to buffered reads, which
are always correct.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import xxhash

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.format import CheckpointCorrupt
from slurm_omni.checkpoint.held import HeldCopy, read_hashed

log = logging.getLogger(__name__)

MAX_GAP = 64 << 10       # HDF5 metadata between two datasets is a few KiB; read through it
ALIGN = 4096             # O_DIRECT wants offset, length and memory aligned to the logical block size
_MAX_RUN = 256 << 20     # bytes per run of adjoining pieces (one task of an I/O thread)
_MAX_IOV = 512           # iovecs per preadv (Linux allows 1024)
_CHUNK = 8 << 20         # bytes per O_DIRECT read (large requests keep the disk busy)
HUGE_PAGE = 2 << 20      # a tmpfs that gives a file huge pages says so in st_blksize
_STEP = 256 << 10        # bytes per buffered read, copy and checksum: they stay in the core's L2 cache
_MEM_STEP = 512 << 10    # the same from a tmpfs copy or a peer's stream (1 GiB from a huge-page tmpfs: 0.086
                         # s against 0.097 with 256 KiB, medians of 5; the L2 here is 1 MiB a core)
STREAM_STEP = 2 << 20    # the same from a peer's stream: each step one receive (Stream.recv_into waits for
                         # all of it), then its xxh3 (from L2 and L3); fewer, larger receives cost the
                         # receiver less CPU than 512 KiB ones (the restore's receiving thread, 1 GiB on
                         # loopback: 0.37 against 0.57 CPU s, medians of 7 paired rounds at load 3.5-5.5)

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))   # mincore: bit 0 says resident, the others are reserved
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)          # a buffered read that copies only what the page cache holds


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc() if hasattr(os, "O_DIRECT") else None


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return align_down(n + ALIGN - 1)


@dataclass(frozen=True, slots=True)
class Pages:
    """mincore's answer for a range of a file: one byte per page from ``start``, 1 when resident."""

    start: int
    resident: bytes | None   # None: unknown

    def cached(self, lo: int, hi: int) -> bool:
        """Is every page of ``[lo, hi)`` resident? True when unknown: the buffered read is always right."""
        if self.resident is None:
            return True
        page = mmap.PAGESIZE
        return b"\x00" not in self.resident[(lo - self.start) // page:(hi - 1 - self.start) // page + 1]


class Residency:
    """Which pages of one file the page cache holds, without reading any (``mincore``)."""

    def __init__(self, fd: int, size: int) -> None:
        self._size = size
        self._addr: int | None = None
        if _LIBC is None or size <= 0:
            return
        addr = _LIBC.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            log.debug("checkpoint: mmap for mincore failed: %s", os.strerror(ctypes.get_errno()))
            return
        self._addr = addr

    def pages(self, lo: int, hi: int) -> Pages:
        """Which pages of ``[lo, hi)`` are resident, asked once (one call for a whole run: each call
        releases the GIL, and on a busy machine getting it back costs more than the kernel's walk)."""
        if self._addr is None or _LIBC is None or hi <= lo:
            return Pages(lo, None)
        page = mmap.PAGESIZE
        start = lo - lo % page
        end = min(hi, self._size)
        vec = (ctypes.c_ubyte * ((end - start + page - 1) // page))()
        if _LIBC.mincore(ctypes.c_void_p(self._addr + start), end - start, vec) != 0:
            return Pages(lo, None)
        return Pages(start, bytes(vec).translate(_LOW_BIT))

    def close(self) -> None:
        if self._addr is not None and _LIBC is not None:
            _LIBC.munmap(ctypes.c_void_p(self._addr), self._size)
        self._addr = None


def host_bytes(t: torch.Tensor) -> memoryview:
    """The memory of contiguous host tensor ``t`` as writable bytes, in about a microsecond (the
    reshape/view/numpy chain took six, once per piece). The caller keeps ``t`` alive while it uses them."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"host_bytes: a contiguous host tensor, not {t.device} {list(t.stride())}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def open_direct(path: os.PathLike[str] | str) -> int | None:
    """A descriptor with ``O_DIRECT``, or None where the file system refuses it."""
    if _LIBC is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class Bounce:
    """One thread's aligned buffer for direct reads (page-locked when CUDA is there, like the staging)."""

    def __init__(self, nbytes: int) -> None:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        skip = -raw.data_ptr() % ALIGN
        self.tensor = raw[skip:skip + nbytes]
        self.view = self.tensor.numpy().data.cast("B")


class Stream(Protocol):
    """A shard's bytes arriving in file order (``peer.PeerStream``: a keeper sending its copy)."""

    size: int
    at: int
    node: str

    def recv_into(self, view: memoryview) -> int: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Job:
    """One piece to read, and the memory it goes to."""

    where: str
    path: str
    piece: fmt.Piece
    out: torch.Tensor
    buf: memoryview             # the same bytes
    dest: torch.Tensor | None   # the device tensor a staged piece is copied to
    count: int = 1
    nbytes: int = 0

    def adjoins(self, nxt: Job) -> bool:
        """Can ``nxt`` be read in the same run as this job's?"""
        gap = nxt.piece.offset - (self.piece.offset + self.piece.nbytes)
        return (self.dest is None and nxt.dest is None and nxt.piece.shard == self.piece.shard
                and 0 <= gap <= MAX_GAP and self.count < _MAX_IOV // 2 and self.nbytes < _MAX_RUN
                and self.piece.nbytes > 0 and nxt.piece.nbytes > 0)


class ShardFiles:
    """The open shard files of one checkpoint: descriptors per thread, page-cache residency, buffers."""

    def __init__(self, path: Path, manifest: fmt.Manifest, *, direct_io: bool,
                 sources: Mapping[str, Path | HeldCopy | Stream] | None = None) -> None:
        self.path = path
        self.manifest = manifest
        self.sources = {k: v for k, v in (sources or {}).items() if isinstance(v, Path)}
        """Shards read from another copy than ``path``'s file (the memory tier: ``memtier.py``)."""
        self.held = {k: v for k, v in (sources or {}).items() if isinstance(v, HeldCopy)}
        """Shards read from the node keeper's memory (``held.py``)."""
        self.streams: dict[str, Stream] = {k: v for k, v in (sources or {}).items()
                                           if not isinstance(v, Path | HeldCopy)}
        """Shards whose bytes arrive on a stream (a peer's memory: ``peer.py``), read once, in file order."""
        self.read_bytes = {"buffered": 0, "direct": 0}
        """Bytes read through the page cache and with O_DIRECT so far (gaps between datasets included)."""
        self._lock = threading.Lock()
        self._local = threading.local()
        self._fds: dict[tuple[str, int], int] = {}
        self._direct_fds: dict[tuple[str, int], int | None] = {}
        self._residency: dict[str, Residency] = {}
        self._direct_io = direct_io
        self._nowait = _NOWAIT
        """RWF_NOWAIT for buffered reads, until the kernel refuses it (then a resident first page means
        the whole chunk is read buffered)."""
        self._direct: dict[str, bool] = {}
        """Per shard asked about: are its uncached chunks read with O_DIRECT (the file system allows it)?"""

    def direct(self, shard: str) -> bool:
        """Are the chunks of ``shard`` that the page cache lacks read with O_DIRECT? (Asked once per
        shard this rank reads: with thousands of ranks, no open of files it never reads.)"""
        with self._lock:
            known = self._direct.get(shard)
        if known is None:
            known = (self._direct_io and shard not in self.sources and shard not in self.streams
                     and shard not in self.held
                     and self._can_direct(shard))
            with self._lock:
                known = self._direct.setdefault(shard, known)
        return known

    def close(self) -> None:
        with self._lock:
            for stream in self.streams.values():
                stream.close()
            for fd in [*self._fds.values(), *self._direct_fds.values()]:
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            self._direct_fds.clear()
            for residency in self._residency.values():
                residency.close()
            self._residency.clear()

    def fd(self, shard: str) -> int:
        """One descriptor per shard and thread: the kernel keeps read-ahead state per open file, and
        each thread reads its own ascending run of offsets. Where the shard is read with O_DIRECT, this
        descriptor reads only what the page cache holds, so read-ahead is off on it (an RWF_NOWAIT read
        that runs into a missing page starts read-ahead there: with it off, only the rest of that step is
        read into the page cache, which the O_DIRECT read then reads again)."""
        key = (shard, threading.get_ident())
        advice = os.POSIX_FADV_RANDOM if self.direct(shard) else os.POSIX_FADV_SEQUENTIAL
        with self._lock:
            if key not in self._fds:
                fd = self._open(shard)
                os.posix_fadvise(fd, 0, 0, advice)
                self._fds[key] = fd
            return self._fds[key]

    def _open(self, shard: str) -> int:
        """A read-only descriptor of ``shard``'s file. A memory-tier copy that is gone (another rank of
        the node found it bad and dropped it after this restore checked it) is a bad copy too: raised
        as ``CheckpointCorrupt``, so the restore reads the step from the file system instead."""
        try:
            return os.open(self._file(shard), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if shard not in self.sources:
                raise
            raise CheckpointCorrupt(f"checkpoint: step-{self.manifest.step}: {shard}.h5's copy in memory "
                                    f"{self.sources[shard]}: {e.strerror}") from e

    def _file(self, shard: str) -> Path:
        if shard in self.sources:
            return self.sources[shard]
        return self.path / str(self.manifest.shards[shard].file)

    def _can_direct(self, shard: str) -> bool:
        if self.manifest.shards[shard].file is None:
            return False
        try:
            fd = open_direct(self._file(shard))
        except OSError:
            return False   # the buffered open names the problem
        if fd is None:
            return False
        os.close(fd)
        return True

    def _direct_fd(self, shard: str) -> int | None:
        """This thread's O_DIRECT descriptor for ``shard``, None when direct reads are off for it."""
        if not self.direct(shard):
            return None
        key = (shard, threading.get_ident())
        with self._lock:
            if key not in self._direct_fds:
                self._direct_fds[key] = open_direct(self._file(shard))
            return self._direct_fds[key]

    def _pages(self, shard: str, lo: int, hi: int) -> Pages:
        with self._lock:
            residency = self._residency.get(shard)
            if residency is None:
                fd = os.open(self._file(shard), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    residency = Residency(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                self._residency[shard] = residency
        return residency.pages(lo, hi)

    def read_run(self, run: list[Job], *, stop: Callable[[], bool]) -> bool:
        """Read adjoining pieces chunk by chunk (large requests, ascending: what the disk and read-ahead
        like best), checksum each chunk as it lands, then check each piece's whole checksum (a mismatch
        raises CheckpointCorrupt). False when ``stop()`` said to stop before the end.

        Where direct reads are on, a chunk whose first page the page cache holds is read buffered with
        ``RWF_NOWAIT``: the kernel copies what it holds and stops at the first page it lacks, from where
        the rest of the chunk is read with ``O_DIRECT``. So a warm restore asks nothing about residency
        beyond one page per chunk (``mincore`` of a whole file walks every page: 2 % of the warm time)."""
        if not run:
            return True
        shard = run[0].piece.shard
        if shard in self.held:
            return self._read_held(shard, run, stop)
        sums = [xxhash.xxh3_64() for _ in run]
        if shard in self.sources:
            return self._read_memory(shard, run, sums, stop) and self._check(run, sums)
        at, end = run[0].piece.offset, run[-1].piece.offset + run[-1].piece.nbytes
        first = 0   # the first job not read to its end yet
        direct = self.direct(shard)
        while at < end and run[0].piece.nbytes:
            hi = min(end, at + _CHUNK)
            if stop():
                return False
            upto = at
            if not direct or self._resident(shard, at):
                upto = self._read_cached(shard, run, first, at, hi, sums, partial=direct)
            cached = upto - at
            if upto < hi and not self._read_direct(shard, run, first, upto, hi, sums):
                self._read_cached(shard, run, first, upto, hi, sums, partial=False)
                cached = hi - at
            with self._lock:
                self.read_bytes["buffered"] += cached
                self.read_bytes["direct"] += hi - at - cached
            while first < len(run) and run[first].piece.offset + run[first].piece.nbytes <= hi:
                first += 1
            at = hi
        return self._check(run, sums)

    def _check(self, run: list[Job], sums: list[xxhash.xxh3_64]) -> bool:
        for job, digest in zip(run, sums, strict=True):
            if digest.hexdigest() != job.piece.xxh3:
                raise CheckpointCorrupt(f"checkpoint: step-{self.manifest.step}: checksum mismatch in {job.where} "
                                        f"({job.piece.shard}.h5)")
        return True

    def read_stream(self, shard: str, job: Job) -> None:
        """The next piece this rank needs of a streamed shard (pieces asked in ascending offsets): the
        bytes before it (metadata, pieces of other ranks) into a scratch buffer, then the piece straight
        into its memory a step at a time, each step checksummed right after it lands (one pass: no copy
        of the shard kept anywhere), then its whole xxh3 checked against the manifest. A short stream, a
        broken connection or a mismatch raises ``CheckpointCorrupt``: the restore reads the file system."""
        stream = self.streams[shard]
        off, n = job.piece.offset, job.piece.nbytes
        where = f"step-{self.manifest.step}: {shard}.h5's copy from {stream.node}'s memory"
        if off < stream.at or off + n > stream.size:
            raise CheckpointCorrupt(f"checkpoint: {where}: {job.where} at {off}+{n} is outside what is left "
                                    f"of its {stream.size} bytes (from {stream.at})")
        digest = xxhash.xxh3_64()
        try:
            while stream.at < off:
                skip = self._gap(min(off - stream.at, STREAM_STEP))
                if stream.recv_into(skip) < len(skip):
                    raise CheckpointCorrupt(f"checkpoint: {where}: it ended at {stream.at} of {stream.size} "
                                            f"bytes, before {job.where}")
            buf = job.buf
            for a in range(0, n, STREAM_STEP):
                view = buf[a:min(n, a + STREAM_STEP)]
                if stream.recv_into(view) < len(view):
                    raise CheckpointCorrupt(f"checkpoint: {where}: it ended at {stream.at} of {stream.size} "
                                            f"bytes, inside {job.where}")
                digest.update(view)   # just received: still in the CPU cache
        except OSError as e:   # a broken connection, a peer silent past the timeout
            raise CheckpointCorrupt(f"checkpoint: {where}: {e}, inside {job.where}") from e
        if digest.hexdigest() != job.piece.xxh3:
            raise CheckpointCorrupt(f"checkpoint: step-{self.manifest.step}: checksum mismatch in {job.where} "
                                    f"({shard}.h5 from {stream.node}'s memory)")
        with self._lock:
            self.read_bytes["peer"] = self.read_bytes.get("peer", 0) + n

    def _read_memory(self, shard: str, run: list[Job], sums: list[xxhash.xxh3_64], stop: Callable[[], bool]) -> bool:
        """A shard in memory (the memory tier's copy on a tmpfs): each I/O thread reads its steps with
        buffered ``preadv`` on its own descriptor straight into the pieces, each step checksummed right
        after it lands. The kernel copies from the tmpfs pages it finds by index, no page tables, and
        without the GIL, so the I/O threads copy at once. (A mapping of the copy cost as much to set up
        as the copy with 4 KiB pages; with huge pages it was cheap, but the copy out of it, a memoryview
        assignment, holds the GIL: on a huge=within_size tmpfs, 1 GiB, it gave 0.42 x a memcpy's wall time
        and 0.72 of its CPU against 0.62 and 0.83 with preadv.) Steps of ``_MEM_STEP``: no disk to keep
        busy, fewer calls, and still in a core's L2 cache when the checksum reads them."""
        at, end = run[0].piece.offset, run[-1].piece.offset + run[-1].piece.nbytes
        while at < end and run[0].piece.nbytes:
            if stop():
                return False
            hi = min(end, at + _CHUNK)
            first = next(k for k, j in enumerate(run) if j.piece.offset + j.piece.nbytes > at)
            at = self._read_cached(shard, run, first, at, hi, sums, partial=False, step=_MEM_STEP)
        with self._lock:
            self.read_bytes["memory"] = self.read_bytes.get("memory", 0) + end - run[0].piece.offset
        return True

    def _read_held(self, shard: str, run: list[Job], stop: Callable[[], bool]) -> bool:
        """A shard in the node keeper's memory: each piece with ``process_vm_readv`` straight into its
        memory, a step at a time, each step checksummed right after it lands, then the piece's whole
        xxh3 checked (``held.read_hashed``: one call of the C loop a piece, no GIL held while it copies
        and hashes, so the I/O threads work at once). A keeper gone (ESRCH), access refused (EPERM) or
        a range it no longer maps is a bad copy: ``CheckpointCorrupt``, the restore reads the files."""
        copy = self.held[shard]
        total = 0
        for job in run:
            if stop():
                return False
            off, n = job.piece.offset, job.piece.nbytes
            try:
                if off + n > copy.size:
                    raise OSError(errno.EFAULT, f"{off}+{n} is outside the copy's {copy.size} bytes")
                digest = read_hashed(copy.pid, copy.addr + off, job.buf)
            except OSError as e:
                raise CheckpointCorrupt(f"checkpoint: step-{self.manifest.step}: {shard}.h5's copy in the "
                                        f"keeper's memory: {e.strerror or e}, inside {job.where}") from e
            if digest != job.piece.xxh3:
                raise CheckpointCorrupt(f"checkpoint: step-{self.manifest.step}: checksum mismatch in {job.where} "
                                        f"({shard}.h5)")
            total += n
        with self._lock:
            self.read_bytes["memory"] = self.read_bytes.get("memory", 0) + total
        return True

    def _resident(self, shard: str, at: int) -> bool:
        """Does the page cache hold the page at ``at``? (True when it cannot say.)"""
        return self._pages(shard, at, at + 1).cached(at, at + 1)

    def _read_cached(self, shard: str, run: list[Job], first: int, lo: int, hi: int,
                     sums: list[xxhash.xxh3_64], *, partial: bool, step: int = _STEP) -> int:
        """``[lo, hi)`` of the file with buffered ``preadv`` calls straight into the pieces' memory, a
        step of one piece at a time (the metadata before a piece goes to a scratch buffer in the same
        call), each step checksummed right after it lands, while the core's L2 cache still holds it.
        With ``partial``, only what the page cache already holds (``RWF_NOWAIT``): returns where it
        stopped, ``hi`` when it read everything. (This loop is the warm restore's Python: a few
        operations per step, a step of ``_STEP`` bytes.)"""
        fd = self.fd(shard)
        flags = _NOWAIT if partial and self._nowait else 0
        at, k = lo, first
        while at < hi:
            job = run[k]
            off = job.piece.offset
            if off + job.piece.nbytes <= at:
                k += 1
                continue
            pre = off - at if off > at else 0   # metadata between the pieces
            s = at + pre - off
            e = min(hi, off + job.piece.nbytes, at + pre + step) - off
            if e <= s:   # the range ends in the metadata before this piece
                pre, e = hi - at, s
            view = job.buf[s:e]
            try:
                n = os.preadv(fd, [self._gap(pre), view] if pre else [view], at, flags)
            except BlockingIOError:
                return at   # the page at ``at`` is not in the page cache
            except OSError as err:
                if not flags or err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                self._nowait = flags = 0   # this kernel or file system has no RWF_NOWAIT for buffered reads
                continue
            if n <= 0:
                raise _truncated(run, at, self.manifest.step)
            got = n - pre
            if got > 0:
                sums[k].update(view if got == e - s else view[:got])   # just written: still in the CPU cache
            at += n
            if flags and n < pre + e - s:
                return at   # the page cache holds nothing more from here (or the file ends: the rest says)
        return at

    def _read_direct(self, shard: str, run: list[Job], first: int, lo: int, hi: int,
                     sums: list[xxhash.xxh3_64]) -> bool:
        """``[lo, hi)`` with ``O_DIRECT`` into this thread's aligned buffer, copied into the pieces and
        checksummed step by step; False (nothing read) when the file system refuses it: the buffered
        read does it then."""
        fd = self._direct_fd(shard)
        if fd is None:
            return False
        start = align_down(lo)
        want = align_up(hi) - start
        bounce = self._bounce(want)
        got = 0
        try:
            while start + got < hi:
                n = os.preadv(fd, [bounce.view[got:want]], start + got)
                if n <= 0:
                    raise _truncated(run, start + got, self.manifest.step)
                got += n
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            log.info("checkpoint: %s refused an O_DIRECT read (%s); reading it through the page cache",
                     self._file(shard), err.strerror)
            with self._lock:
                self._direct[shard] = False
            return False
        for k, s, e in _overlaps(run, first, lo, hi):
            buf, src = run[k].buf, run[k].piece.offset - start
            for a in range(s, e, _STEP):
                b = min(e, a + _STEP)
                # a memcpy; torch's copy_ would fan a step out to its intra-op threads (slow when busy)
                buf[a:b] = bounce.view[src + a:src + b]
                sums[k].update(buf[a:b])   # the copy just wrote it: still in the CPU cache
        return True

    def _bounce(self, nbytes: int) -> Bounce:
        buf: Bounce | None = getattr(self._local, "bounce", None)
        if buf is None or len(buf.view) < nbytes:
            buf = Bounce(max(nbytes, _CHUNK + 2 * ALIGN))
            self._local.bounce = buf
        return buf

    def _gap(self, nbytes: int) -> memoryview:
        gap: bytearray | None = getattr(self._local, "gap", None)
        if gap is None or len(gap) < nbytes:
            gap = bytearray(max(nbytes, MAX_GAP))
            self._local.gap = gap
        return memoryview(gap)[:nbytes]


def _truncated(run: list[Job], at: int, step: int) -> CheckpointCorrupt:
    """The read came back short at file offset ``at``: name the tensor the file ends in."""
    job = next((j for j in run if at < j.piece.offset + j.piece.nbytes), run[-1])
    return CheckpointCorrupt(f"checkpoint: step-{step}: {job.piece.shard}.h5 is truncated inside {job.where}")


def _overlaps(run: list[Job], first: int, lo: int, hi: int) -> Iterable[tuple[int, int, int]]:
    """(job index, start, end) of the bytes of each job in ``run[first:]`` inside file range ``[lo, hi)``,
    relative to the job's own start."""
    for k in range(first, len(run)):
        piece = run[k].piece
        if piece.offset >= hi:
            return
        s, e = max(lo, piece.offset) - piece.offset, min(hi, piece.offset + piece.nbytes) - piece.offset
        if e > s:
            yield k, s, e
