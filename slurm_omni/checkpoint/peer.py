"""The memory tier's second source: a copy of each rank's shard in a peer node's memory. (The keeper
below also holds its own node's copies in its memory for the first source: ``held.py``.)

Each node of a job with the memory tier runs a replica keeper (``Keeper``): a process started by the
node's standby server (``cli/standby.py``), so it outlives every trainer of the job and ends with it.
It listens on TCP, keeps what its ring predecessor sends in the peer area of the user's tmpfs folder
(``/dev/shm/omni-<uid>/<job>/peer/``, 0700, apart from the node's own copies), and serves it back to
a replacement node. Which node keeps whose copy is policy (``policy/replica_ring.py``: another leaf
switch where the layout allows it); the supervisor passes the ring to the step (``OMNI_MEMTIER_RING``).

Trust: only holders of the job's secret talk to a keeper. The secret is 32 random bytes in the job's
private checkpoint folder (``<root>/.memtier/secret``, 0600 in a 0700 folder of the user's: other
users cannot read it). Every request and reply carries an HMAC-SHA256 under it, bound to a fresh nonce
of each side (no replay, and the client knows it talks to a keeper of the job). The shard bytes
themselves are not trusted either way: a restore checks them against the manifest's per-tensor xxh3
like every other source, and drops a bad copy for the file system (``restore.open_restore``).

The fence holds here too: a keeper stores a copy only while its sender's incarnation is not fenced
(``fence.py``), under a name that carries the sender's incarnation, so an older life neither publishes
after a newer one started nor replaces what the newer one sent.

Where a copy is: each sender records its last replica in ``<root>/.memtier/replicas/rank-NNNNN.json``
(the holder's node name), and each keeper its address in ``keepers/<node>.json``. A rank whose own
node lacks its shard (a replacement node) reads the record of each shard it needs and asks the holder
(``PeerSource``); anything missing, stale or refused leaves that shard to the file system.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import memtier
from slurm_omni.checkpoint.fence import fenced_by
from slurm_omni.checkpoint.held import (
    THP_ENABLED,
    HeldCopy,
    HeldServer,
    HeldStore,
    KeeperClient,
    KeeperUnreachable,
    hold_here,
    huge_pages,
)
from slurm_omni.errors import CheckpointError
from slurm_omni.formats import RecordRejected, decode, encode
from slurm_omni.formats.memtier_peer import (
    MAX_RECORD_BYTES,
    KeeperAddress,
    PeerReply,
    PeerRequest,
    ReplicaCopy,
    ReplicaRecord,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.ownership import NotOwnedError, ensure_own_dir
from slurm_omni.policy.replica_ring import decode_ring

log = logging.getLogger(__name__)

SUBDIR = ".memtier"
PEER_AREA = memtier.PEER_AREA
RING_ENV = "OMNI_MEMTIER_RING"
ADDR_ENV = "OMNI_NODE_ADDR"
MAGIC = b"OMNIPEER1"
NONCE = 16
MAC = 32
_MAX_HEADER = 4096
_CHUNK = 8 << 20
_TIMEOUT_S = 30.0
_CONNECT_S = 5.0
_PIPE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_SPLICE_MOVE = getattr(os, "SPLICE_F_MOVE", 1)
KEEP = 2
"""Copies a keeper keeps per rank (the newest steps), and a replica record lists."""


class PeerError(CheckpointError):
    """A peer copy could not be stored or fetched (the file system still has the step)."""


# -- the secret and the records ---------------------------------------------------------------------

def meta_dir(root: Path) -> Path:
    return root / SUBDIR


def load_secret(root: Path, *, create: bool = True) -> bytes:
    """The job's secret (made once, by whoever asks first: a link that fails when another won)."""
    folder = meta_dir(root)
    try:
        ensure_own_dir(folder, what="checkpoint memory tier", private=True)
    except NotOwnedError as e:
        raise PeerError(str(e)) from e
    path = folder / "secret"
    if create and not os.path.lexists(path):
        tmp = write_atomic(folder / f".secret.{os.getpid()}.{secrets.token_hex(4)}", secrets.token_bytes(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise PeerError(f"checkpoint: couldn't read the job's peer secret {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PeerError(f"checkpoint: couldn't use the job's peer secret {path}: not a 0600 file of "
                            f"uid {os.geteuid()} (remove it; the next start makes a new one)")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) < 32:
        raise PeerError(f"checkpoint: couldn't use the job's peer secret {path}: {len(key)} bytes (32 expected)")
    return key


def _write_record(path: Path, record: msgspec.Struct) -> None:
    ensure_own_dir(path.parent, what="checkpoint memory tier", private=True)
    write_atomic(path, encode(record), durable=False)


def _read_record(path: Path, kind: type[msgspec.Struct]) -> msgspec.Struct | None:
    try:
        return decode(read_bounded(path, MAX_RECORD_BYTES), kind, str(path))
    except RecordRejected as e:
        log.warning("checkpoint: ignoring %s: %s", path, e)
        return None
    except FileRejected:
        return None


def keeper_path(root: Path, node: str) -> Path:
    return meta_dir(root) / "keepers" / f"{fmt.safe_name(node)}.json"


def replica_path(root: Path, rank: int) -> Path:
    return meta_dir(root) / "replicas" / f"{fmt.shard_name(rank)}.json"


def read_keeper(root: Path, node: str) -> KeeperAddress | None:
    rec = _read_record(keeper_path(root, node), KeeperAddress)
    return rec if isinstance(rec, KeeperAddress) else None


def read_replica(root: Path, rank: int) -> ReplicaRecord | None:
    rec = _read_record(replica_path(root, rank), ReplicaRecord)
    return rec if isinstance(rec, ReplicaRecord) else None


def copy_name(step: int, rank: int, incarnation: str) -> str:
    """The one name of rank ``rank``'s shard of ``step`` written by ``incarnation``, in either area."""
    return f"step-{step}.{fmt.shard_name(rank)}.{fmt.safe_name(incarnation)}.h5"


# -- the wire ---------------------------------------------------------------------------------------

def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    at = 0
    while at < n:
        got = sock.recv_into(view[at:], n - at)
        if got == 0:
            raise ConnectionError(f"the peer closed the connection ({at} of {n} bytes)")
        at += got
    return bytes(buf)


def _send_signed(sock: socket.socket, key: bytes, label: bytes, nonces: bytes, record: msgspec.Struct) -> None:
    body = msgspec.json.encode(record)
    sock.sendall(struct.pack("!I", len(body)) + body + _mac(key, label, nonces, body))


def _recv_signed(sock: socket.socket, key: bytes, label: bytes, nonces: bytes, kind: type[msgspec.Struct]
                 ) -> msgspec.Struct:
    (length,) = struct.unpack("!I", _recv_exact(sock, 4))
    if length > _MAX_HEADER:
        raise ConnectionError(f"a {length}-byte header (at most {_MAX_HEADER})")
    body = _recv_exact(sock, length)
    if not hmac.compare_digest(_recv_exact(sock, MAC), _mac(key, label, nonces, body)):
        raise PermissionError("its HMAC does not match the job's secret")
    return decode(body, kind, "a peer record")


def _recv_into_file(sock: socket.socket, fd: int, size: int) -> None:
    """``size`` bytes from ``sock`` straight into the (tmpfs) file ``fd``: spliced through a pipe (the
    kernel moves the socket's pages, no copy through this process: as fast as a raw ``recv`` into a
    buffer, where a mapping of the file paid its page faults), else through a mapping of the file."""
    os.ftruncate(fd, size)
    if size == 0:
        return
    try:
        _splice_into_file(sock, fd, size)
    except _NoSplice:
        _map_into_file(sock, fd, size)


class _NoSplice(Exception):
    """splice(2) refuses this socket or file (before any byte moved)."""


def _splice_into_file(sock: socket.socket, fd: int, size: int) -> None:
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, _PIPE)
        except OSError:
            pass
        at = 0
        while at < size:
            try:
                n = os.splice(sock.fileno(), w, min(_PIPE, size - at), flags=_SPLICE_MOVE)
            except BlockingIOError:   # SO_RCVTIMEO passed (``_blocking``)
                raise TimeoutError(f"no byte from the peer in {_TIMEOUT_S:.0f} s ({at} of {size})") from None
            except OSError as e:
                if at == 0 and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise _NoSplice() from e
                raise
            if n == 0:
                raise ConnectionError(f"the peer closed the connection after {at} of {size} bytes")
            done = 0
            while done < n:
                done += os.splice(r, fd, n - done, offset_dst=at + done, flags=_SPLICE_MOVE)
            at += n
    finally:
        os.close(r)
        os.close(w)


