"""The plugin's parsers and fault-record writer, driven through tests/spank/harness.c."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
from spank_support import run_harness


@pytest.mark.parametrize(("arg", "parsed"), [
    ("vision", ["vision -1"]),
    ("vision,text", ["vision -1", "text -1"]),
    ("vision:4,text:8", ["vision 4", "text 8"]),
    ("a.b-c_d:1", ["a.b-c_d 1"]),
])
def test_stage_values_accepted(harness: Path, arg: str, parsed: list[str]) -> None:
    r = run_harness(harness, "stages", arg)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines() == parsed


@pytest.mark.parametrize(("arg", "message"), [
    ("", "empty value"),
    ("bad name", "stage name 'bad name' is not allowed"),
    ("vision,", "stage name '' is not allowed"),
    (",text", "stage name '' is not allowed"),
    ("vision:0", "task count '0' is not allowed"),
    ("vision:-1", "task count '-1' is not allowed"),
    ("vision:x", "task count 'x' is not allowed"),
    ("vision:", "task count '' is not allowed"),
    ("vision:99999999999999999999999", "task count"),
    ("vision,vision", "stage 'vision' given twice"),
    ("$(reboot)", "is not allowed"),
    ("x" * 64, "expected 1 to 63 characters"),
    (",".join(f"s{i}" for i in range(17)), "more than 16 stages"),
])
def test_stage_values_refused_with_one_line(harness: Path, arg: str, message: str) -> None:
    r = run_harness(harness, "stages", arg)
    assert r.returncode == 1
    assert len(r.stdout.splitlines()) == 1
    assert message in r.stdout


@pytest.mark.parametrize(("arg", "ok"), [
    ("/shared/ckpt", True),
    ("/with space/and'quote", True),
    ("relative/dir", False),
    ("", False),
    ("/new\nline", False),
    ("/" + "x" * 5000, False),
])
def test_ckpt_path_checked(harness: Path, arg: str, ok: bool) -> None:
    r = run_harness(harness, "path", arg)
    assert (r.returncode == 0) is ok, r.stdout


@pytest.mark.parametrize(("args", "out"), [
    ([], "spool=\n"),
    (["spool=/var/spool/omni"], "spool=/var/spool/omni\n"),
    (["spool=relative"], "spool=relative: not allowed (expected an absolute path)\n"),
    (["spool=/s", "memory_dir=/dev/hugeshm/%n"], "spool=/s\nmemory_dir=/dev/hugeshm/%n\n"),
    (["memory_dir=shm"], "memory_dir=shm: not allowed (expected an absolute path)\n"),
    (["spoolish=/x"], "unknown plugin argument 'spoolish=/x' (allowed: spool=DIR, memory_dir=DIR)\n"),
])
def test_plugin_arguments(harness: Path, args: list[str], out: str) -> None:
    assert run_harness(harness, "config", *args).stdout == out


@pytest.mark.parametrize(("stages", "het_offset", "comp_rank", "comp_size", "rank", "size", "placed"), [
    ("vision,text", 0, 1, 2, 1, 4, "vision 1 2"),
    ("vision,text", 1, 0, 2, 2, 4, "text 0 2"),
    ("vision:2,text:6", -1, 0, 0, 1, 8, "vision 1 2"),
    ("vision:2,text:6", -1, 0, 0, 2, 8, "text 0 6"),
    ("vision:2,text:6", -1, 0, 0, 7, 8, "text 5 6"),
    ("solo", -1, 0, 0, 3, 4, "solo 3 4"),
    ("solo", 1, 1, 2, 3, 4, "solo 1 2"),
])
def test_placement(harness: Path, stages: str, het_offset: int, comp_rank: int, comp_size: int, rank: int,
                   size: int, placed: str) -> None:
    r = run_harness(harness, "place", stages, *map(str, (het_offset, comp_rank, comp_size, rank, size)))
    assert (r.returncode, r.stdout.strip()) == (0, placed)


@pytest.mark.parametrize(("stages", "args", "message"), [
    ("vision,text", (2, 0, 1, 0, 1), "het component 2 has no stage"),
    ("vision,text", (-1, 0, 0, 0, 4), "needs a task count"),
    ("vision:2,text:2", (-1, 0, 0, 0, 8), "stages name 4 tasks but the step has 8"),
])
def test_placement_refused(harness: Path, stages: str, args: tuple[int, ...], message: str) -> None:
    r = run_harness(harness, "place", stages, *map(str, args))
    assert r.returncode == 1 and message in r.stdout


def _spool(tmp_path: Path) -> Path:
    """A spool root as the admin makes it: root's, 0755 (users reach only their own 0700 directory)."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    return spool


