"""The memory tier: each rank's shard of a recent step kept in node-local memory, so that a restart on
the same node reads it from memory instead of the shared file system.

Opt-in (``CheckpointConfig.memory_tier``). Where the copies are:

    the node keeper's anonymous memory           the node's copies (``held.py``): read with process_vm_readv
    /dev/shm/omni-<uid>/                         0700, ours (checked)
        <job id>/                                0700, ours (checked): the job's objects, freed at its end
            keeper.<node>.sock                   the keeper's Unix socket
            step-120.rank-00003.<incarnation>.h5  0600: a tmpfs copy, only where no keeper can hold it

The copy is published by the persist thread once the shard file is written and fsynced: it asks the
node's keeper to hold it (the keeper copies it from the page cache into a reused buffer on transparent
huge pages; nothing more blocks training) and the keeper makes it visible only after checking the
root's fence: an older incarnation publishes nothing once a newer one started (``fence.py``). Where no
keeper answers, or this process cannot read the keeper's memory (ptrace access refused: Yama
``ptrace_scope`` 2/3), the copy is a tmpfs file instead (one line): first under a ``.partial`` name,
then renamed after the same fence check. Either way its name carries the incarnation that wrote it,
so two incarnations never write one copy, and a restore uses a copy only when that incarnation is the
one that committed the step on the file system (the manifest's): the manifest, the fence and the
agreement stay those of the file system tier; only the shard bytes come from memory, and they are
checked by the same per-tensor xxh3 as from the files (``restore.open_restore`` falls back to the
files, one line, on any mismatch).

A per-node cap (``memory_cap_bytes``), a failed allocation and a full tmpfs each give one line and
leave that step to the file system. The keeper's memory ends with it; ``free_job`` removes the job's
folder: the standby server ends its keeper and calls it when it is stopped at the job's end
(``cli/standby.py``); what a lost node's or a killed standby could not free, the SPANK plugin's job
epilog removes as root at the job's end, by these names (spank/shm.c). Neither removes the user's
``omni-<uid>/`` once empty: it holds no memory, and another job of the same user on the node may be
making its folder in it at that moment (its creator holds the parent open; removed under it, the
parent takes no new entry: ENOENT, the race the heartbeat relay has with its node folder).

The second source, a peer's memory, is ``peer.py``: the keeper of each node also keeps its ring
predecessor's copies in ``<job>/peer/`` (tmpfs files, freed with the job's folder), and a rank whose
node lacks a shard receives it from that keeper straight into its tensors, checked by the same xxh3 as
it lands.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import held
from slurm_omni.checkpoint.fence import fenced_by
from slurm_omni.checkpoint.held import HeldCopy, KeeperClient, KeeperUnreachable
from slurm_omni.errors import CheckpointError
from slurm_omni.formats.memtier_keeper import HeldCopyRecord, HoldReply
from slurm_omni.ownership import NotOwnedError, ensure_own_dir

log = logging.getLogger(__name__)

DEFAULT_DIR = Path("/dev/shm")
PARTIAL = ".partial"
PEER_AREA = "peer"
"""The job folder's subfolder of copies kept for other nodes (``peer.py``)."""
_COPY = 64 << 20
_NAME = re.compile(r"^step-(\d+)\.(rank-\d{5})\.(.+)\.h5$")


KEEPER_ENV = "OMNI_MEMORY_KEEPER"
"""Set in a trainer's environment where a process frees the job's memory tier at its end: the standby
client sets it (the supervisor runs a standby server on every node, which frees it when stopped).
Without one, nothing would free it, so the tier stays off."""


