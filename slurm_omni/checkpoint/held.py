"""The memory tier's copies held in the node keeper's anonymous memory, read by a restarted rank with
``process_vm_readv`` straight into its tensors.

Why not a file on /dev/shm: where the tmpfs gives 4 KiB pages (``shmem_enabled`` = never, and a tmpfs
mounted ``huge=`` needs root), reading a copy from it costs 0.62-0.71 x a memcpy of the same bytes
here, whatever the reader does; ``process_vm_readv`` from anonymous memory with transparent huge pages
(``MADV_HUGEPAGE``, allowed where THP is ``madvise``) cost 1.07 x (512 MiB, medians of 7).

Who holds what: the node's keeper (``peer.Keeper``, a child of the standby server: it outlives every
trainer of the job) keeps, per shard, the newest ``keep`` steps in buffers it reuses (no fresh page
faults or zeroing per step). A rank's persist thread asks it over a Unix socket in the job's 0700
tmpfs folder (``formats/memtier_keeper.py``; the keeper checks the caller's uid too) to ``hold`` the
shard file it just wrote; the keeper copies it (preadv from the page cache), checks the root's fence
(``fence.py``) before and after, and only then makes it visible under the copy's name, which carries
the incarnation that wrote it. A restore asks ``where`` its shards are, reads them with
``process_vm_readv`` and checks every tensor's xxh3 as it lands, as from a file: a copy the keeper
reused meanwhile, or a keeper gone, is a bad copy (``CheckpointCorrupt``): the restore reads the files.

Security: ``process_vm_readv`` needs the caller's uid to be the keeper's and ptrace access (the kernel
checks it: another user's process can read nothing). Under Yama ``ptrace_scope`` 1 only a process's
ancestors may, and the ranks are the keeper's siblings: the keeper names any process as its tracer
(``PR_SET_PTRACER_ANY``), which leaves the uid check in force. Where access is still refused (scope 2
or 3, EPERM), the publishing rank finds it at its first copy and keeps its copies as tmpfs files, as
before this module, with one line. A process's anonymous memory ends with it: nothing of the job stays
on the node after the keeper ends, even where the standby could not clean up.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from slurm_omni.checkpoint.format import safe_name
from slurm_omni.formats import RecordRejected, decode, encode
from slurm_omni.formats.memtier_keeper import MAX_RECORD_BYTES, HeldCopyRecord, HoldReply, HoldRequest

log = logging.getLogger(__name__)

def socket_path(folder: Path, node: str) -> Path:
    """The keeper's Unix socket in the job's folder of the memory tier, named by its node (the embedded
    cluster's nodes share one /dev/shm)."""
    return folder / (f"keeper.{safe_name(node)}.sock" if node else "keeper.sock")
HUGE = 2 << 20
_COPY = 64 << 20
_TIMEOUT_S = 60.0
_MADV_POPULATE_WRITE = 23   # Linux 5.14: faults the pages in now, ENOMEM instead of a later SIGBUS or OOM kill
_PR_SET_PTRACER = 0x59616d61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_readv.restype = ctypes.c_ssize_t
        libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                          ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


HERE = 0
"""A ``HeldCopy``'s pid where the copy is this process's own memory: inherited from the standby that
holds it and forked this process (``hold_here``), read in place (the C loop's one pass)."""


class KeeperUnreachable(OSError):
    """No keeper answers on this node (none runs, or it is gone)."""


@dataclass(frozen=True, slots=True)
class HeldCopy:
    """A shard copy in the keeper's memory: ``size`` bytes at ``addr`` in process ``pid`` (``HERE``: in
    this process, inherited)."""

    name: str
    pid: int
    addr: int
    size: int

    def read_into(self, offset: int, view: memoryview) -> None:
        """``len(view)`` bytes of the copy from ``offset`` into ``view`` (writable, contiguous); OSError
        when the keeper is gone (ESRCH), refuses access (EPERM) or the range is not its copy's."""
        n = len(view)
        if offset < 0 or offset + n > self.size:
            raise OSError(errno.EFAULT, f"{offset}+{n} is outside the copy's {self.size} bytes")
        if n == 0:
            return
        at = ctypes.addressof(ctypes.c_char.from_buffer(view))
        read_remote(self.pid, self.addr + offset, at, n)


def read_remote(pid: int, remote: int, local: int, n: int) -> None:
    """``n`` bytes at ``remote`` in process ``pid`` to ``local`` in this one (``process_vm_readv``, again
    after a short read; each thread reuses its two iovecs). ``HERE``: this process."""
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "no process_vm_readv here")
    pid = pid or os.getpid()
    mine, theirs, p_mine, p_theirs = _vecs()
    done = 0
    while done < n:
        mine.base, mine.len = local + done, n - done
        theirs.base, theirs.len = remote + done, n - done
        got = _LIBC.process_vm_readv(pid, p_mine, 1, p_theirs, 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from the keeper (pid {pid}): {os.strerror(code)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from the keeper (pid {pid}) read nothing")
        done += got


_THREAD = threading.local()

READ_STEP = 1 << 20
"""Bytes per ``process_vm_readv`` of a restore, each hashed right after it lands: the L2 cache of one
core here (AMD EPYC, 1 MiB a core), so the xxh3 reads the step from L2, not L3. 1 GiB in 400 tensors,
2 I/O threads, paired rounds (2026-12-02, 16:25, machine idle by vmstat): 0.137-0.147 CPU s a restore
against 0.146-0.158 with 2 MiB steps (one huge page of the keeper's), 0.074-0.077 s wall against
0.084-0.085; 512 KiB steps cost more again (more calls, GIL hand-overs and loop turns: 0.140 against
0.132 with 2 MiB in that run)."""


def read_checked(pid: int, remote: int, view: memoryview, update: Callable[[memoryview], object],
                 step: int = READ_STEP) -> None:
    """``len(view)`` bytes at ``remote`` in process ``pid`` into ``view`` (writable, contiguous), a step
    at a time, each step handed to ``update`` (a checksum) right after it lands, while the core's cache
    holds it. The loop calls libc itself: it runs once per step of every restored byte."""
    n = len(view)
    if n == 0:
        return
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "no process_vm_readv here")
    local = ctypes.addressof(ctypes.c_char.from_buffer(view))
    mine, theirs, p_mine, p_theirs = _vecs()
    call = _LIBC.process_vm_readv
    pid = pid or os.getpid()
    a = 0
    while a < n:
        b = min(n, a + step)
        mine.base, mine.len = local + a, b - a
        theirs.base, theirs.len = remote + a, b - a
        got = call(pid, p_mine, 1, p_theirs, 1, 0)
        if got != b - a:   # an error, or a short read: the careful loop says which
            read_remote(pid, remote + a + max(got, 0), local + a + max(got, 0), b - a - max(got, 0))
        update(view[a:b])
        a = b


def read_hashed(pid: int, remote: int, view: memoryview, step: int = READ_STEP) -> str:
    """``len(view)`` bytes at ``remote`` in process ``pid`` into ``view`` (writable, contiguous), each step
    hashed right after it lands; the hex XXH3-64 of them all (``xxhash.xxh3_64().hexdigest()``'s). In
    one call of the C loop (``held_native``: no GIL held for the whole range) where it is built, else
    with ``read_checked`` (one line says so, once). OSError as ``read_remote``'s."""
    n = len(view)
    lib = _native()
    if lib is None or n == 0:
        import xxhash

        digest = xxhash.xxh3_64()
        read_checked(pid, remote, view, digest.update, step)
        return digest.hexdigest()
    out = getattr(_THREAD, "out", None)
    if out is None:
        out = _THREAD.out = (ctypes.c_uint64(), ctypes.c_size_t())
    local = ctypes.addressof(ctypes.c_char.from_buffer(view))
    code = lib.omni_read_hashed(pid, remote, local, n, step, ctypes.byref(out[0]), ctypes.byref(out[1]))
    if code:
        raise OSError(code, f"process_vm_readv from the keeper (pid {pid}): {os.strerror(code)}")
    return f"{out[0].value:016x}"


class BatchPiece(ctypes.Structure):
    """One piece of a restore's plan, as ``csrc/held_read.c``'s ``struct omni_piece``: ``len`` bytes at
    ``remote`` in keeper ``pid`` to ``local`` here, whose XXH3-64 must be ``want``."""

    _fields_ = [("remote", ctypes.c_uint64), ("local", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("want", ctypes.c_uint64), ("pid", ctypes.c_int64)]


MISMATCH = -1
"""``read_batch``'s status of a piece whose XXH3-64 is not the one given."""
NOT_READ = -2
"""``read_batch``'s status of a piece not read: another piece failed first."""


class PlanState(ctypes.Structure):
    """What the threads reading one plan share, as ``csrc/held_read.c``'s ``struct omni_plan``."""

    _fields_ = [("ready", ctypes.c_uint32), ("stop", ctypes.c_int32), ("next", ctypes.c_uint64)]


def batch_loop() -> bool:
    """Can ``Plan`` (and ``read_batch``) run here (the C loop is built)?"""
    return _native() is not None


class Plan:
    """A restore's pieces from the keeper's memory, read and checked by ``threads`` threads at once
    while the restoring thread still adds them: ``threads - 1`` of ``helpers`` start at once and wait
    (in C, on a futex, with the GIL released) for each piece they claim to be published; ``run`` adds
    the restoring thread and returns each piece's status. The copying starts with the first unit
    planned, and no thread takes the GIL between two pieces. Needs the C loop (``batch_loop()``).

    Per piece: 0 (read, its XXH3-64 is ``want``), ``MISMATCH``, ``NOT_READ`` (a failure stopped the
    reads) or the read's errno. Used as a context manager: leaving it early (an error while planning)
    stops the helpers before the pieces' memory can go."""

    def __init__(self, capacity: int, *, threads: int, helpers: Executor | None, step: int = READ_STEP) -> None:
        lib = _native()
        if lib is None:
            raise OSError(errno.ENOSYS, "the C restore loop is not built")
        self._lib = lib
        self.capacity = capacity
        self.count = 0
        self._pieces = (BatchPiece * max(1, capacity))()
        self._status = (ctypes.c_int32 * max(1, capacity))(*([NOT_READ] * max(1, capacity)))
        self._state = PlanState()
        self._args = (self._pieces, ctypes.byref(self._state), step, self._status)
        self._helpers = [helpers.submit(lib.omni_read_plan, *self._args) for _ in range(threads - 1)] \
            if helpers is not None else []
        self._ended = False

    def add(self, remote: int, local: int, length: int, want: int, pid: int) -> None:
        """The next piece (see ``BatchPiece``); read once published."""
        if self.count >= self.capacity:
            raise IndexError(f"a plan of {self.capacity} pieces is full")
        piece = self._pieces[self.count]
        piece.remote, piece.local, piece.len, piece.want, piece.pid = remote, local, length, want, pid
        self.count += 1

    def publish(self) -> None:
        """Let the helpers read the pieces added so far."""
        self._lib.omni_plan_publish(ctypes.byref(self._state), self.count, 0, 0)

    def run(self) -> list[int]:
        """No more pieces: read what is left on this thread too, wait for the helpers; each piece's status."""
        self._lib.omni_plan_publish(ctypes.byref(self._state), self.count, 1, 0)
        try:
            self._lib.omni_read_plan(*self._args)
        finally:
            self._end(stop=False)
        return list(self._status[:self.count])

    def _end(self, *, stop: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if stop:
            self._lib.omni_plan_publish(ctypes.byref(self._state), self.count, 1, 1)
        for f in self._helpers:
            f.result()   # the pieces and their memory stay alive until every thread is out of the loop

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end(stop=True)


def read_batch(pieces: list[tuple[int, int, int, int, int]], *, threads: int, helpers: Executor | None,
               step: int = READ_STEP) -> list[int]:
    """Every piece (remote, local, length, want, pid: see ``BatchPiece``) read and checked by ``threads``
    threads at once, all planned before (``Plan`` for the statuses)."""
    with Plan(len(pieces), threads=threads, helpers=helpers, step=step) as plan:
        for piece in pieces:
            plan.add(*piece)
        return plan.run()


_NATIVE: list[Any] = []
"""The C loop's library once looked for (``[lib]``; ``[None]`` where it is not built)."""
_NATIVE_LOCK = threading.Lock()


def loop_name() -> str:
    """Which loop ``read_hashed`` runs here (the bench's line)."""
    from slurm_omni.checkpoint import held_native

    return held_native.describe(_native())


def _native() -> ctypes.CDLL | None:
    if not _NATIVE:
        with _NATIVE_LOCK:
            if not _NATIVE:
                from slurm_omni.checkpoint import held_native

                found, why = held_native.load()
                if found is None:
                    log.warning("checkpoint: the C restore loop from the keeper's memory is %s: reading "
                                "with the Python loop (slower)", why)
                _NATIVE.append(found)
    lib: ctypes.CDLL | None = _NATIVE[0]
    return lib


def _vecs() -> tuple[_IoVec, _IoVec, Any, Any]:
    """This thread's two iovecs and pointers to them (made once a thread)."""
    vecs = getattr(_THREAD, "vecs", None)
    if vecs is None:
        mine, theirs = _IoVec(), _IoVec()
        vecs = _THREAD.vecs = (mine, theirs, ctypes.pointer(mine), ctypes.pointer(theirs))
    return vecs


def allow_readers() -> None:
    """Let any process ptrace-read this one where Yama restricts it to ancestors (the kernel still
    requires the reader's uid to be ours); nothing where Yama is absent."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


class _Buffer:
    """Anonymous memory of at least ``size`` bytes, on transparent huge pages where the kernel gives them
    (``MADV_HUGEPAGE``), faulted in at once so that an allocation that cannot be met fails here.
    ``inherit``: the processes this one forks inherit it (the holder's copies), else ``MADV_DONTFORK``;
    not inherited either where the kernel gave it mostly 4 KiB pages (a fragmented node): a fork would
    copy an entry per 4 KiB of it (``inherit`` says which it is)."""

    def __init__(self, size: int, *, inherit: bool = False) -> None:
        self.capacity = -(-max(size, 1) // HUGE) * HUGE
        self._map = mmap.mmap(-1, self.capacity + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _BUFFERS.add(self)   # before its pages are faulted in: a child forked from here on drops it
        try:
            if not inherit and hasattr(mmap, "MADV_DONTFORK"):
                self._map.madvise(mmap.MADV_DONTFORK)   # no page table of it copied at a fork
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            self.skip = -base % HUGE   # THP needs 2 MiB-aligned ranges
            self.addr = base + self.skip
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE)
            self.inherit = inherit
            try:
                self._map.madvise(_MADV_POPULATE_WRITE, self.skip, self.capacity)
                if inherit and huge_bytes(self.addr, self.addr + self.capacity) < self.capacity // 2:
                    self._map.madvise(mmap.MADV_DONTFORK)
                    self.inherit = False
            except OSError as e:
                if e.errno in (errno.ENOMEM, errno.EFAULT, errno.EAGAIN):
                    raise
                # older kernels: EINVAL; the pages fault in as the copy writes them
        except BaseException:
            self._map.close()
            raise

    def view(self, size: int) -> memoryview:
        return memoryview(self._map)[self.skip:self.skip + size]

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:   # a view still exported: the memory goes with the process
            pass

    def drop(self) -> None:
        """This process's pages of the buffer gone (``MADV_DONTNEED``: a process forked by its holder
        stops sharing them, so the holder's next write into them copies nothing), then unmapped."""
        try:
            self._map.madvise(mmap.MADV_DONTNEED)
        except ValueError:   # closed already
            return
        except OSError:   # not mapped here (MADV_DONTFORK): closed all the same, or its munmap, when the
            pass          # object goes, would unmap whatever this process maps there by then
        self.close()


@dataclass(slots=True)
class _Held:
    buffer: _Buffer
    size: int
    step: int
    shard: str
    number: int | None
    """The incarnation number that published it: no older incarnation retires or replaces it."""


class HeldStore:
    """The keeper's side: the copies it holds for the ranks of its node."""

    def __init__(self, job: str, *, parse: Callable[[str], tuple[int, str] | None],
                 fenced: Callable[[int | None], int | None], room: Callable[[int], str], keep: int = 2) -> None:
        """``parse``: a copy's name as (step, shard), None for others; ``fenced``: the incarnation that
        fenced ``number`` out, else None; ``room``: why ``n`` more bytes do not fit ("" when they do)."""
        self.job, self.keep = job, keep
        self._parse, self._fenced, self._room = parse, fenced, room
        self._lock = threading.Lock()
        self._copies: dict[str, _Held] = {}
        self._spare: dict[str, _Buffer] = {}
        """Per shard, a buffer whose copy was retired: the next step of that shard is copied into it."""
        self.owner = os.getpid()
        self.inherit = False
        """The processes this one forks inherit the copies (``hold_here``)."""

    def used(self) -> int:
        with self._lock:
            return sum(h.buffer.capacity for h in self._copies.values()) + \
                sum(b.capacity for b in self._spare.values())

    def where(self, names: list[str]) -> list[HeldCopyRecord]:
        """The held copies among ``names`` (all of them for none)."""
        with self._lock:
            return [HeldCopyRecord(name=n, size=self._copies[n].size, addr=self._copies[n].buffer.addr)
                    for n in (names or list(self._copies)) if n in self._copies]

    def drop(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                held = self._copies.pop(name, None)
                if held is not None:
                    self._give_back(held.shard, held.buffer)

    def get(self, name: str) -> memoryview | None:
        """The held bytes of ``name`` (the keeper serving a peer), None when it holds none."""
        with self._lock:
            held = self._copies.get(name)
            return held.buffer.view(held.size) if held is not None else None

    def close(self) -> None:
        with self._lock:
            for held in self._copies.values():
                held.buffer.close()
            for buf in self._spare.values():
                buf.close()
            self._copies.clear()
            self._spare.clear()

    def hold(self, req: HoldRequest) -> HoldReply:
        """Copy ``req.source`` into this process's memory as ``req.names[0]``, visible once the fence
        still admits ``req.number`` after the copy."""
        name = req.names[0] if len(req.names) == 1 else ""
        parsed = self._parse(name)
        if req.job != self.job or parsed is None:
            return HoldReply(ok=False, refused="source", error=f"not a shard copy of job {self.job}: {name!r}")
        step, shard = parsed
        newer = self._fenced(req.number)
        if newer is not None:
            return HoldReply(ok=False, refused="fenced", error=f"incarnation {newer} started since")
        try:
            fd = os.open(req.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return HoldReply(ok=False, refused="source", error=f"{req.source}: {e.strerror}")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return HoldReply(ok=False, refused="source", error=f"{req.source}: not a regular file of ours")
            size = st.st_size
            buffer, refused = self._buffer(shard, step, size, req.number)
            if buffer is None:
                return refused
            try:
                _copy_in(fd, buffer.view(size), size)
            except BaseException:
                with self._lock:
                    self._give_back(shard, buffer)
                raise
        finally:
            os.close(fd)
        newer = self._fenced(req.number)
        with self._lock:
            if newer is not None:
                self._give_back(shard, buffer)
                return HoldReply(ok=False, refused="fenced", error=f"incarnation {newer} started since")
            for other in [n for n, h in self._copies.items()
                          if h.shard == shard and h.step == step and not _newer(h.number, req.number)]:
                self._give_back(shard, self._copies.pop(other).buffer)   # the step from another incarnation
            if name in self._copies:   # a newer incarnation's copy of this name (names carry incarnations)
                self._give_back(shard, buffer)
                return HoldReply(ok=False, refused="fenced", error=f"a newer incarnation's copy of {name} is held")
            self._copies[name] = _Held(buffer, size, step, shard, req.number)
            return HoldReply(ok=True, pid=os.getpid(), copies=[HeldCopyRecord(name=name, size=size, addr=buffer.addr)])

    def _buffer(self, shard: str, step: int, size: int, number: int | None) -> tuple[_Buffer | None, HoldReply]:
        """A buffer for a new copy of ``shard`` (room made first: its copies but the ``keep - 1`` newest
        older steps retired, their buffers reused; never a copy of a newer incarnation than ``number``'s,
        whatever the race between the fence and this request)."""
        with self._lock:
            mine = sorted(((h.step, n) for n, h in self._copies.items()
                           if h.shard == shard and h.step < step and not _newer(h.number, number)), reverse=True)
            for _, old in mine[self.keep - 1:]:
                self._give_back(shard, self._copies.pop(old).buffer)
            spare = self._spare.pop(shard, None)
            if spare is not None and spare.capacity >= size:
                return spare, HoldReply(ok=True)
            if spare is not None:
                spare.close()
        problem = self._room(-(-max(size, 1) // HUGE) * HUGE)   # it asks ``used()``: outside the lock
        if problem:
            return None, HoldReply(ok=False, refused="cap", error=problem)
        try:
            return _Buffer(size, inherit=self.inherit), HoldReply(ok=True)
        except OSError as e:
            return None, HoldReply(ok=False, refused="full", error=f"couldn't allocate {size / 2**30:.2f} GiB: "
                                                                   f"{e.strerror}")

    def _give_back(self, shard: str, buffer: _Buffer) -> None:
        """Keep one spare buffer per shard for its next step; free the rest (called with the lock)."""
        if shard in self._spare:
            buffer.close()
        else:
            self._spare[shard] = buffer

    def _forked(self) -> _Inherited:
        """In a process just forked by the store's holder: the copies complete at the fork (the holder
        held the lock across it), which it keeps to read."""
        self._lock = threading.Lock()
        mine = {name: h for name, h in self._copies.items() if h.buffer.inherit}
        return _Inherited(self.job, {name: HeldCopyRecord(name=name, size=h.size, addr=h.buffer.addr)
                                     for name, h in mine.items()}, [h.buffer for h in mine.values()])


def _newer(held: int | None, asking: int | None) -> bool:
    """Was a copy published by a newer incarnation than the one asking? (Unnumbered: unfenced, never.)"""
    return held is not None and asking is not None and held > asking


def _copy_in(fd: int, view: memoryview, size: int) -> None:
    at = 0
    try:
        while at < size:
            n = os.preadv(fd, [view[at:min(size, at + _COPY)]], at)
            if n <= 0:
                raise OSError(errno.EIO, f"the shard file ended at {at} of {size} bytes")
            at += n
    finally:
        view.release()


# -- the holder's copies in the trainers it forks ---------------------------------------------------------

@dataclass(slots=True)
class _Inherited:
    """What a trainer forked by the holder found of its store: the copies complete at the fork, at the
    same addresses in its own memory, and their buffers (to drop once read)."""

    job: str
    copies: dict[str, HeldCopyRecord]
    buffers: list[_Buffer]


_BUFFERS: weakref.WeakSet[_Buffer] = weakref.WeakSet()
"""Every buffer of this process: a child forked from it drops all but the copies it inherits to read."""
_HOLDERS: list[tuple[HeldStore, HeldServer | None]] = []
"""The stores this process holds for the processes it forks (``hold_here``)."""
_INHERITED: dict[str, _Inherited] = {}
"""By job: the copies this process inherited from the holder that forked it, until released."""
_READERS = [0]
"""Restores reading inherited copies now: the copies are released when the last one ends."""
_FORK_STATE = threading.Lock()


def hold_here(store: HeldStore, server: HeldServer | None = None) -> None:
    """Make this process the holder of ``store``'s copies for the processes it forks (the standby
    server forks every trainer of its node). A trainer it forks finds the copies that were complete at
    the fork at the same addresses in its own memory (fork shares their private huge pages, no fault
    on read): its restore reads them with the one pass (``csrc/held_read.c``), no question to the
    keeper and no ``process_vm_readv``. Whatever else of the store it inherits (spare buffers, a copy
    half-written, the keeper's sockets) it drops at once, and the copies once its restore ended
    (``release_inherited``): the holder's next write into them then copies nothing. The store's lock
    is held across the fork, so the table the trainer sees is one the holder had."""
    with _FORK_STATE:
        store.inherit = True
        _HOLDERS.append((store, server))


def _before_fork() -> None:
    for store, _ in _HOLDERS:
        if store.owner == os.getpid():
            store._lock.acquire()


def _after_fork_parent() -> None:
    for store, _ in _HOLDERS:
        if store.owner == os.getpid():
            store._lock.release()


def _after_fork_child() -> None:
    """In every process forked here: the copies of the stores this process held are the child's to
    read (it is a trainer the holder forked); every other buffer (spares, a copy being filled, what a
    trainer inherited itself, when the child is its data loader's worker) is dropped now."""
    global _FORK_STATE
    _FORK_STATE = threading.Lock()
    _READERS[0] = 0
    _INHERITED.clear()
    holders = list(_HOLDERS)
    _HOLDERS.clear()
    for store, server in holders:
        if server is not None:
            server.forget()
        _INHERITED[store.job] = store._forked()
    keep = {id(buf) for found in _INHERITED.values() for buf in found.buffers}
    for buf in list(_BUFFERS):
        if id(buf) not in keep:
            buf.drop()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes(lo: int, hi: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of this process's mappings over [lo, hi) on transparent huge pages (``AnonHugePages`` of the
    mappings that overlap it); 0 where it cannot be read."""
    total = 0
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    start, _, end = head.partition("-")
                    a, b = int(start, 16), int(end, 16)
                    if a >= hi:
                        break
                    inside = a < hi and b > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def huge_pages(path: Path = THP_ENABLED) -> bool:
    """Does the kernel give anonymous memory transparent huge pages where asked (``madvise`` or
    ``always``)? Where it does not, a fork copies a page-table entry per 4 KiB of every copy held (11 ms
    per GiB here, and as much again for the child to drop them), so the holder lets no process inherit
    its copies (``peer.hold_copies``)."""
    try:
        return "[never]" not in path.read_text()
    except OSError:
        return False


def inherited(job: str) -> dict[str, HeldCopyRecord] | None:
    """The copies of ``job`` this process inherited from the holder that forked it (name: where they
    are in this process), None where it inherited none or released them."""
    with _FORK_STATE:
        found = _INHERITED.get(job)
        return dict(found.copies) if found is not None else None


def start_reading() -> bool:
    """A restore starts reading inherited copies (True), or there are none left (False)."""
    with _FORK_STATE:
        if not _INHERITED:
            return False
        _READERS[0] += 1
        return True


def release_inherited(*, reading: bool = False) -> None:
    """Drop every inherited copy (a restore is done, or the trainer saves its first step), unless a
    restore still reads them; ``reading``: the caller's restore is one of them, and has ended."""
    with _FORK_STATE:
        if reading:
            _READERS[0] = max(0, _READERS[0] - 1)
        if _READERS[0] or not _INHERITED:
            return
        released = list(_INHERITED.values())
        _INHERITED.clear()
    for left in released:
        for buf in left.buffers:
            buf.drop()


# -- the socket between a rank and its keeper -------------------------------------------------------------

def _send(sock: socket.socket, record: HoldRequest | HoldReply) -> None:
    body = encode(record)
    sock.sendall(struct.pack("!I", len(body)) + body)


def _recv(sock: socket.socket, kind: type[HoldRequest | HoldReply]) -> HoldRequest | HoldReply | None:
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (length,) = struct.unpack("!I", head)
    if length > MAX_RECORD_BYTES:
        raise ConnectionError(f"a {length}-byte record (at most {MAX_RECORD_BYTES})")
    body = _recv_exact(sock, length)
    if body is None:
        raise ConnectionError("the other side hung up inside a record")
    return decode(body, kind, "a keeper record")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            if buf:
                raise ConnectionError(f"the other side hung up after {len(buf)} of {n} bytes")
            return None
        buf += got
    return bytes(buf)


class HeldServer:
    """The keeper's Unix socket: answers the ranks of its node (same uid only) from ``store``."""

    def __init__(self, store: HeldStore, folder: Path, node: str = "") -> None:
        self.store = store
        self.path = socket_path(folder, node)
        try:
            os.unlink(self.path)   # a previous keeper's of this job on this node (it ended)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def start(self) -> threading.Thread:
        allow_readers()
        thread = threading.Thread(target=self._serve, daemon=True, name="omni-held-copies")
        thread.start()
        return thread

    def stop(self) -> None:
        self._stopped.set()
        with _FORK_STATE:   # the processes this one forks from now on inherit none of its copies
            _HOLDERS[:] = [(store, server) for store, server in _HOLDERS if server is not self]
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def forget(self) -> None:
        """In a process forked by the holder: close its copies of the sockets (only close: a shutdown
        would end the holder's too), so that nothing waits on a keeper that is gone."""
        self._stopped.set()
        self._conns_lock = threading.Lock()
        for sock in (self.sock, *self._conns):
            try:
                sock.close()
            except OSError:
                pass
        self._conns.clear()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_TIMEOUT_S)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.geteuid():
                log.warning("checkpoint: keeper refused a connection of uid %d on %s", uid, self.path)
                return
            while True:
                req = _recv(conn, HoldRequest)
                if not isinstance(req, HoldRequest):
                    return
                _send(conn, self._answer(req))
        except (OSError, ConnectionError, RecordRejected) as e:
            log.debug("checkpoint: keeper: a rank's connection failed: %s", e)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, req: HoldRequest) -> HoldReply:
        if req.job != self.store.job:
            return HoldReply(ok=False, error=f"this keeper holds job {self.store.job}, not {req.job}")
        if req.op == "hold":
            try:
                return self.store.hold(req)
            except OSError as e:
                return HoldReply(ok=False, refused="source", error=f"couldn't copy {req.source}: {e}")
        if req.op == "where":
            return HoldReply(ok=True, pid=os.getpid(), copies=self.store.where(req.names))
        if req.op == "drop":
            self.store.drop(req.names)
        return HoldReply(ok=True, pid=os.getpid(), used=self.store.used())


class KeeperClient:
    """A rank's side of its node's keeper socket (one connection, opened on first use)."""

    def __init__(self, folder: Path, job: str, node: str = "") -> None:
        self.path = socket_path(folder, node)
        self.job = job
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def ask(self, op: str, *, names: list[str] | None = None, source: str = "",
            number: int | None = None) -> HoldReply:
        """The keeper's answer; ``KeeperUnreachable`` when none answers."""
        req = HoldRequest(op=op, job=self.job, names=names or [], source=source, number=number)  # type: ignore[arg-type]
        with self._lock:
            for attempt in (0, 1):   # a keeper restarted since the last question: one new connection
                try:
                    sock = self._connect()
                    _send(sock, req)
                    reply = _recv(sock, HoldReply)
                    if isinstance(reply, HoldReply):
                        return reply
                    raise ConnectionError("the keeper hung up")
                except (OSError, ConnectionError, RecordRejected) as e:
                    self._close()
                    if attempt or isinstance(e, FileNotFoundError | ConnectionRefusedError):
                        raise KeeperUnreachable(errno.ECONNREFUSED, f"no keeper answers on {self.path}: {e}") from e
        raise KeeperUnreachable(errno.ECONNREFUSED, f"no keeper answers on {self.path}")

    def ask_soon(self, op: str, *, names: list[str] | None = None) -> Callable[[], HoldReply | None]:
        """Ask now, on a connection of its own, and return what reads the answer: the keeper answers
        while this process does other work (a restore parses its manifest meanwhile). The reader gives
        None where the question could not be sent or its answer read (ask again with ``ask``)."""
        req = HoldRequest(op=op, job=self.job, names=names or [])  # type: ignore[arg-type]
        sock: socket.socket | None = None
        try:
            sock = self._open()
            _send(sock, req)
        except (OSError, ConnectionError):
            if sock is not None:
                sock.close()
            sock = None

        def answer() -> HoldReply | None:
            if sock is None:
                return None
            try:
                reply = _recv(sock, HoldReply)
                return reply if isinstance(reply, HoldReply) else None
            except (OSError, ConnectionError, RecordRejected):
                return None
            finally:
                sock.close()

        return answer

    def _open(self) -> socket.socket:
        st = os.lstat(self.path)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise ConnectionRefusedError(f"{self.path} is not a socket of ours")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_TIMEOUT_S)
        try:
            sock.connect(str(self.path))
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = self._open()
        return self._sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()
