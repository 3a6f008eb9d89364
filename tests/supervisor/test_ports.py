"""The supervisor's rendezvous port check on real sockets: a port something listens on is skipped
(rank 0's store would fail on it at once, exit 1), and a master that is not this host is not probed."""

from __future__ import annotations

import socket
from pathlib import Path

from slurm_omni.supervisor import ports


def _listener() -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_port_another_program_listens_on_is_skipped() -> None:
    held, port = _listener()
    with held:
        free = next(p for p in range(port + 1, port + 200) if not ports.in_use(p))
        assert ports.in_use(port)
        assert ports.pick([port, free], master="127.0.0.1") == (free, [port])
    assert not ports.in_use(port)              # let go: free again


def test_a_master_elsewhere_gets_the_first_candidate_unprobed() -> None:
    held, port = _listener()
    with held:
        assert not ports.is_local("192.0.2.1")     # TEST-NET-1: never this host's
        assert ports.pick([port, port + 1], master="192.0.2.1") == (port, [])
        assert ports.is_local("127.0.0.1")


def test_every_candidate_taken_gives_the_first_and_names_them_all() -> None:
    a, pa = _listener()
    b, pb = _listener()
    with a, b:
        assert ports.pick([pa, pb], master="127.0.0.1") == (pa, [pa, pb])


def test_the_ephemeral_range_is_read_from_proc(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ports.ephemeral_range(f) == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) is None
    assert ports.ephemeral_range(tmp_path / "none") is None
