"""The rendezvous port check on real sockets: a port something listens on is skipped (rank 0's store
would fail on it at once, exit 1); when every candidate is taken, a port the OS picks; the check as
a program (what a one-task step on a remote master, and the batch scripts, run)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.steps import pick_port_on
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
        assert ports.pick([port, free]) == (free, [port])
    assert not ports.in_use(port)              # let go: free again


def test_every_candidate_taken_gives_a_port_the_os_picks_and_names_them_all() -> None:
    a, pa = _listener()
    b, pb = _listener()
    with a, b:
        port, taken = ports.pick([pa, pb])
        assert taken == [pa, pb] and port not in (pa, pb) and not ports.in_use(port)


def test_only_this_host_is_local() -> None:
    assert not ports.is_local("192.0.2.1")     # TEST-NET-1: never this host's
    assert ports.is_local("127.0.0.1")


def test_the_check_as_a_program_prints_the_port_and_the_taken_ones() -> None:
    held, port = _listener()
    with held:
        out = subprocess.run([sys.executable, "-m", "slurm_omni.supervisor.ports", str(port)], capture_output=True,
                             text=True, check=True).stdout
        picked, taken = ports.parse_pick(out) or (0, [])
        assert taken == [port] and picked != port and 0 < picked < 65536
        job = subprocess.run([sys.executable, "-m", "slurm_omni.supervisor.ports", "--job", "4242", "--launch", "1"],
                             capture_output=True, text=True, check=True).stdout
        assert ports.parse_pick(job) is not None
    bad = subprocess.run([sys.executable, "-m", "slurm_omni.supervisor.ports", "x"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 64 and bad.stderr.startswith("ports: couldn't read the candidates")


@pytest.mark.parametrize(("text", "parsed"), [
    ("20001\n", (20001, [])), ("41000 20001,21010\n", (41000, [20001, 21010])), ("", None), ("x", None),
    ("0", None), ("20001 a", None), ("1 2 3", None), ("70000", None),
])
def test_the_programs_answer_is_parsed(text: str, parsed: tuple[int, list[int]] | None) -> None:
    assert ports.parse_pick(text) == parsed


def test_the_ephemeral_range_is_read_from_proc(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ports.ephemeral_range(f) == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) is None
    assert ports.ephemeral_range(tmp_path / "none") is None


@pytest.mark.cluster
def test_a_remote_master_is_checked_by_a_one_task_step_on_it(slurm_cluster) -> None:
    """What the supervisor runs for a master that is not its host: the check as a step on that node
    (outside an allocation srun makes its own; every node of the embedded cluster is this machine)."""
    held, port = _listener()
    with held:
        out = pick_port_on(CommandRunner(slurm_cluster.env), slurm_cluster.nodes[2], [port], name="omni-test-port",
                           python=sys.executable)
        picked = ports.parse_pick(out)
        assert picked is not None and picked[1] == [port] and picked[0] != port, out
