"""The standby client: what an srun task runs instead of ``omni train`` when a warm standby waits on
its node. Standard library only, run as ``python -S client.py SOCKET -- ARGS...`` so that it starts
in milliseconds: it hands its environment, working folder, argv and its stdin/stdout/stderr (as file
descriptors) to the node's standby server, which forks an already-imported trainer for it; then it
relays signals to that trainer and exits with its status. When no server answers, it execs
``omni ARGS...`` itself (a cold start).

It hands all that only to its own user's server: the socket's folder must be ours and private
(opened without following links and checked by its descriptor, ``slurm_omni.ownership``, the one
check every folder goes through), the connection is made through that descriptor, and the server's
uid (SO_PEERCRED) must be ours. Anything else is one line on the task's stderr and a cold start.

Wire format (one Unix stream connection): the client sends one JSON line ``{"env", "cwd", "argv"}``
with its three fds attached (SCM_RIGHTS); the server answers ``{"pid": N}\\n`` then, when the trainer
ends, ``{"status": S}\\n`` (``os.waitpid`` status). The client closing the connection (it was
killed) makes the server SIGKILL the trainer.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

# ``python -S``: no site-packages; the package is the folder two above this file (one small import)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from slurm_omni.ownership import NotOwnedError, open_own_dir

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def _cold(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "slurm_omni.cli.main", *args])


def _read_line(sock: socket.socket, buf: bytearray) -> dict[str, int] | None:
    while b"\n" not in buf:
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            return None
        buf.extend(chunk)
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    obj = json.loads(line)
    return obj if isinstance(obj, dict) else None


def node_socket() -> str:
    """The socket of this node's server (``server.socket_path`` of ``server.standby_dir``)."""
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                          f"omni-standby-{os.geteuid()}-{os.environ.get('SLURM_JOB_ID', '')}")
    return os.path.join(folder, f"omni-standby-{os.environ.get('SLURM_JOB_ID', '')}-"
                                f"{os.environ.get('SLURMD_NODENAME', '')}.sock")


def _connect(path: str) -> socket.socket | None:
    """A connection to our own user's server at ``path``; None (after one line when something is not
    ours) for a cold start."""
    folder, name = os.path.split(path)
    if not os.path.lexists(folder or "."):   # no standby on this node
        return None
    try:
        own = open_own_dir(Path(folder or "."), "omni standby client", private=True)
    except NotOwnedError as e:
        print(f"{e}; starting cold", file=sys.stderr)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(own.proc_path(name))
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        sock.close()
        return None
    finally:
        own.close()
    server_uid = struct.unpack("3i", creds)[1]
    if server_uid != os.geteuid():
        sock.close()
        print(f"omni standby client: couldn't use the standby server at {path}: it runs as uid {server_uid}, "
              f"not ours ({os.geteuid()}); starting cold", file=sys.stderr)
        return None
    return sock


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("omni standby client: usage: client.py SOCKET|node -- OMNI_ARGS...", file=sys.stderr)
        return 2
    path, args = (node_socket() if argv[0] == "node" else argv[0]), argv[2:]
    # when srun started this task: the trainer writes it into its first metrics line (startup times)
    os.environ["OMNI_TASK_STARTED_AT"] = repr(time.time())
    # this node's standby server (the supervisor starts one per node, this task runs with or without it)
    # frees the job's memory tier at the job's end: the trainer may keep one (checkpoint/memtier.py)
    os.environ["OMNI_MEMORY_KEEPER"] = "standby"
    sock = _connect(path)
    if sock is None:
        _cold(args)
        return 1   # not reached: exec
    hello = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": args}).encode() + b"\n"
    fds = array.array("i", [0, 1, 2])
    sock.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
    buf = bytearray()
    first = _read_line(sock, buf)
    if first is None or "pid" not in first:
        print(f"omni standby client: the standby server at {path} closed the connection before starting the "
              "trainer (its log is the job's standby step output)", file=sys.stderr)
        return 1
    pid = int(first["pid"])

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    done = _read_line(sock, buf)
    if done is None or "status" not in done:
        print(f"omni standby client: the standby server at {path} went away while trainer {pid} ran",
              file=sys.stderr)
        return 1
    status = int(done["status"])
    if os.WIFSIGNALED(status):
        died_of = os.WTERMSIG(status)
        signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
        return 128 + died_of
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