def _map_into_file(sock: socket.socket, fd: int, size: int) -> None:
    os.posix_fallocate(fd, 0, size)   # a full tmpfs is ENOSPC here, not SIGBUS while writing the map
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)   # the pages mapped at once, not by faults
    with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        view = memoryview(mm)
        try:
            at = 0
            while at < size:
                got = sock.recv_into(view[at:], min(_CHUNK, size - at))
                if got == 0:
                    raise ConnectionError(f"the peer closed the connection after {at} of {size} bytes")
                at += got
        finally:
            view.release()


def _send_file(sock: socket.socket, fd: int, size: int) -> None:
    """``size`` bytes of the file ``fd`` by ``sendfile`` on a blocking socket (``_blocking``: a stalled
    peer is EAGAIN after the kernel's send timeout)."""
    at = 0
    while at < size:
        try:
            sent = os.sendfile(sock.fileno(), fd, at, min(_CHUNK, size - at))
        except BlockingIOError:
            raise TimeoutError(f"the peer took no byte in {_TIMEOUT_S:.0f} s ({at} of {size})") from None
        if sent == 0:
            raise ConnectionError(f"the file ended at {at} of {size} bytes")
        at += sent


def _blocking(sock: socket.socket, timeout_s: float) -> None:
    """A blocking socket whose every call gives up after ``timeout_s`` (SO_RCVTIMEO/SO_SNDTIMEO): the
    bulk transfer runs in the kernel (sendfile, splice) without a poll per chunk, which a Python
    socket timeout (non-blocking underneath) costs, and a stalled peer still ends it."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class _Conn:
    """One authenticated exchange with a keeper (the client's side)."""

    def __init__(self, host: str, port: int, key: bytes, *, timeout_s: float = _TIMEOUT_S) -> None:
        self.key = key
        self.sock = socket.create_connection((host, port), timeout=_CONNECT_S)   # a lost node: soon refused
        try:
            _blocking(self.sock, timeout_s)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _recv_exact(self.sock, len(MAGIC) + NONCE)
            if hello[:len(MAGIC)] != MAGIC:
                raise ConnectionError("not a replica keeper")
            self.server_nonce = hello[len(MAGIC):]
            self.nonce = secrets.token_bytes(NONCE)
        except BaseException:
            self.sock.close()
            raise

    @property
    def nonces(self) -> bytes:
        return self.server_nonce + self.nonce

    def ask(self, request: PeerRequest) -> PeerReply:
        _send_signed(self.sock, self.key, b"req", self.server_nonce, request)
        return self.reply(b"rep")

    def reply(self, label: bytes) -> PeerReply:
        try:
            rec = _recv_signed(self.sock, self.key, label, self.nonces, PeerReply)
        except ConnectionError as e:
            raise ConnectionError(f"the keeper closed the connection (not this job's keeper, or a secret "
                                  f"that differs: {e})") from e
        if not isinstance(rec, PeerReply):
            raise ConnectionError("a malformed reply")
        return rec

    def close(self) -> None:
        self.sock.close()


def put(host: str, port: int, key: bytes, *, job: str, name: str, path: Path, number: int | None) -> int:
    """Send the file ``path`` to the keeper as ``name``; its size once the keeper stored it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        conn = _Conn(host, port, key)
        try:
            first = conn.ask(PeerRequest(op="put", job=job, name=name, size=size, number=number, nonce=conn.nonce))
            if not first.ok:
                raise PeerError(f"checkpoint: the keeper at {host}:{port} refused {name}: {first.error}")
            _send_file(conn.sock, fd, size)
            done = conn.reply(b"end")
            if not done.ok:
                raise PeerError(f"checkpoint: the keeper at {host}:{port} did not keep {name}: {done.error}")
            return size
        finally:
            conn.close()
    finally:
        os.close(fd)


def get(host: str, port: int, key: bytes, *, job: str, name: str, into: int, size: int) -> int:
    """Fetch ``name`` (``size`` bytes expected; 0: any) from the keeper into the open file ``into``."""
    stream = open_stream(host, port, key, job=job, name=name, size=size)
    try:
        _recv_into_file(stream.sock, into, stream.size)
        return stream.size
    finally:
        stream.close()


class PeerStream:
    """A keeper sending one shard copy: its bytes in file order on a connected socket, read once by
    the restore straight into the tensors (``fileio.ShardFiles.read_stream``) and checked there by the
    same per-tensor xxh3 as a file's. ``size`` is what the keeper holds (checked against the manifest)."""

    def __init__(self, sock: socket.socket, size: int, node: str, name: str) -> None:
        self.sock, self.size, self.node, self.name = sock, size, node, name
        self.at = 0
        """Bytes received so far."""

    def recv_into(self, view: memoryview) -> int:
        """Fill ``view`` from the stream; the bytes received (fewer only where the peer hung up). One
        receive waits for all of ``view`` (MSG_WAITALL: one wake-up, not one per segment that arrives);
        the kernel's timeout or a signal returns it early with what came, and the loop asks again."""
        got = 0
        want = len(view)
        while got < want:
            try:
                n = self.sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
            except BlockingIOError:   # SO_RCVTIMEO passed (``_blocking``)
                raise TimeoutError(f"no byte from {self.node} in {_TIMEOUT_S:.0f} s ({self.at} of {self.size})") \
                    from None
            if n == 0:
                break
            got += n
            self.at += n
        return got

    def abort(self) -> None:
        """Wake a thread blocked receiving (another thread closes the restore)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()


def open_stream(host: str, port: int, key: bytes, *, job: str, name: str, size: int, node: str = "") -> PeerStream:
    """Ask the keeper for ``name`` (``size`` bytes expected; 0: any); the stream of its bytes."""
    conn = _Conn(host, port, key)
    try:
        rep = conn.ask(PeerRequest(op="get", job=job, name=name, size=size, nonce=conn.nonce))
        if not rep.ok:
            raise PeerError(f"checkpoint: the keeper at {host}:{port} has no {name}: {rep.error}")
        if size and rep.size != size:
            raise PeerError(f"checkpoint: the keeper at {host}:{port} holds {rep.size} bytes of {name}, "
                            f"the shard has {size}")
    except BaseException:
        conn.close()
        raise
    return PeerStream(conn.sock, rep.size, node or host, name)


# -- the keeper ---------------------------------------------------------------------------------------

class Keeper:
    """The node's replica keeper for one job: stores what peers send, serves it back."""

    def __init__(self, job: str, root: Path, node: str, *, base: Path = memtier.DEFAULT_DIR,
                 host: str = "", bind: str = "0.0.0.0", port: int = 0, cap_bytes: int | None = None,
                 keep: int = KEEP, own_copies: bool = True) -> None:
        """``own_copies``: hold this node's copies in this process (``held.py``); False where another
        process of the node holds them (the standby server, ``hold_copies``): served to a peer from
        there."""
        self.job, self.root, self.node, self.keep, self.cap_bytes = job, root, node, keep, cap_bytes
        self.key = load_secret(root)
        self.job_path = memtier.job_dir(base, job)
        self.area = self.job_path / PEER_AREA
        try:
            ensure_own_dir(self.job_path, below=base, what="checkpoint memory tier")
            ensure_own_dir(self.area, below=self.job_path, what="checkpoint memory tier peer area", private=True)
        except NotOwnedError as e:
            raise PeerError(str(e)) from e
        self.sock = socket.create_server((bind, port), backlog=128)
        self.port = int(self.sock.getsockname()[1])
        self.host = host or _own_address()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.held: HeldStore | None = None
        """This node's own copies, in this process's memory (``held.py``), where it holds them."""
        self.local: HeldServer | None = None
        self.holder: KeeperClient | None = None
        """Where another process holds them: its socket."""
        if own_copies:
            self.held, self.local = _held_copies(job, root, node, self.job_path, cap_bytes, keep)
        else:
            self.holder = KeeperClient(self.job_path, job, node)

    def _held_used(self) -> int:
        if self.held is not None:
            return self.held.used()
        if self.holder is None:
            return 0
        try:
            return self.holder.ask("used").used
        except KeeperUnreachable:
            return 0

    def advertise(self) -> None:
        _write_record(keeper_path(self.root, self.node),
                      KeeperAddress(node=self.node, host=self.host, port=self.port, pid=os.getpid(), job=self.job))

    def serve_forever(self) -> None:
        self._open()
        self._accept()

    def _open(self) -> None:
        """Ready for the ranks and the peers, and say so (the listening socket queues connections)."""
        if self.local is not None:
            self.local.start()
        self.advertise()
        log.info("checkpoint: replica keeper of job %s on %s:%d (peer area %s)", self.job, self.host, self.port,
                 self.area)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                raise
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def start(self) -> threading.Thread:
        """Serve from a thread (tests, benchmarks); advertised when this returns (a save right after
        once found no address yet, under nice 19 at load 500, and left its replica to the file system)."""
        self._open()
        thread = threading.Thread(target=self._accept, daemon=True, name="omni-replica-keeper")
        thread.start()
        return thread

    def stop(self) -> None:
        self._stopped.set()
        if self.local is not None:
            self.local.stop()
        if self.held is not None:
            self.held.close()
        if self.holder is not None:
            self.holder.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _handle(self, conn: socket.socket) -> None:
        try:
            _blocking(conn, _TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_nonce = secrets.token_bytes(NONCE)
            conn.sendall(MAGIC + server_nonce)
            try:
                req = _recv_signed(conn, self.key, b"req", server_nonce, PeerRequest)
            except PermissionError:
                log.warning("checkpoint: replica keeper refused a connection: its request is not signed "
                            "with the job's secret")
                return
            if not isinstance(req, PeerRequest):
                return
            nonces = server_nonce + req.nonce
            reply = self._put if req.op == "put" else self._get
            reply(conn, req, nonces)
        except (OSError, ConnectionError, RecordRejected, struct.error) as e:
            log.debug("checkpoint: replica keeper: a connection failed: %s", e)
        finally:
            conn.close()

    def _refuse(self, conn: socket.socket, nonces: bytes, error: str, label: bytes = b"rep") -> None:
        _send_signed(conn, self.key, label, nonces, PeerReply(ok=False, error=error[:400]))

    def _put(self, conn: socket.socket, req: PeerRequest, nonces: bytes) -> None:
        parsed = memtier.parse_name(req.name)
        if req.job != self.job or parsed is None:
            self._refuse(conn, nonces, f"not a shard copy of job {self.job}: {req.name}")
            return
        step, shard = parsed
        with self._lock:
            self._retire(shard, step)
            problem = self._room(req.size)
        if problem:
            self._refuse(conn, nonces, problem)
            return
        _send_signed(conn, self.key, b"rep", nonces, PeerReply(ok=True, size=req.size))
        final = self.area / req.name
        partial = self.area / f".{req.name}.{secrets.token_hex(4)}{memtier.PARTIAL}"
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                _recv_into_file(conn, fd, req.size)
            finally:
                os.close(fd)
            fence = fenced_by(self.root, req.number)
            if fence is not None:
                _unlink(partial)
                self._refuse(conn, nonces, f"incarnation {fence.incarnation} started since", b"end")
                return
            os.replace(partial, final)
        except BaseException:
            _unlink(partial)
            raise
        _send_signed(conn, self.key, b"end", nonces, PeerReply(ok=True, size=req.size))

    def _get(self, conn: socket.socket, req: PeerRequest, nonces: bytes) -> None:
        if req.job != self.job or memtier.parse_name(req.name) is None:
            self._refuse(conn, nonces, f"not a shard copy of job {self.job}: {req.name}")
            return
        # this node's own copy, held in memory (a replacement elsewhere asks): here, or in the holder's
        own = self.held.get(req.name) if self.held is not None else None
        if own is not None:
            try:
                self._send_held(conn, req, nonces, len(own), lambda: conn.sendall(own))
            finally:
                own.release()
            return
        copy = self._holder_copy(req.name)
        if copy is not None:
            self._send_held(conn, req, nonces, copy.size, lambda: _send_remote(conn, copy))
            return
        try:   # a copy kept for a peer, else this node's own (its writer asks: a replacement elsewhere)
            try:
                fd = os.open(self.area / req.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = os.open(self.job_path / req.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            self._refuse(conn, nonces, e.strerror or "missing")
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                self._refuse(conn, nonces, "not a regular file of the job's user")
                return
            if req.size and st.st_size != req.size:
                self._refuse(conn, nonces, f"{st.st_size} bytes, {req.size} asked")
                return
            _send_signed(conn, self.key, b"rep", nonces, PeerReply(ok=True, size=st.st_size))
            _send_file(conn, fd, st.st_size)
        finally:
            os.close(fd)

    def _send_held(self, conn: socket.socket, req: PeerRequest, nonces: bytes, size: int,
                   send: Callable[[], None]) -> None:
        if req.size and size != req.size:
            self._refuse(conn, nonces, f"{size} bytes, {req.size} asked")
            return
        _send_signed(conn, self.key, b"rep", nonces, PeerReply(ok=True, size=size))
        try:
            send()
        except BlockingIOError:
            raise TimeoutError(f"the peer took no byte in {_TIMEOUT_S:.0f} s") from None

    def _holder_copy(self, name: str) -> HeldCopy | None:
        """This node's copy ``name`` where the standby holds it (None: it does not, or no holder)."""
        if self.holder is None:
            return None
        try:
            reply = self.holder.ask("where", names=[name])
        except KeeperUnreachable:
            return None
        found = [c for c in reply.copies if c.name == name] if reply.ok else []
        return HeldCopy(name, reply.pid, found[0].addr, found[0].size) if found else None

    def _room(self, size: int) -> str:
        return _room_on(self.node, self.job_path, self.cap_bytes, self._held_used(), size, self.area)

    def _retire(self, shard: str, step: int) -> None:
        """Room for ``step`` of ``shard``: its copies but the ``keep - 1`` newest older steps go."""
        mine: list[tuple[int, str]] = []
        for name in os.listdir(self.area):
            parsed = memtier.parse_name(name)
            if parsed is not None and parsed[1] == shard:
                mine.append((parsed[0], name))
        steps = sorted({s for s, _ in mine if s < step}, reverse=True)[:self.keep - 1]
        for s, name in mine:
            if s not in steps and s != step:
                _unlink(self.area / name)


def _room_on(node: str, job_path: Path, cap_bytes: int | None, held_bytes: int, size: int,
             area: Path | None = None) -> str:
    """Why ``size`` more bytes of the job's memory tier do not fit on ``node`` ("" when they do): its
    tmpfs files and ``held_bytes`` in memory against the cap, and the room left on ``area``'s tmpfs."""
    if cap_bytes is not None:
        used = _tree_bytes(job_path) + held_bytes
        if used + size > cap_bytes:
            return f"{(used + size) / 2**30:.2f} GiB on {node} would pass the cap of {cap_bytes / 2**30:.2f} GiB"
    if area is None:
        return ""
    try:
        vfs = os.statvfs(area)
    except OSError:
        return ""
    if vfs.f_bavail * vfs.f_frsize < size:
        return f"{vfs.f_bavail * vfs.f_frsize / 2**30:.2f} GiB free on {node}, {size / 2**30:.2f} needed"
    return ""


def _held_copies(job: str, root: Path, node: str, job_path: Path, cap_bytes: int | None,
                 keep: int) -> tuple[HeldStore, HeldServer | None]:
    """A store of this node's copies in this process's memory and its socket (None where it cannot
    listen: one line, the ranks keep tmpfs copies)."""
    def fenced(number: int | None) -> int | None:
        fence = fenced_by(root, number)
        return fence.incarnation if fence is not None else None

    store = HeldStore(job, parse=memtier.parse_name, fenced=fenced, keep=keep,
                      room=lambda size: _room_on(node, job_path, cap_bytes, store.used(), size))
    try:
        return store, HeldServer(store, job_path, node)
    except OSError as e:   # e.g. a socket path past 107 bytes
        log.warning("checkpoint: keeper of job %s on %s holds no copies in memory: couldn't listen on its "
                    "socket: %s", job, node, e)
        return store, None


def hold_copies(job: str, root: Path, node: str, *, base: Path, cap_bytes: int | None,
                keep: int = KEEP) -> HeldServer | None:
    """This process (the node's standby server) holds the node's own copies of ``job`` and answers its
    ranks on the keeper's socket; every trainer it forks then reads them in its own memory
    (``held.hold_here``). The replica keeper (``Keeper(own_copies=False)``, a child of this process)
    serves them to a peer from here. The server, started; None where it cannot listen (one line)."""
    job_path = memtier.job_dir(base, job)
    try:
        ensure_own_dir(job_path, below=base, what="checkpoint memory tier")
    except NotOwnedError as e:
        log.warning("%s; this node's copies are not held in memory", e)
        return None
    store, server = _held_copies(job, root, node, job_path, cap_bytes, keep)
    if server is None:
        return None
    server.start()
    if huge_pages():
        hold_here(store, server)
    else:
        log.info("checkpoint: no transparent huge pages on %s (%s): the trainers read this node's copies from "
                 "the standby's memory, not inherited (a fork would copy every 4 KiB page's entry)", node,
                 THP_ENABLED)
    return server


def _send_remote(conn: socket.socket, copy: HeldCopy) -> None:
    """``copy``'s bytes, read from the process that holds it a chunk at a time, on ``conn``. A copy
    the holder reuses meanwhile is sent as it is: the receiver checks every tensor's xxh3."""
    chunk = bytearray(min(_CHUNK, copy.size) or 1)
    view = memoryview(chunk)
    at = 0
    while at < copy.size:
        n = min(len(chunk), copy.size - at)
        copy.read_into(at, view[:n])
        conn.sendall(view[:n])
        at += n


def _own_address() -> str:
    """This node's address for its peers: OMNI_NODE_ADDR, else what its host name resolves to."""
    given = os.environ.get(ADDR_ENV, "")
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_keeper(job: str, root: Path, node: str, *, base: Path, cap_bytes: int | None,
               parent: int | None = None, own_copies: bool = True) -> None:
    """A keeper process's life: serve until SIGTERM, or until ``parent`` (the standby) is gone."""
    keeper = Keeper(job, root, node, base=base, cap_bytes=cap_bytes, own_copies=own_copies)
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop())
    if parent is not None:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            keeper.stop()
        threading.Thread(target=watch, daemon=True).start()
    keeper.serve_forever()


# -- the trainer's side --------------------------------------------------------------------------------

class Replicas:
    """A rank's view of its job's peers: sends its shard copies to its ring peer, fetches the shards
    its node lacks from whoever holds them. Every failure is one line and leaves the file system."""

    def __init__(self, job: str, root: Path, node: str, ring: Mapping[str, str], memory: memtier.MemoryTier) -> None:
        self.job, self.root, self.node, self.ring, self.memory = job, root, node, dict(ring), memory
        self.key = load_secret(root)
        self._said: set[str] = set()

    @classmethod
    def from_env(cls, root: Path, memory: memtier.MemoryTier | None,
                 env: Mapping[str, str] | None = None) -> Replicas | None:
        """The peers of a rank whose step runs with a ring (the supervisor's ``OMNI_MEMTIER_RING``)."""
        env = os.environ if env is None else env
        if memory is None or not env.get(RING_ENV) or not env.get("SLURMD_NODENAME"):
            return None
        try:
            return cls(memory.job, root, env["SLURMD_NODENAME"], decode_ring(env[RING_ENV]), memory)
        except (CheckpointError, OSError) as e:
            log.warning("%s; no peer copies: restores use this node's memory and the file system", e)
            return None

    @property
    def peer(self) -> str | None:
        return self.ring.get(self.node)

    def send(self, copy: Path, *, step: int, rank: int, incarnation: str, number: int | None) -> bool:
        """Send this node's copy of rank ``rank``'s shard of ``step`` to the ring peer, and record where."""
        peer = self.peer
        if peer is None:
            return False
        addr = read_keeper(self.root, peer)
        if addr is None or addr.job != self.job:
            self._say("nokeeper", f"checkpoint: no replica of step {step} on {peer}: its keeper has not said "
                                  f"where it listens ({keeper_path(self.root, peer)}); the file system has it")
            return False
        name = copy_name(step, rank, incarnation)
        try:
            size = put(addr.host, addr.port, self.key, job=self.job, name=name, path=copy, number=number)
        except (OSError, ConnectionError, RecordRejected, PeerError) as e:
            self._say("put", f"checkpoint: no replica of step {step} on {peer} ({addr.host}:{addr.port}): {e}; "
                             f"the file system has it")
            return False
        # the newest copies the keepers hold (two a rank): the ranks may agree on the older step
        before = read_replica(self.root, rank)
        older = [c for c in before.copies if c.step < step][:KEEP - 1] if before is not None else []
        _write_record(replica_path(self.root, rank), ReplicaRecord(rank=rank, copies=[
            ReplicaCopy(step=step, incarnation=incarnation, holder=peer, origin=self.node, name=name, size=size),
            *older]))
        return True

    def fetch(self, manifest: fmt.Manifest, shards: set[str]) -> dict[str, Path | PeerStream]:
        """Where to read ``shards`` of ``manifest`` that this node's memory lacks: this node's own peer
        area where it keeps that replica (a path), else a stream from the holder's (or the writer
        node's) keeper, the request answered and the size checked, its bytes not read yet: the restore
        reads them once, straight into the tensors, checking each tensor's xxh3 as it lands. A shard
        nobody can send is left out (one line): the file system has it."""
        found: dict[str, Path | PeerStream] = {}
        try:
            for name in sorted(shards):
                info = manifest.shards.get(name)
                if info is None or info.file is None:
                    continue
                source = self._open_one(manifest, info)
                if source is not None:
                    found[name] = source
        except BaseException:
            close_streams(found)
            raise
        return found

    def _open_one(self, manifest: fmt.Manifest, info: fmt.ShardInfo) -> Path | PeerStream | None:
        record = read_replica(self.root, info.rank)
        want = copy_name(manifest.step, info.rank, manifest.incarnation)
        rec = next((c for c in record.copies if c.name == want and c.size == info.file_bytes), None) \
            if record is not None else None
        if rec is None:
            held = ", ".join(f"step {c.step}" for c in record.copies) if record is not None else "none"
            self._say("norecord", f"checkpoint: no peer copy of {info.name} of step-{manifest.step} (its "
                                  f"replicas: {held or 'none'}); reading the file system")
            return None
        # the replica's holder first, then the node that wrote it (alive, a replacement elsewhere)
        tried: list[str] = []
        for node in dict.fromkeys(n for n in (rec.holder, rec.origin) if n):
            try:
                if node == self.node:   # this node kept that copy itself (for the lost node): read it there
                    return _own_replica(self.memory.path / PEER_AREA / want, info.file_bytes)
                addr = read_keeper(self.root, node)
                if addr is None or addr.job != self.job:
                    raise PeerError(f"checkpoint: {node}'s keeper has not said where it listens")
                stream = open_stream(addr.host, addr.port, self.key, job=self.job, name=want,
                                     size=info.file_bytes, node=node)
            except (OSError, ConnectionError, RecordRejected, PeerError) as e:
                tried.append(f"from {node}: {e}")
                continue
            log.info("checkpoint: reading %s of step-%d from %s's memory (%.1f MB)", info.name, manifest.step,
                     node, info.file_bytes / 1e6)
            return stream
        self._say("get", f"checkpoint: couldn't fetch {info.name} of step-{manifest.step} "
                         f"{'; '.join(tried) or '(nobody holds it)'}; reading the file system")
        return None

    def _say(self, kind: str, line: str) -> None:
        log.log(logging.DEBUG if kind in self._said else logging.WARNING, "%s", line)
        self._said.add(kind)


def close_streams(sources: Mapping[str, object]) -> None:
    """Hang up the peer streams among ``sources`` (a restore that ends or falls back)."""
    for source in sources.values():
        if isinstance(source, PeerStream):
            source.close()


def _own_replica(path: Path, size: int) -> Path:
    """This node's peer-area copy of a shard, read in place: ours, 0600, a regular file of ``size`` bytes."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 \
            or st.st_size != size:
        raise PeerError(f"checkpoint: {path}: not a 0600 {size}-byte file of ours")
    return path
