"""The warm standby server: one per node of an in-allocation job, started by the step supervisor as
its own ``srun --overlap`` step. It imports torch and the training runtime once, then waits on a Unix
socket; each task of a (re)launched step runs the tiny ``client.py``, which hands over its environment
and file descriptors, and the server forks a trainer that starts with everything imported already
(about 2.8 s of imports on an idle 2-core machine, far more under load, saved per relaunch).

Only the job's owner may connect, and only to its own server: the socket lives in a 0700 folder of
ours (checked by its descriptor, ``slurm_omni.ownership``; a folder another user made first is
refused with one line and the ranks start cold), and each end checks the other's uid (SO_PEERCRED).
The server does no torch work itself (no OpenMP threads, no CUDA), so forking it is safe; every trainer
is a fresh child. With the memory tier it also holds the node's checkpoint copies
(``checkpoint/peer.py``'s ``hold_copies``: a socket thread and its lock, held across every fork), which
every trainer inherits and restores from in its own memory (docs/checkpoint.md "Restore from inherited
memory"). A client that goes away (its task was killed) takes its
trainer with it (SIGKILL).
"""

from __future__ import annotations

import array
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from slurm_omni.ownership import OwnDir, ensure_dir, open_own_dir

log = logging.getLogger(__name__)

MAX_HELLO = 1 << 20
WARM_LINE = "standby: warm on"
"""Written to stderr (the standby step's log on the supervisor's host) once the server listens."""


def socket_path(folder: Path, job_id: str, node: str) -> Path:
    return folder / f"omni-standby-{job_id}-{node}.sock"


def standby_dir(job_id: str) -> Path:
    """Node-local, one per job and user: ``$TMPDIR/omni-standby-<uid>-<job>`` (0700, checked by its
    descriptor: ``slurm_omni.ownership``)."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"omni-standby-{os.geteuid()}-{job_id}"


def open_standby_dir(job_id: str, what: str = "standby") -> OwnDir:
    """The standby folder of ``job_id``, made when missing, ours and private; else one line naming it."""
    return ensure_dir(standby_dir(job_id), what=what, private=True)


def warm_up() -> None:
    """Everything a trainer imports, once: the public API (``elastic.preload``) and the built-in
    trainer that is written on it."""
    import torch  # noqa: F401

    import slurm_omni.cli.main
    import slurm_omni.cli.train
    import slurm_omni.runtime.loop  # noqa: F401
    from slurm_omni import elastic

    elastic.preload()


def serve(path: Path, *, ready: Path | None = None, on_stop: Callable[[], None] | None = None) -> None:
    """Serve on the socket ``path``, whose folder must be ours and private: bound through the
    folder's checked descriptor, so a folder swapped after the check is not where we listen.
    ``on_stop``: run on SIGUSR2, SIGTERM or SIGINT (the job's end), then the server exits 0; set after
    the imports, so that nothing they set up replaces it."""
    folder = open_own_dir(path.parent, "standby", private=True)
    warm_up()
    if on_stop is not None:
        def stop(_signum: int, _frame: object) -> None:
            try:
                on_stop()
            finally:
                os._exit(0)

        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
    try:
        os.unlink(path.name, dir_fd=folder.fd)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(folder.proc_path(path.name))
    finally:
        os.umask(old)
    folder.close()
    srv.listen(64)
    if ready is not None:
        ready.write_text(str(os.getpid()))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print(f"{WARM_LINE} {path}", file=sys.stderr, flush=True)   # the supervisor reads it: at any log level
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn, srv), daemon=True).start()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _handle(conn: socket.socket, srv: socket.socket) -> None:
    try:
        if _peer_uid(conn) != os.geteuid():
            log.warning("standby: refused a client of another user")
            return
        fds = array.array("i")
        msg, anc, _, _ = conn.recvmsg(MAX_HELLO, socket.CMSG_LEN(3 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        while not msg.endswith(b"\n"):
            more = conn.recv(MAX_HELLO)
            if not more:
                return
            msg += more
        hello = json.loads(msg)
        if len(fds) != 3 or not isinstance(hello, dict):
            return
        pid = os.fork()
        if pid == 0:   # the trainer
            _become_trainer(hello, list(fds), srv, conn)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        watcher = threading.Thread(target=_kill_when_gone, args=(conn, pid), daemon=True)
        watcher.start()
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        except OSError:
            pass
    except (OSError, ValueError) as e:
        log.warning("standby: a client failed: %s", e)
    finally:
        conn.close()


def _kill_when_gone(conn: socket.socket, pid: int) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _become_trainer(hello: dict[str, object], fds: list[int], srv: socket.socket, conn: socket.socket) -> None:
    code = 1
    try:
        srv.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        env = hello["env"]
        argv = hello["argv"]
        if not isinstance(env, dict) or not isinstance(argv, list):
            os._exit(2)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        os.chdir(str(hello["cwd"]))
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        for handler in logging.getLogger().handlers[:]:
            logging.getLogger().removeHandler(handler)
        from slurm_omni.cli.main import main

        sys.argv = ["omni", *[str(a) for a in argv]]
        try:
            result = main([str(a) for a in argv])
            code = int(result) if isinstance(result, int) else 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:   # noqa: BLE001 - the trainer's own error, said on its stderr: os._exit says nothing
        code = 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
