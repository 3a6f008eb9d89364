"""The job epilog's removal of a job's shared-memory objects (spank/shm.c), driven through the harness
on a 1777 folder of /dev/shm laid out as the ranks, the memory tier and a hostile user leave it. Runs
as root (the epilog does): the objects are handed to two uids that need no account."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from spank_support import run_harness

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.memtier import base_from_env
from slurm_omni.elastic.heartbeat import _safe as beats_safe

ALICE, BOB = 4242, 4343   # the job's owner and another user
JOB = "7"


def _own(path: Path, uid: int) -> Path:
    for root, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.lchown(os.path.join(root, name), uid, uid)
    os.lchown(path, uid, uid)
    return path


def _beats(shm: Path, node: str, *, uid: int = ALICE, job: str = JOB) -> Path:
    folder = shm / f"omni-beats-{ALICE}-{job}-{node}"
    folder.mkdir(mode=0o700)
    (folder / "rank-0.json").write_text("{}")
    (folder / "lock").write_text("")
    return _own(folder, uid)


def _memtier(shm: Path, job: str = JOB) -> Path:
    folder = shm / f"omni-{ALICE}" / job
    (folder / "peer").mkdir(parents=True, mode=0o700)
    (folder / "step-30.rank-00000.j.1.h5").write_bytes(b"x" * 1000)
    (folder / "step-31.rank-00000.j.1.h5.partial").write_bytes(b"x" * 10)
    (folder / "peer" / "step-30.rank-00002.j.1.h5").write_bytes(b"y" * 100)
    _own(shm / f"omni-{ALICE}", ALICE)
    return folder


@pytest.fixture
def shm() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("the epilog runs as root: chown and setfsuid need it")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    path = Path("/dev/shm") / f"omni-epilog-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    path.chmod(0o1777)   # as /dev/shm: every uid makes its own names, sticky
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _clean(harness: Path, shm: Path, node: str, whole_job: bool, *ids: str) -> str:
    r = run_harness(harness, "shm-clean", str(shm), str(ALICE), str(ALICE), node, str(int(whole_job)), *ids)
    assert r.returncode == 0, r.stdout
    return r.stdout.strip()


@pytest.mark.parametrize(("pattern", "node", "out"), [
    ("/dev/hugeshm", "node1", "/dev/hugeshm"),
    ("/dev/shm/x/%n", "node1", "/dev/shm/x/node1"),
    ("/m/%n/%n", "n/../a", "/m/n_.._a/n_.._a"),     # the node's name cannot leave the folder
    ("/m/%x%", "n", "/m/%x%"),
    ("/m/%n", "n" * 70, "too long"),
])
def test_memory_dir_names_the_node_as_the_tier_does(harness: Path, pattern: str, node: str, out: str) -> None:
    assert run_harness(harness, "expand", pattern, node).stdout.strip() == out
    if out != "too long":
        assert out == str(base_from_env({"OMNI_MEMORY_DIR": pattern, "SLURMD_NODENAME": node}))


@pytest.mark.parametrize(("hostlist", "many"), [
    ("node1", 0), ("node[5]", 0), ("gpu-a1", 0), ("rack-1-n2", 0),
    ("node[1-3]", 1), ("n1,n2", 1), ("node[1,4]", 1), ("gpu-a[1-2]", 1), ("a[1]-b[2-3]", 1),
])
def test_a_host_list_of_one_node_or_more(harness: Path, hostlist: str, many: int) -> None:
    assert run_harness(harness, "hostlist", hostlist).stdout.strip() == str(many)


@pytest.mark.parametrize(("name", "node", "match"), [
    (f"omni-beats-{ALICE}-7-node1", "node1", 1),
    (f"omni-beats-{ALICE}-7-node1", None, 1),
    (f"omni-beats-{ALICE}-7-node1", "node2", 0),
    (f"omni-beats-{ALICE}-6-node1", None, 1),        # the het leader's id (what its tasks call the job)
    (f"omni-beats-{ALICE}-77-node1", None, 0),       # another job whose id starts alike
    (f"omni-beats-{ALICE}-7-", None, 0),             # no node
    (f"omni-beats-{BOB}-7-node1", None, 0),          # another uid's name
    (f"omni-beats-{ALICE}7-node1", None, 0),
    (f"omni-beats-{ALICE}-7-gpu_a.1", "gpu a.1", 1),   # the node's name as the ranks write it
    (f"omni-{ALICE}", None, 0),
])
def test_heartbeat_folder_names_of_the_job(harness: Path, name: str, node: str | None, match: int) -> None:
    args = ["beats-name", str(ALICE), "7", "6", name, *([node] if node is not None else [])]
    assert run_harness(harness, *args).stdout.strip() == str(match)


@pytest.mark.parametrize(("job", "node"), [("7", "node1"), ("123456", "gpu-a1.rack 2"), ("8", "n/../x")])
def test_names_match_what_the_python_side_writes(harness: Path, job: str, node: str) -> None:
    """The ranks name their folder with heartbeat._safe, the memory tier with format.safe_name."""
    name = f"omni-beats-{ALICE}-{beats_safe(job)}-{beats_safe(node)}"
    assert run_harness(harness, "beats-name", str(ALICE), job, "", name, node).stdout.strip() == "1"
    assert fmt.safe_name(job) == job


@pytest.mark.parametrize(("whole_job", "per_node_dir", "others", "due"), [
    (1, 0, 3, 1), (0, 1, 3, 1), (0, 0, 0, 1), (0, 0, 1, 0),
])
def test_when_the_memory_tier_folder_goes(harness: Path, whole_job: int, per_node_dir: int, others: int,
                                          due: int) -> None:
    assert run_harness(harness, "memtier-due", str(whole_job), str(per_node_dir), str(others)).stdout.strip() == str(due)


def test_the_job_end_removes_every_node_s_objects_of_the_job_and_nothing_else(harness: Path, shm: Path) -> None:
    for node in ("node1", "node2", "node3"):
        _beats(shm, node)
    _memtier(shm)
    other_job = _memtier(shm, "8")
    other_beats = _beats(shm, "node1", job="8")
    out = _clean(harness, shm, "node1", True, JOB)
    assert out.startswith("removed=5 bytes=1116 others=0 kept=0"), out   # 3 beats folders, the job's, peer/
    assert sorted(p.name for p in shm.iterdir()) == [f"omni-{ALICE}", other_beats.name]
    assert sorted(p.name for p in other_job.parent.iterdir()) == ["8"]


def test_one_node_leaving_a_running_job_keeps_the_shared_memory_tier(harness: Path, shm: Path) -> None:
    """A shrink ends the job on one node only: on one /dev/shm shared by the job's other nodes (the
    embedded cluster), the memory tier's folder stays until the last of them ends."""
    _beats(shm, "node1")
    _beats(shm, "node2")
    job = _memtier(shm)
    assert _clean(harness, shm, "node2", False, JOB).startswith("removed=1 bytes=2 others=1 kept=0")
    assert job.is_dir() and (shm / f"omni-beats-{ALICE}-{JOB}-node1").is_dir()
    assert _clean(harness, shm, "node1", False, JOB).startswith("removed=3 bytes=1112 others=0 kept=0")
    # omni-<uid>/ stays, empty: the user's next job on the node may be making its folder in it
    assert [p.name for p in shm.iterdir()] == [f"omni-{ALICE}"] and list(job.parent.iterdir()) == []


