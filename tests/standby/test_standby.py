"""The warm standby: a real server process (torch imported once) and the stdlib client that hands it
a task's environment and file descriptors; the forked trainer's output and exit status come back."""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_omni.standby import CLIENT, through_standby


def test_through_standby_rewrites_only_omni_train() -> None:
    drill = ("bash", "-c", "exec \"$@\"", "omni-drill", "omni", "train", "--config", "/j.toml")
    out = through_standby(drill)
    assert out[:4] == drill[:4] and out[4:8] == (sys.executable, "-S", str(CLIENT), "node")
    assert out[8:] == ("--", "train", "--config", "/j.toml")
    assert through_standby(("python", "my_train.py")) == ("python", "my_train.py")
    py = ("/usr/bin/python3", "-m", "slurm_omni.cli.main", "train", "--config", "/j.toml")
    assert through_standby(py) == (sys.executable, "-S", str(CLIENT), "node", "--", "train", "--config",
                                   "/j.toml")


@pytest.fixture(scope="module")
def server_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real standby server (torch imported once), shared by this module's tests."""
    tmp_path = tmp_path_factory.mktemp("standby")
    folder = tmp_path / "standby"
    folder.mkdir(mode=0o700)
    sock = folder / "s.sock"
    code = ("import sys; from pathlib import Path; from slurm_omni.standby.server import serve; "
            "serve(Path(sys.argv[1]), ready=Path(sys.argv[2]))")
    server = subprocess.Popen([sys.executable, "-c", code, str(sock), str(tmp_path / "ready")])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline and server.poll() is None:
            time.sleep(0.1)
        assert (tmp_path / "ready").exists(), "the standby server never became ready"
        yield sock
    finally:
        server.kill()
        server.wait()


def test_a_client_runs_its_command_in_a_forked_warm_trainer(server_socket: Path, tmp_path: Path) -> None:
    sock = server_socket
    env = {**os.environ, "OMNI_STANDBY_TEST": "passed through"}
    done = subprocess.run([sys.executable, "-S", str(CLIENT), str(sock), "--", "--version"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert "slurm-omni" in done.stdout          # printed by the forked trainer onto the client's stdout
    bad = subprocess.run([sys.executable, "-S", str(CLIENT), str(sock), "--", "no-such-command"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "no-such-command" in (bad.stderr + bad.stdout)
    # no server: a cold start of the same command
    cold = subprocess.run([sys.executable, "-S", str(CLIENT), str(tmp_path / "none.sock"), "--", "--version"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert cold.returncode == 0 and "slurm-omni" in cold.stdout


def test_a_trainer_that_raises_prints_its_traceback_on_the_tasks_stderr(server_socket: Path, tmp_path: Path) -> None:
    """An exception that is not the CLI's own (here: the task's working folder is gone) ends the forked
    trainer with 1 and its traceback on the task's stderr, as a cold ``python -m`` would: a relaunched
    rank that exited 1 with no output at all was undiagnosable."""
    out, err = tmp_path / "out", tmp_path / "err"
    with open(os.devnull, "rb") as stdin, open(out, "wb") as o, open(err, "wb") as e, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(server_socket))
        hello = json.dumps({"env": dict(os.environ), "cwd": str(tmp_path / "gone"), "argv": ["--version"]})
        fds = array.array("i", [stdin.fileno(), o.fileno(), e.fileno()])
        conn.sendmsg([hello.encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        answers = b""
        while answers.count(b"\n") < 2:
            chunk = conn.recv(4096)
            assert chunk, f"the server closed after {answers!r}"
            answers += chunk
    first, done = (json.loads(line) for line in answers.splitlines()[:2])
    assert first["pid"] > 0 and os.WIFEXITED(done["status"]) and os.WEXITSTATUS(done["status"]) == 1
    text = err.read_text()
    assert "Traceback" in text and "FileNotFoundError" in text and str(tmp_path / "gone") in text, text
    assert out.read_text() == ""     # --version never ran


def test_a_server_that_closes_before_the_trainer_starts_is_one_line_on_the_tasks_stderr(tmp_path: Path) -> None:
    """The client's side alone: a server that takes the hello and goes (it was killed, or refused the
    peer) leaves the task exiting 1 with a line naming the socket, not silently."""
    import socket
    import threading

    sock_path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)

    def take_and_close() -> None:
        conn, _ = srv.accept()
        _, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * 4))
        for _, _, data in anc:   # the task's stdin/stdout/stderr: held here, its pipes would never close
            for i in range(0, len(data) - len(data) % 4, 4):
                os.close(int.from_bytes(data[i:i + 4], sys.byteorder))
        conn.close()

    thread = threading.Thread(target=take_and_close, daemon=True)
    thread.start()
    try:
        done = subprocess.run([sys.executable, "-S", str(CLIENT), str(sock_path), "--", "--version"],
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        thread.join(timeout=10)
        srv.close()
    assert done.returncode == 1
    assert done.stderr.strip() == (f"omni standby client: the standby server at {sock_path} closed the connection "
                                   "before starting the trainer (its log is the job's standby step output)")