def from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The memory tier's ``CheckpointConfig`` settings from the job's environment: ``OMNI_MEMORY_TIER=1``
    turns it on where a keeper runs (``OMNI_MEMORY_KEEPER``), ``OMNI_MEMORY_GIB`` caps it per node,
    ``OMNI_MEMORY_DIR`` moves it off /dev/shm."""
    env = os.environ if env is None else env
    if env.get("OMNI_MEMORY_TIER", "") not in ("1", "true", "yes"):
        return {}
    if not env.get(KEEPER_ENV):
        log.warning("checkpoint: memory tier off: no process on this node frees it at the job's end "
                    "(it runs with the in-allocation standby)")
        return {}
    out: dict[str, Any] = {"memory_tier": True}
    gib = env.get("OMNI_MEMORY_GIB", "")
    if gib:
        try:
            out["memory_cap_bytes"] = int(float(gib) * 2**30)
        except ValueError as e:
            raise CheckpointError(f"checkpoint: couldn't read OMNI_MEMORY_GIB: {gib!r} (GiB per node, "
                                  f"a number)") from e
    if env.get("OMNI_MEMORY_DIR"):
        out["memory_dir"] = base_from_env(env)
    return out


def base_from_env(env: Mapping[str, str] | None = None) -> Path:
    """``OMNI_MEMORY_DIR`` (``%n``: the node's name, for several slurmd on one host), else /dev/shm."""
    env = os.environ if env is None else env
    given = env.get("OMNI_MEMORY_DIR", "")
    return Path(given.replace("%n", fmt.safe_name(env.get("SLURMD_NODENAME", "")))) if given else DEFAULT_DIR


def parse_name(name: str) -> tuple[int, str] | None:
    """(step, shard) of a copy's file name (``step-N.rank-NNNNN.<incarnation>.h5``); None for others."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def job_dir(base: Path, job: str) -> Path:
    return base / f"omni-{os.geteuid()}" / fmt.safe_name(job)


class MemoryTier:
    """This process's view of the node's memory tier for one job."""

    def __init__(self, job: str, *, base: Path = DEFAULT_DIR, cap_bytes: int | None = None, keep: int = 2,
                 node: str | None = None) -> None:
        """``node``: whose keeper holds this process's copies (None: SLURMD_NODENAME's)."""
        if not job:
            raise CheckpointError("checkpoint: couldn't use the memory tier: no job id (set memory_job or SLURM_JOB_ID)")
        if cap_bytes is not None and cap_bytes < 0:
            raise CheckpointError(f"checkpoint: memory cap = {cap_bytes} bytes (0 or more)")
        if keep < 1:
            raise CheckpointError(f"checkpoint: memory tier keep = {keep} (at least 1)")
        self.base = base
        self.job = job
        self.cap_bytes = cap_bytes
        self.keep = keep
        self.path = job_dir(base, job)
        self._said: set[str] = set()
        self.keeper = KeeperClient(self.path, job, os.environ.get("SLURMD_NODENAME", "") if node is None else node)
        """The node's keeper, which holds this node's copies in its memory (``held.py``)."""
        self._held = True
        """False once this process found it cannot read the keeper's memory: copies are tmpfs files."""
        self._probed = False
        try:
            ensure_own_dir(self.path, below=base, what="checkpoint memory tier")
        except NotOwnedError as e:
            raise CheckpointError(str(e)) from e

    # -- publishing -----------------------------------------------------------------------------------

    def publish(self, shard_file: Path, *, step: int, rank: int, incarnation: str, root: Path | None = None,
                number: int | None = None) -> Path | None:
        """Copy ``shard_file`` (this rank's shard of ``step``, written and durable) into the tier; the
        copy's path, or None when it was not kept (fenced, over the cap, no room: one line each).

        Where the node's keeper answers, it copies the shard into its memory (``held.py``) and the
        path returned is ``shard_file`` itself (the same bytes, for the ring peer's copy); else the copy
        is a tmpfs file of the job's folder."""
        shard = fmt.shard_name(rank)
        final = self.path / f"step-{step}.{shard}.{fmt.safe_name(incarnation)}.h5"
        held = self.hold(shard_file, final.name, step=step, number=number)
        if held is not None:
            return shard_file if held else None
        partial = final.with_name(final.name + PARTIAL)
        try:
            src = os.open(shard_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self._say("open", f"checkpoint: couldn't keep step {step} in memory: {shard_file}: {e.strerror}")
            return None
        try:
            size = os.fstat(src).st_size
            self._retire(shard, step)
            if not self._fits(step, size):
                return None
            dst = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(dst, 0o600)
                os.ftruncate(dst, size)   # a tmpfs mounted with huge=within_size gives it huge pages then
                _copy(src, dst, size)
            finally:
                os.close(dst)
        except OSError as e:
            _unlink(partial)
            if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                self._say("full", f"checkpoint: couldn't keep step {step} in memory: {self.base} is full "
                                  f"({size / 2**30:.2f} GiB for this shard); the file system has it")
            else:
                self._say("copy", f"checkpoint: couldn't keep step {step} in memory: {e}; the file system has it")
            return None
        finally:
            os.close(src)
        fence = fenced_by(root, number) if root is not None else None
        if fence is not None:
            _unlink(partial)
            log.warning("checkpoint: step %d of incarnation %s not kept in memory: incarnation %d started since",
                        step, number, fence.incarnation)
            return None
        os.replace(partial, final)
        return final

    def staging(self, step: int, rank: int, incarnation: str, size: int) -> Path | None:
        """Where this rank writes its shard of a memory-only step (a ``.partial`` in the tier, about
        ``size`` bytes), or None when it does not fit (one line: the step goes to the file system)."""
        shard = fmt.shard_name(rank)
        self._retire(shard, step)
        if not self._fits(step, size):
            return None
        return self.path / f"step-{step}.{shard}.{fmt.safe_name(incarnation)}.h5{PARTIAL}"

    def place(self, partial: Path, *, step: int, root: Path | None = None, number: int | None = None) -> Path | None:
        """Publish a copy written at :meth:`staging`'s path (0600): renamed into place unless a newer
        incarnation started on ``root`` since (then removed, None)."""
        os.chmod(partial, 0o600)
        fence = fenced_by(root, number) if root is not None else None
        if fence is not None:
            _unlink(partial)
            log.warning("checkpoint: step %d of incarnation %s not kept in memory: incarnation %d started since",
                        step, number, fence.incarnation)
            return None
        final = partial.with_name(partial.name.removesuffix(PARTIAL))
        os.replace(partial, final)
        return final

    def hold(self, source: Path, name: str, *, step: int, number: int | None,
             elsewhere: str = "the file system has it") -> bool | None:
        """Ask the node's keeper to hold ``source``'s bytes as copy ``name``: True once it does, False when
        it refused (fenced, over the cap, no memory: one line ending in ``elsewhere``, where the step is
        instead), None when no keeper can (none answers, or this process cannot read its memory: one
        line; the caller keeps a tmpfs file instead)."""
        if not self._held:
            return None
        held.release_inherited()   # (done at the restore's end: a trainer that restored nothing)
        try:
            reply = self.keeper.ask("hold", names=[name], source=str(source), number=number)
        except KeeperUnreachable as e:
            # INFO: the keeper that failed to start said why (a WARNING of the standby's)
            log.log(logging.DEBUG if "nokeeper" in self._said else logging.INFO,
                    "checkpoint: %s; this node's copies are tmpfs files", e)
            self._said.add("nokeeper")
            return None
        if not reply.ok:
            if reply.refused == "fenced":
                log.warning("checkpoint: step %d of incarnation %s not kept in memory: %s", step, number, reply.error)
            elif reply.refused in ("cap", "full"):
                what = "the cap" if reply.refused == "cap" else "no memory"
                hint = " (raise [checkpoint] memory_gib)" if reply.refused == "cap" else ""
                self._say(reply.refused, f"checkpoint: couldn't keep step {step} in memory ({what}): "
                                         f"{reply.error}{hint}; {elsewhere}")
            else:
                self._say("hold", f"checkpoint: the keeper couldn't keep step {step} in memory: {reply.error}; "
                                  f"keeping a tmpfs copy")
                return None
            return False
        if not self._probed:
            self._probed = True
            copy = reply.copies[0]
            try:   # once: can this node's ranks read the keeper's memory? (Yama ptrace_scope 2/3: no)
                probe = bytearray(min(copy.size, 4096) or 1)
                HeldCopy(copy.name, reply.pid, copy.addr, copy.size).read_into(0, memoryview(probe)[:min(copy.size, 4096)])
            except OSError as e:
                self._held = False
                log.warning("checkpoint: couldn't read the node keeper's memory (%s; ptrace access, see Yama "
                            "ptrace_scope); this node's copies are tmpfs files (slower restores)", e.strerror or e)
                self._ask_quietly("drop", [name])
                return None
        return True

    def _ask_quietly(self, op: str, names: list[str]) -> int:
        """A keeper request whose failure changes nothing (``used``: 0 when none answers)."""
        try:
            return self.keeper.ask(op, names=names).used
        except KeeperUnreachable:
            return 0

    def _fits(self, step: int, size: int) -> bool:
        if self.cap_bytes is not None:
            used = self.used_bytes()
            if used + size > self.cap_bytes:
                self._say("cap", f"checkpoint: couldn't keep step {step} in memory: {(used + size) / 2**30:.2f} GiB "
                                 f"on this node would pass the cap of {self.cap_bytes / 2**30:.2f} GiB "
                                 f"(raise [checkpoint] memory_gib); the file system has it")
                return False
        try:
            vfs = os.statvfs(self.path)
        except OSError:
            return True
        if vfs.f_bavail * vfs.f_frsize < size:
            self._say("full", f"checkpoint: couldn't keep step {step} in memory: {self.base} has "
                              f"{vfs.f_bavail * vfs.f_frsize / 2**30:.2f} GiB free, the shard needs "
                              f"{size / 2**30:.2f}; the file system has it")
            return False
        return True

    def used_bytes(self) -> int:
        """The tier's bytes on this node: the job folder's tmpfs copies and what the keeper holds."""
        total = self._ask_quietly("used", []) if self._held else 0
        for entry in os.scandir(self.path):
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
        return total

    def _retire(self, shard: str, step: int) -> None:
        """Leave room for ``step``: this rank's copies of all but the ``keep - 1`` newest older steps go,
        and any partial copy of its own (a crash mid-copy)."""
        mine: list[tuple[int, str]] = []
        for name in os.listdir(self.path):
            if name.endswith(PARTIAL) and f".{shard}." in name:
                _unlink(self.path / name)
                continue
            m = _NAME.match(name)
            if m and m.group(2) == shard:
                mine.append((int(m.group(1)), name))
        steps = sorted({s for s, _ in mine if s < step}, reverse=True)[:self.keep - 1]
        for s, name in mine:
            if s not in steps:
                _unlink(self.path / name)

    # -- restoring ------------------------------------------------------------------------------------

    def where_soon(self) -> Callable[[list[str]], list[tuple[HeldCopyRecord, int]]]:
        """Ask the node's keeper now which copies it holds (all of them: the names need the manifest)
        and return what reads its answer (read once), as ``_where`` gives the copies of ``names``;
        where that answer never came, ``_where`` asks for ``names`` then."""
        if held.inherited(self.job) is not None:   # forked by the holder: its copies are in this process
            return self._where
        answer = self.keeper.ask_soon("where") if self._held else None
        got: list[HoldReply | None] = []

        def answered(names: list[str]) -> list[tuple[HeldCopyRecord, int]]:
            if answer is not None and not got:
                got.append(answer())
            reply = got[0] if got else None
            if reply is None or not reply.ok:
                return self._where(names)
            wanted = set(names)
            return [(c, reply.pid) for c in reply.copies if c.name in wanted]

        return answered

    def sources(self, manifest: fmt.Manifest, *,
                held: Callable[[list[str]], list[tuple[HeldCopyRecord, int]]] | None = None) -> dict[str, Path | HeldCopy]:
        """The shards of ``manifest`` this node holds a sound-looking copy of: written by the incarnation
        that committed the step, of the recorded size, in the keeper's memory or a 0600 regular tmpfs
        file of ours. Their bytes are checked by the reader, tensor by tensor. ``held``: the keeper's
        copies as ``where_soon`` asked for them (else asked now)."""
        found: dict[str, Path | HeldCopy] = {}
        uid = os.geteuid()
        names = {f"step-{manifest.step}.{name}.{fmt.safe_name(manifest.incarnation)}.h5": name
                 for name, shard in manifest.shards.items() if shard.file is not None}
        for copy, pid in (held or self._where)(list(names)):
            if copy.size == manifest.shards[names[copy.name]].file_bytes:
                found[names[copy.name]] = HeldCopy(copy.name, pid, copy.addr, copy.size)
            else:
                self._say("size", f"checkpoint: not reading {copy.name} from the keeper's memory: {copy.size} "
                                  f"bytes, the shard has {manifest.shards[names[copy.name]].file_bytes}")
        for name, shard in manifest.shards.items():
            if shard.file is None or name in found:
                continue
            path = self.path / f"step-{manifest.step}.{name}.{fmt.safe_name(manifest.incarnation)}.h5"
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
                self._say("mode", f"checkpoint: not reading {path}: not a 0600 file of uid {uid}")
                continue
            if st.st_size != shard.file_bytes:
                self._say("size", f"checkpoint: not reading {path}: {st.st_size} bytes, the shard has "
                                  f"{shard.file_bytes}")
                continue
            found[name] = path
        return found

    def _where(self, names: list[str]) -> list[tuple[HeldCopyRecord, int]]:
        """The held copies among ``names``: those this process inherited from the holder that forked it
        (read here, ``held.hold_here``), then what the keeper holds of the rest (a copy held after the
        fork: read from the keeper's memory)."""
        mine = held.inherited(self.job) or {}
        found = [(mine[n], held.HERE) for n in names if n in mine]
        names = [n for n in names if n not in mine]
        if not self._held or not names:
            return found
        try:
            reply = self.keeper.ask("where", names=names)
        except KeeperUnreachable as e:
            log.debug("checkpoint: %s", e)
            return found
        return found + [(c, reply.pid) for c in reply.copies]

    def hand_over(self, copy: Path, *, step: int, number: int | None) -> None:
        """A memory-only step's tmpfs copy (published, its ring peer's copy sent) into the keeper's
        memory; the file goes once the keeper holds it (it stays where the keeper cannot)."""
        if self.hold(copy, copy.name, step=step, number=number, elsewhere=f"its tmpfs copy {copy} stays"):
            _unlink(copy)

    def drop(self, copies: Mapping[str, Path | HeldCopy]) -> None:
        held = [c.name for c in copies.values() if isinstance(c, HeldCopy)]
        if held:
            self._ask_quietly("drop", held)
        for copy in copies.values():
            if isinstance(copy, Path):
                _unlink(copy)

    def _say(self, kind: str, line: str) -> None:
        """One warning per kind of trouble; later ones only at debug (a cap or a full tmpfs each step)."""
        log.log(logging.DEBUG if kind in self._said else logging.WARNING, "%s", line)
        self._said.add(kind)


def free_job(job: str, *, base: Path = DEFAULT_DIR) -> int:
    """Remove the job's folder of the memory tier on this node (ours only); the bytes freed. The
    user's ``omni-<uid>/`` stays, empty or not (module doc)."""
    path = job_dir(base, job)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        log.warning("checkpoint: not freeing %s: not a folder of ours", path)
        return 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        freed = _empty(fd, path, sub=PEER_AREA)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError as e:
        log.warning("checkpoint: couldn't remove %s: %s", path, e.strerror)
    return freed


def _empty(fd: int, path: Path, *, sub: str | None = None) -> int:
    """Unlink the files of the open folder ``fd`` (and those of its folder ``sub``, then it); bytes freed."""
    freed = 0
    for name in os.listdir(fd):
        try:
            freed += os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
            os.unlink(name, dir_fd=fd)
        except IsADirectoryError:
            if name != sub:
                log.warning("checkpoint: left %s/%s (a folder: nothing the tier writes)", path, name)
                continue
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                if os.fstat(child).st_uid == os.geteuid():
                    freed += _empty(child, path / name)
            finally:
                os.close(child)
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as e:
                log.warning("checkpoint: couldn't remove %s/%s: %s", path, name, e.strerror)
        except OSError:
            continue
    return freed


def _copy(src: int, dst: int, size: int) -> None:
    at = 0
    while at < size:
        try:
            n = os.sendfile(dst, src, at, min(_COPY, size - at))
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            n = os.write(dst, os.pread(src, min(_COPY, size - at), at))
        if n == 0:
            raise OSError(errno.EIO, f"the shard file ended at {at} of {size} bytes")
        at += n


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
