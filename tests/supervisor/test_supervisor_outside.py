"""Allocation mode's supervisor process (supervisor/outside.py): one per job at a time, its record
read strictly, and whether it still runs, told from /proc (no cluster needed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from support import wait_until

from slurm_omni.formats.supervisor_process import SupervisorProcess, encode_process
from slurm_omni.supervisor.outside import hold_lock, process_alive, process_path, read_process, write_process


def test_one_supervisor_per_job_holds_the_lock_until_it_leaves(tmp_path: Path) -> None:
    fd = hold_lock(tmp_path, "2001")
    assert fd is not None
    # another process (a second supervisor) does not get it while this one lives
    probe = ("import sys; from pathlib import Path; from slurm_omni.supervisor.outside import hold_lock; "
             "sys.exit(0 if hold_lock(Path(sys.argv[1]), '2001') is None else 3)")
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)], timeout=60, check=False).returncode == 0
    assert hold_lock(tmp_path, "2002") is not None            # another job's lock is its own
    os.close(fd)
    assert subprocess.run([sys.executable, "-c", probe, str(tmp_path)], timeout=60, check=False).returncode == 3


def test_the_process_record_round_trips_and_a_bad_one_reads_as_none(tmp_path: Path) -> None:
    written = write_process(tmp_path, "2001")
    assert read_process(tmp_path, "2001") == written and written.pid == os.getpid()
    assert read_process(tmp_path, "2002") is None
    path = process_path(tmp_path, "2001")
    for bad in (b"{}", b'{"version": 1, "slurm_job_id": "2001; rm", "host": "h", "pid": 5, "started_at": 1.0}',
                b'{"version": 1, "slurm_job_id": "2001", "host": "h", "pid": 5, "started_at": 1.0, "argv": []}',
                b"not json"):
        path.write_bytes(bad)
        assert read_process(tmp_path, "2001") is None
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    assert read_process(tmp_path, "2001") is None


def _record(pid: int, host: str = "", job: str = "2001") -> SupervisorProcess:
    return SupervisorProcess(version=1, slurm_job_id=job, host=host or socket.gethostname(), pid=pid, started_at=1.0)


def test_alive_means_this_users_omni_supervise_of_that_job_on_this_host(tmp_path: Path) -> None:
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "supervise", "--allocation=2001"])
    try:
        # until it has exec'd: right after fork its /proc cmdline is still this test's
        wait_until(lambda: b"--allocation=2001" in Path(f"/proc/{fake.pid}/cmdline").read_bytes(), 30, "the exec")
        assert process_alive(_record(fake.pid)) is True
        assert process_alive(_record(fake.pid, job="2002")) is False     # another job's supervisor
        assert process_alive(_record(os.getpid())) is False               # a reused pid running something else
        assert process_alive(_record(fake.pid, host="elsewhere.invalid")) is None   # cannot tell from here
    finally:
        fake.kill()
        fake.wait()
    assert process_alive(_record(fake.pid)) is False


def test_the_record_schema_is_closed() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"version": 2, "slurm_job_id": "1", "host": "h", "pid": 5, "started_at": 1.0}',
                            type=SupervisorProcess, strict=True)
    assert encode_process(_record(42)).endswith(b"\n")


def test_the_pools_salloc_comes_as_a_json_argv_or_is_refused_in_one_line() -> None:
    import pytest

    from slurm_omni.cli.supervise import _pool_salloc
    from slurm_omni.errors import ConfigError

    assert _pool_salloc("") == ()
    assert _pool_salloc('["salloc", "--no-shell", "--nodes=4"]') == ("salloc", "--no-shell", "--nodes=4")
    for bad in ("salloc --no-shell", '["salloc"]', '[1, 2]', '{"a": 1}'):
        with pytest.raises(ConfigError, match="OMNI_POOL_SALLOC"):
            _pool_salloc(bad)