def test_fault_record_for_a_signal(harness: Path, tmp_path: Path) -> None:
    spool = _spool(tmp_path)
    r = run_harness(harness, "fault", str(spool), "root", "node5", "text", str(signal.SIGKILL))
    assert r.returncode == 0, r.stdout
    path = Path(r.stdout.strip())
    assert path.parent == spool / "root" and path.name.startswith("fault-42.0-node5-3-")
    assert sorted(os.listdir(path.parent)) == [path.name]            # no temp file left behind
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    record = json.loads(path.read_text())
    assert record == {
        "version": 1, "kind": "task_exit", "job_id": 42, "het_job_id": 41, "het_offset": 1, "step_id": 0,
        "node": "node5", "stage": "text", "stage_index": 1, "stage_rank": 3, "task_id": 3, "local_task_id": 1, "pid": 1234,
        "exit_code": None, "signal": 9, "core_dumped": False, "time": "2023-11-14T22:13:20.005Z",
        "time_unix": 1700000000.005}


def test_fault_record_for_an_exit_code(harness: Path, tmp_path: Path) -> None:
    r = run_harness(harness, "fault", str(_spool(tmp_path)), "root", "node1", "vision", str(3 << 8))
    record = json.loads(Path(r.stdout.strip()).read_text())
    assert (record["exit_code"], record["signal"]) == (3, None)


def test_fault_record_escapes_hostile_names(harness: Path, tmp_path: Path) -> None:
    node = 'n"\\1\n\t$(x)/../' + "y" * 200
    spool = _spool(tmp_path)
    r = run_harness(harness, "fault", str(spool), "root", node, "v", "9")
    path = Path(r.stdout.strip())
    assert path.parent == spool / "root"                           # "/" and ".." cannot leave the spool
    assert json.loads(path.read_text())["node"] == node


def test_fault_record_into_missing_spool_fails_cleanly(harness: Path, tmp_path: Path) -> None:
    r = run_harness(harness, "fault", str(tmp_path / "absent"), "root", "n", "v", "9")
    assert r.returncode == 1
    assert r.stdout.startswith("couldn't open spool ") and "No such file or directory" in r.stdout


@pytest.mark.parametrize("mode, line", [
    (0o775, "couldn't use spool {spool}: owned by uid 0 with mode 0775 (expected root's, not group/other writable)"),
    (0o1777, "couldn't use spool {spool}: owned by uid 0 with mode 1777 (expected root's, not group/other writable)"),
])
def test_a_spool_root_others_can_write_is_refused(harness: Path, tmp_path: Path, mode: int, line: str) -> None:
    spool = _spool(tmp_path)
    spool.chmod(mode)
    r = run_harness(harness, "fault", str(spool), "root", "n", "v", "9")
    assert (r.returncode, r.stdout.strip()) == (1, line.format(spool=spool))
    assert not (spool / "root").exists()


def test_a_user_directory_that_is_a_link_or_writable_by_others_is_refused(harness: Path, tmp_path: Path) -> None:
    spool = _spool(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (spool / "root").symlink_to(elsewhere)
    r = run_harness(harness, "fault", str(spool), "root", "n", "v", "9")
    assert r.stdout.strip() == f"couldn't open {spool}/root: Not a directory"   # O_NOFOLLOW | O_DIRECTORY
    assert os.listdir(elsewhere) == []
    (spool / "root").unlink()
    (spool / "root").mkdir(mode=0o700)
    (spool / "root").chmod(0o733)
    r = run_harness(harness, "fault", str(spool), "root", "n", "v", "9")
    assert r.stdout.strip() == f"couldn't use {spool}/root: owned by uid 0 with mode 0733 (expected uid 0, " \
                               "not group/other writable)"
    assert os.listdir(spool / "root") == []