def test_a_het_job_is_cleaned_by_its_leader_s_id(harness: Path, shm: Path) -> None:
    _beats(shm, "node4", job="6")
    _memtier(shm, "6")
    assert _clean(harness, shm, "node4", True, "7", "6").startswith("removed=3")
    assert [p.name for p in shm.iterdir()] == [f"omni-{ALICE}"]


def test_planted_links_and_other_users_folders_survive(harness: Path, shm: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("root's")
    _beats(shm, "node1")
    (shm / f"omni-beats-{ALICE}-{JOB}-node2").symlink_to(victim)                 # a link with the job's name
    os.lchown(shm / f"omni-beats-{ALICE}-{JOB}-node2", ALICE, ALICE)
    bobs = _beats(shm, "node3", uid=BOB)                                           # bob's, with the job's name
    inside = shm / f"omni-beats-{ALICE}-{JOB}-node1"
    (inside / "rank-1.json").symlink_to(victim / "precious")                     # links inside her folders
    os.lchown(inside / "rank-1.json", ALICE, ALICE)
    job = _memtier(shm)
    (job / "peer" / "link").symlink_to(victim)
    os.lchown(job / "peer" / "link", ALICE, ALICE)
    out = _clean(harness, shm, "node1", True, JOB)
    assert out.startswith("removed=3 bytes=") and "kept=2" in out, out
    assert f"omni-beats-{ALICE}-{JOB}-node2 (not a folder)" in out or "node3 (Permission denied)" in out
    assert (victim / "precious").read_text() == "root's"
    assert (shm / f"omni-beats-{ALICE}-{JOB}-node2").is_symlink()
    assert bobs.is_dir() and (bobs / "rank-0.json").exists()
    assert not inside.exists() and not job.exists()


def test_a_folder_bob_made_first_is_not_entered(harness: Path, shm: Path) -> None:
    """bob made omni-<alice's uid>/ before her first job: nothing in it is touched."""
    folder = shm / f"omni-{ALICE}" / JOB
    folder.mkdir(parents=True)
    (folder / "bait").write_text("bob's")
    _own(shm / f"omni-{ALICE}", BOB)
    out = _clean(harness, shm, "node1", True, JOB)
    assert out.startswith("removed=0") and f"omni-{ALICE} (not the job's uid)" in out, out
    assert (folder / "bait").read_text() == "bob's"


def test_another_uid_s_file_in_the_job_s_folder_stays(harness: Path, shm: Path) -> None:
    job = _memtier(shm)
    (job / "bobs").write_text("b")
    os.lchown(job / "bobs", BOB, BOB)
    out = _clean(harness, shm, "node1", True, JOB)
    assert "bobs (another uid's)" in out and (job / "bobs").exists(), out
    assert sorted(p.name for p in job.iterdir()) == ["bobs"]


def test_a_missing_folder_is_nothing_to_do(harness: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("setfsuid needs root")
    r = run_harness(harness, "shm-clean", str(tmp_path / "absent"), "0", "0", "n", "1", JOB)
    assert (r.returncode, r.stdout.strip()) == (0, "removed=0 bytes=0 others=0 kept=0")
