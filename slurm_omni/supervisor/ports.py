"""Is a rendezvous port free on the master's host? The supervisor asks before each launch.

Rank 0 of a launch listens on MASTER_PORT (torch's TCPStore) and fails at once, exit 1, when
anything else listens there: another job's store on a shared node or, on the embedded cluster
(every node is this machine), another engineer's job. The supervisor can tell only for a master
that is its own host (the batch host, or any node of the embedded cluster): it binds the port
itself, as the store will, and lets it go. For a master elsewhere it cannot, and takes the first
candidate; a launch that fails at start-up is relaunched with the next launch's ports
(``policy.supervision``).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from pathlib import Path

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = EPHEMERAL) -> tuple[int, int] | None:
    """The host's ephemeral port range (where outgoing connections take ports), None if unreadable."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return (low, high) if 0 < low <= high else None


def is_local(address: str) -> bool:
    """``address`` is one of this host's: a socket can be bound to it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


def in_use(port: int) -> bool:
    """Something on this host holds ``port`` (a listener, or a connection's end): binding it on every
    address fails as the store's listen would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            return e.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def pick(candidates: Iterable[int], *, master: str) -> tuple[int, list[int]]:
    """The first candidate free on ``master`` (when it is this host; else simply the first) and the
    candidates skipped because they were taken."""
    ports = list(candidates)
    if not ports:
        raise ValueError("no rendezvous port candidates")
    if not is_local(master):
        return ports[0], []
    taken: list[int] = []
    for port in ports:
        if not in_use(port):
            return port, taken
        taken.append(port)
    return ports[0], taken
