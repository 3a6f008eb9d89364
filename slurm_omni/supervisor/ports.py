"""A rendezvous port that is free on the master's host: the supervisor asks before each launch, the
batch scripts of the resubmission path before their one step.

Rank 0 of a launch listens on MASTER_PORT (torch's TCPStore) and fails at once, exit 1, when
anything else listens there: another job's store on a shared node, on the embedded cluster (every
node is this machine) another engineer's job, or another user who holds the candidates on purpose:
they follow from the public job id (``policy.supervision.rendezvous_ports``), so they are only a
first guess. The check runs on the master's host itself: it binds each candidate as the store will
and lets it go; when every candidate is taken, the port is one the OS picks there (bind port 0),
which nobody can know before rank 0 listens on it. A master that is not this host is asked through
a one-task step on it (``slurm.steps.pick_port_on``, running this module).

    python -m slurm_omni.supervisor.ports PORT...              first free of these, else the OS's
    python -m slurm_omni.supervisor.ports --job ID --launch N  the same for the job's candidates

prints ``PORT`` and, when some were skipped, ``TAKEN,TAKEN...`` on the same line.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Iterable, Sequence
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


def os_port() -> int:
    """A port free on this host that the OS picks (bind port 0 on every address, as the store binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def pick(candidates: Iterable[int]) -> tuple[int, list[int]]:
    """On this host (the master's): the first candidate free, else one the OS picks; and the
    candidates skipped because they were taken."""
    taken: list[int] = []
    for port in candidates:
        if not in_use(port):
            return port, taken
        taken.append(port)
    return os_port(), taken


def format_pick(port: int, taken: Sequence[int]) -> str:
    return f"{port} {','.join(map(str, taken))}".rstrip()


def parse_pick(text: str) -> tuple[int, list[int]] | None:
    """What ``format_pick`` printed (the last line of the output), or None."""
    lines = text.strip().splitlines()
    fields = lines[-1].split() if lines else []
    try:
        port = int(fields[0])
        taken = [int(p) for p in fields[1].split(",")] if len(fields) == 2 else []
    except (IndexError, ValueError):
        return None
    if len(fields) > 2 or not 0 < port < 65536:
        return None
    return port, taken


def main(argv: Sequence[str]) -> int:
    from slurm_omni.policy.supervision import rendezvous_ports

    args = list(argv)
    try:
        if args[:1] == ["--job"] and len(args) == 4 and args[2] == "--launch":
            candidates: Sequence[int] = rendezvous_ports(args[1], int(args[3]), avoid=ephemeral_range())
        else:
            candidates = [int(a) for a in args]
        if not candidates or not all(0 < p < 65536 for p in candidates):
            raise ValueError(" ".join(args))
    except ValueError:
        print(f"ports: couldn't read the candidates: {' '.join(args)!r} (PORT... or --job ID --launch N)",
              file=sys.stderr)
        return 64
    print(format_pick(*pick(candidates)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
