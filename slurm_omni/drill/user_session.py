"""``omni demo --user NAME``: root keeps the little only root may do; everything else runs as NAME.

Root brings the embedded cluster up, then starts ``omni demo --user-session FD`` as the user: uid, gid
and the user's groups set in the child before it runs anything, the user's home as its working
folder, and a clean environment (``user_environment``: PATH, HOME, USER, LOGNAME, SLURM_CONF and
OMNI_CLUSTER_DIR, nothing else of root's). That process tells the rest of the story as the user:
``~/omni-demo`` and every file in it, the placement sample (the user's own ``sbatch``), the manager,
``omni submit``, the reference run, the report, the cleanup of the jobs it submitted. Root writes
nothing under the home, reads nothing there and submits nothing.

What the user's side needs from root is a node set DOWN for the drill and RESUMEd afterwards. It asks
over a socket pair, one JSON line per request (formats/demo_session.py); root does it only for a node
of the embedded cluster, resumes only the nodes it set down, and resumes those still down when the
user's side ends, however it ends.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.drill.inject import DrillError, Injector
from slurm_omni.errors import OmniError
from slurm_omni.formats import RecordRejected, decode, encode
from slurm_omni.formats.demo_session import MAX_MESSAGE_BYTES, NodeReply, NodeRequest, SessionStart
from slurm_omni.fsio import one_line

SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def user_environment(pw: pwd.struct_passwd, cluster: LocalCluster) -> dict[str, str]:
    """The whole environment of the user's side: this ``omni`` first on PATH (the cluster's client
    wrappers next, for a Slurm from a Debian root), the user's own HOME, USER and LOGNAME, and which
    cluster to talk to. Nothing of root's environment (its secrets, its tool paths) comes along."""
    path = [str(Path(sys.executable).parent)]
    if cluster.spec.in_root:
        path.append(str(cluster.paths.bin))
    path += [p for p in SYSTEM_PATH if p not in path]
    return {"PATH": os.pathsep.join(path), "HOME": pw.pw_dir, "USER": pw.pw_name, "LOGNAME": pw.pw_name,
            "SLURM_CONF": str(cluster.paths.slurm_conf), "OMNI_CLUSTER_DIR": str(cluster.paths.root)}


def _read_line(stream: BinaryIO) -> bytes:
    """One message; b"" at the end of the session. A line past the bound ends it too."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if len(line) > MAX_MESSAGE_BYTES or (line and not line.endswith(b"\n")):
        raise DrillError(f"demo: couldn't read the session socket: a message longer than {MAX_MESSAGE_BYTES} "
                         "bytes or cut short")
    return line


class NodeBroker:
    """Root's side: a node of the embedded cluster DOWN and back, on the user's side's request."""

    def __init__(self, injector: Injector, nodes: tuple[str, ...]) -> None:
        self.injector = injector
        self.nodes = frozenset(nodes)
        self.downed: list[str] = []

    def handle(self, request: NodeRequest) -> NodeReply:
        if request.node not in self.nodes:
            return NodeReply(ok=False, error=f"demo: couldn't {request.op} {request.node}: not a node of the "
                                             "embedded cluster")
        if request.op == "resume" and request.node not in self.downed:
            return NodeReply(ok=False, error=f"demo: couldn't resume {request.node}: root resumes only the "
                                             "nodes it set down for this demo")
        try:
            if request.op == "down":
                self.injector.node_down(request.node)
                if request.node not in self.downed:
                    self.downed.append(request.node)
            else:
                self.injector.resume(request.node)
                self.downed.remove(request.node)
        except OmniError as e:
            return NodeReply(ok=False, error=one_line(str(e), 900))
        return NodeReply(ok=True)

    def serve(self, sock: socket.socket) -> None:
        """Requests until the user's side closes its end."""
        with sock.makefile("rb") as stream:
            while line := _read_line(stream):
                try:
                    reply = self.handle(decode(line, NodeRequest, "the demo's node request"))
                except RecordRejected as e:
                    reply = NodeReply(ok=False, error=one_line(str(e), 900))
                sock.sendall(encode(reply))

    def restore(self) -> list[str]:
        """Every node still down because of this demo, resumed; what was done."""
        done = []
        for node in list(self.downed):
            try:
                self.injector.resume(node)
                self.downed.remove(node)
                done.append(f"{node} resumed")
            except OmniError as e:
                done.append(f"couldn't resume {node}: {e}")
        return done


def run_user_side(user: str, cluster: LocalCluster, argv: list[str], start: SessionStart,
                  say: Callable[[str], None]) -> int:
    """``argv`` (``omni demo ...``) as ``user`` with ``--user-session FD``, serving its node requests;
    its exit code. ^C reaches the user's side from the terminal (it cleans up and ends); a SIGTERM to
    root is passed on to it."""
    from slurm_omni.slurm.cli_backend import CliBackend

    pw = pwd.getpwnam(user)
    backend = CliBackend(env=cluster.env, timeout_s=20, retries=3)
    nodes = tuple(cluster.spec.node_names)
    broker = NodeBroker(Injector(allowed=nodes, site=f"the embedded cluster in {cluster.paths.root}",
                                 backend=backend, cluster=cluster), nodes)
    ours, theirs = socket.socketpair()
    with ours:
        try:
            with theirs:
                proc = subprocess.Popen([*argv, "--user-session", str(theirs.fileno())],
                                        env=user_environment(pw, cluster), cwd=pw.pw_dir, user=pw.pw_uid,
                                        group=pw.pw_gid, extra_groups=os.getgrouplist(pw.pw_name, pw.pw_gid),
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as e:
            raise OmniError(f"demo: couldn't start the demo as {user}: {e}") from e
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        old_term = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            try:
                ours.sendall(encode(start))
                broker.serve(ours)
            except (BrokenPipeError, ConnectionResetError):
                pass   # the user's side ended early: its exit code and its own line say why
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            for line in broker.restore():
                say(f"cleanup: {line}")


class RootNodes:
    """The user's side of the socket: the session's start, and node changes asked of root."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.stream = self.sock.makefile("rb")
        line = _read_line(self.stream)
        if not line:
            raise DrillError("demo: couldn't start the user's side: root closed the session")
        self.start = decode(line, SessionStart, "the demo's session start")

    def close(self) -> None:
        self.stream.close()
        self.sock.close()

    def request(self, op: Literal["down", "resume"], node: str) -> None:
        self.sock.sendall(encode(NodeRequest(op=op, node=node)))
        line = _read_line(self.stream)
        if not line:
            raise DrillError(f"demo: couldn't {op} {node}: root closed the session")
        reply = decode(line, NodeReply, "root's reply")
        if not reply.ok:
            raise DrillError(reply.error)


class BrokeredInjector(Injector):
    """The drills' node changes through root (``omni demo --user``); everything else as the user."""

    def __init__(self, root: RootNodes, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.root = root

    def node_down(self, node: str) -> float:
        self.check(node)
        at = time.time()
        self.root.request("down", node)
        self.downed.add(node)
        return at

    def resume(self, node: str, *, wait_s: float = 60.0) -> None:
        self.check(node)
        self.root.request("resume", node)
