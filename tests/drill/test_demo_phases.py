"""The demo's phases that are cheap to run alone (the whole demo is too long for the suite)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from slurm_omni.cli.demo import Story
from slurm_omni.cluster.local import LocalCluster
from slurm_omni.cluster.spec import ClusterSpec
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.drill import story
from slurm_omni.drill.faults import fill_faults
from slurm_omni.drill.inject import REASON, Injector
from slurm_omni.drill.measure import DrillResult, DrillTimes
from slurm_omni.errors import OmniError
from slurm_omni.render import HetJobRequest
from slurm_omni.report.timeline import load_timeline


def test_files_fill_the_examples_and_render(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", ClusterSpec(nodes=8))
    files = story.DemoFiles(tmp_path / "demo")
    (files.work / "ckpt").mkdir(parents=True)     # an old demo's checkpoint must not survive
    story.write_files(files, cluster)
    assert not (files.work / "ckpt").exists()
    site = load_site(files.site)
    assert site.drills.nodes == tuple(f"node{i}" for i in range(1, 9))
    assert site.manager.spool_dir == cluster.paths.spool and site.checkpoint.root == files.work / "ckpt"
    job = load_job(files.job)
    assert job.training.data.shard_dir == files.shards and job.job.log_dir == files.work / "logs"
    request = HetJobRequest(job=job, site=site, job_file=files.job, job_sha256="0" * 64)
    # the fastest path the demo site allows: allocation mode (its kept script is the in-allocation one)
    assert request.recovery == "allocation" and request.in_allocation()[0] is not None
    script = request.materialize()
    assert "#SBATCH hetjob" not in script and "#SBATCH --no-kill" in script and "--stages=vision:1:2:1,text:1:2:1" in script
    # the memory tier on (issue 22): a snapshot into memory every step, the file system every 10th, one
    # tmpfs folder per node (the embedded nodes share one /dev/shm)
    c = job.training.checkpoint
    assert (c.memory_tier, c.memory_every_steps, c.files_every) == (True, 1, 10)
    assert site.checkpoint.memory_dir == files.shm / "%n" and str(files.shm).startswith("/dev/shm/omni-demo-")
    assert f"OMNI_MEMORY_DIR={files.shm}/%n" in script and "OMNI_FILES_EVERY=10" in script


def _line(path: Path, docs: list[dict[str, object]]) -> None:
    import json
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))


def test_the_restore_line_comes_from_the_ranks_own_records(tmp_path: Path) -> None:
    """Where each rank of the relaunch restored from (its first metrics line's restore_source) and the
    steps lost (the faulted life's last step minus the step the next life restored)."""
    assert story.restore_line(tmp_path) is None   # nothing yet
    for rank, source in enumerate(["memory", "memory", "peer memory", "peer memory"]):
        _line(tmp_path / f"metrics-s-{rank}.jsonl",
              [{"incarnation": 0, "rank": rank, "step": s} for s in range(1, 31 if rank < 2 else 30)]
              + [{"incarnation": 1, "rank": rank, "step": 30, "restore_source": source,
                  **({"restore_inherited": 1} if rank < 2 else {})},
                 {"incarnation": 1, "rank": rank, "step": 31}])
    inherited = "; ranks 0-1 read the copies they inherited from their node's standby"
    assert story.restore_line(tmp_path) == ("restored step 29: ranks 0-1 from memory; ranks 2-3 from peer memory; "
                                            "1 step lost (life 0 reached step 30)" + inherited)
    _line(tmp_path / "metrics-s-3.jsonl", [{"incarnation": 1, "rank": 3, "step": 28, "restore_source": "file system"}])
    assert story.restore_line(tmp_path) == ("restored step 27: ranks 0-1 from memory; rank 2 from peer memory; "
                                            "rank 3 from file system; 3 steps lost (life 0 reached step 30)"
                                            + inherited)


def test_the_demos_memory_is_removed_and_a_leak_is_named(tmp_path: Path) -> None:
    files = story.DemoFiles(tmp_path / "demo")
    assert story.free_memory(files) is None
    try:
        for node in ("node1", "node2"):
            (files.shm / node / "omni-0").mkdir(parents=True)
        assert story.free_memory(files) == f"nothing of the job left in {files.shm} (its standbys freed it); folder removed"
        assert not files.shm.exists()
        for node in ("node1", "node2"):
            (files.shm / node / "omni-0" / "7").mkdir(parents=True)
            (files.shm / node / "omni-0" / "7" / "step-3.rank-00000.7.0.h5").write_bytes(b"x")
        line = story.free_memory(files, lost=["node2"])
        assert line is not None and "1 file(s) on node2, the node the drill took down" in line
        assert "1 file(s) on node1 NOT freed by its standby" in line and not files.shm.exists()
    finally:
        import shutil
        shutil.rmtree(files.shm, ignore_errors=True)


@pytest.mark.parametrize(("recovery", "path", "het"), [(None, "allocation", False), ("allocation", "allocation", False),
                                                       ("in_allocation", "in_allocation", False),
                                                       ("resubmit", "resubmit", True)])
def test_the_demo_site_defaults_to_the_fastest_path_and_shows_the_others(tmp_path: Path, recovery: str | None,
                                                                          path: str, het: bool) -> None:
    cluster = LocalCluster(tmp_path / "cluster", ClusterSpec(nodes=8))
    files = story.DemoFiles(tmp_path / "demo")
    story.write_files(files, cluster, recovery=recovery)
    site = load_site(files.site)
    request = HetJobRequest(job=load_job(files.job), site=site, job_file=files.job, job_sha256="0" * 64)
    assert request.recovery == path
    assert ("#SBATCH hetjob" in request.materialize()) == het


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("example", "described"), [
    ("demo", "vision | text stages, 2 replicas each; het job, recovery by resubmission"),
    ("own-script", "vision | text stages, 2 replicas each; het job, recovery by resubmission"),
    ("gpt", "gpt stage, 2 replicas; ordinary job, recovery by resubmission"),
    ("speech-image-lm", "speech | image | lm stages, 2 replicas each; het job, recovery by resubmission"),
])
@pytest.mark.parametrize("recovery", ["resubmit", "in_allocation", None])
def test_the_demo_describes_each_example_by_its_own_stages(tmp_path: Path, example: str, described: str,
                                                          recovery: str | None) -> None:
    """Before, every job was "vision | text stages, 2 replicas each". The demo's site has one partition and a
    spare per stage, so that every example gets one allocation: with no batch script by default (allocation
    mode, the fastest the site allows), with one for --recovery in_allocation; --recovery resubmit: none."""
    cluster = LocalCluster(tmp_path / "cluster", ClusterSpec(nodes=8))
    files = story.DemoFiles(tmp_path / "demo")
    job_file = None if example == "demo" else REPO / "examples" / example / "job.toml"
    story.write_files(files, cluster, job_file=job_file, recovery=recovery)
    site = load_site(files.site)
    text = story.describe_job(files, site)
    if recovery == "resubmit":
        assert text == described
    else:
        job = load_job(files.job)
        stages, nodes = len(job.stages), sum(st.nodes for st in job.stages)
        assert text.startswith(described.split(";")[0] + "; ")
        how = "no batch script, " if recovery is None else ""
        assert text.endswith(f"one allocation of {nodes + stages} nodes ({stages} spare{'s' if stages > 1 else ''}), "
                             f"{how}recovery in it")
    if job_file is not None:
        assert (files.work / "train.py").is_file()
    assert story.builtin_trainer(files) == (job_file is None)     # only the built-in trainer reads the shards


def test_job_environment_puts_this_omni_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/usr/bin")
    env = story.job_environment(LocalCluster(tmp_path))
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["OMNI_TRACE_SAMPLES"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["SLURM_CONF"] == str(LocalCluster(tmp_path).paths.slurm_conf)


def test_a_failed_phase_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    s = Story(3)
    assert s.phase("first", lambda: 41 + 1, lambda v: f"got {v}") == 42
    assert "1/3 first: got 42" in capsys.readouterr().out

    def boom() -> None:
        raise OmniError("demo: couldn't submit: sbatch: error: Invalid partition")

    with pytest.raises(OmniError) as e:
        s.phase("submit", boom, lambda _: "")
    assert str(e.value) == "demo: phase 2 (submit) failed: couldn't submit: sbatch: error: Invalid partition"


def test_synthesize_writes_shards(tmp_path: Path) -> None:
    files = story.DemoFiles(tmp_path)
    assert story.synthesize(files) == 128
    assert len(list(files.shards.glob("*.h5"))) == 4


@pytest.mark.cluster
def test_cleanup_resumes_what_a_drill_left_down(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    idle = [n.name for n in backend.nodes() if n.state.usable and not n.flags and n.state.value == "idle"]
    if not idle:
        pytest.skip("no idle node")
    node = idle[-1]
    injector = Injector(allowed=(node,), site="test", backend=backend)
    injector.node_down(node)
    done = story.cleanup(backend, injector, [], None)
    assert done == [f"{node} resumed"]
    assert next(n for n in backend.nodes() if n.name == node).state.usable
    assert REASON not in next(n for n in backend.nodes() if n.name == node).reason


@pytest.mark.cluster
def test_root_sets_down_and_resumes_only_cluster_nodes_it_downed_for_the_users_side(slurm_cluster) -> None:
    """``omni demo --user``: the user's side asks root for the drill's node changes over a socket."""
    import socket
    import threading

    from slurm_omni.drill.inject import DrillError
    from slurm_omni.drill.user_session import NodeBroker, RootNodes
    from slurm_omni.formats import encode
    from slurm_omni.formats.demo_session import SessionStart

    backend = slurm_cluster.backend()
    idle = [n.name for n in backend.nodes() if n.state.usable and not n.flags and n.state.value == "idle"]
    if len(idle) < 2:
        pytest.skip("fewer than two idle nodes")
    node, other = idle[-1], idle[-2]
    nodes = tuple(slurm_cluster.nodes)
    broker = NodeBroker(Injector(allowed=nodes, site="test", backend=backend), nodes)
    ours, theirs = socket.socketpair()
    ours.sendall(encode(SessionStart(started=1.0, phases_done=1, total=11)))
    server = threading.Thread(target=broker.serve, args=(ours,), daemon=True)
    server.start()
    user_side = RootNodes(theirs.detach())
    try:
        assert (user_side.start.phases_done, user_side.start.total) == (1, 11)
        user_side.request("down", node)
        state = next(n for n in backend.nodes() if n.name == node)
        assert not state.state.usable and REASON in state.reason
        with pytest.raises(DrillError, match="not a node of the embedded cluster"):
            user_side.request("down", "elsewhere1")
        with pytest.raises(DrillError, match=f"couldn't resume {other}: root resumes only the nodes it set down"):
            user_side.request("resume", other)
        user_side.sock.sendall(b'{"op": "reboot", "node": "node1"}\n')       # no such request
        assert b'"ok":false' in user_side.stream.readline()
        user_side.request("resume", node)
        assert next(n for n in backend.nodes() if n.name == node).state.usable
        assert broker.downed == []
    finally:
        user_side.close()
        server.join(timeout=30)
        assert not server.is_alive()
        ours.close()
        broker.restore()


def test_drill_timeline_fills_the_fault_the_manager_cannot_know(tmp_path: Path) -> None:
    manager = tmp_path / "timeline.json"
    manager.write_text('{"recoveries": [{"job_id": "7", "incarnation": 0, "fault": null, "detected": 101.0, '
                       '"confirmed": 101.0, "resubmitted": 101.2, "running": 103.0, '
                       '"first_step_after_restore": 108.0, "kind": "node_down", "action": "resubmit"}]}')
    result = DrillResult(kind="node-down", job="j", job_id="7", restored=True,
                         times=DrillTimes(fault=100.0, confirmed=101.0, first_step=108.0, source="journal"))
    out = fill_faults(manager, [result], tmp_path / "drills" / "timeline.json")
    assert out is not None
    (r,) = load_timeline(out).recoveries
    assert r.fault == 100.0 and r.detection_s == 1.0 and r.recovery_s == 7.0 and r.action == "resubmit"
    assert fill_faults(tmp_path / "none.json", [result], tmp_path / "x.json") is None


def test_an_unexpected_error_is_still_one_line() -> None:
    def missing() -> None:
        raise FileNotFoundError(2, "No such file or directory", "/x/job.toml")

    with pytest.raises(OmniError, match=r"^demo: phase 1 \(files\) failed: FileNotFoundError: .*job.toml'$"):
        Story(1).phase("files", missing, lambda _: "")


def test_the_drills_fault_time_replaces_the_managers_estimate(tmp_path: Path) -> None:
    manager = tmp_path / "timeline.json"
    manager.write_text('{"recoveries": [{"job_id": "7", "incarnation": 0, "fault": 99.5, "detected": 100.6, '
                       '"confirmed": 102.0, "kind": "task_crash"}, {"job_id": "9", "incarnation": 0, '
                       '"confirmed": 300.0}]}')
    result = DrillResult(kind="kill-rank", job="j", job_id="7", restored=True,
                         times=DrillTimes(fault=100.5, confirmed=102.0, source="journal"))
    out = fill_faults(manager, [result], tmp_path / "filled.json")
    assert out is not None
    first, other = load_timeline(out).recoveries
    assert first.fault == 100.5 and first.detection_s == 1.5
    assert other.fault is None     # a recovery no drill caused keeps what the manager wrote


def test_the_job_folder_is_copied_whole_for_its_workdir_without_following_links(tmp_path: Path) -> None:
    """``omni demo --job-file``: the script's data/ comes along (the job's workdir finds it there); a
    symlink (to outside the folder) is not followed, hidden entries and logs stay behind."""
    src, dst, outside = tmp_path / "job", tmp_path / "demo", tmp_path / "outside"
    (src / "data" / "shards").mkdir(parents=True)
    (src / "logs").mkdir()
    (src / ".git").mkdir()
    outside.mkdir()
    (outside / "secret").write_text("x")
    (src / "train.py").write_text("print('hi')\n")
    (src / "data" / "shards" / "train.bin").write_bytes(b"\0" * 100)
    (src / "logs" / "old.out").write_text("old")
    (src / ".git" / "HEAD").write_text("ref")
    (src / "linked").symlink_to(outside / "secret")
    (src / "data" / "elsewhere").symlink_to(outside, target_is_directory=True)
    dst.mkdir()
    assert story.copy_job_folder(src, dst) == 2
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["data", "data/shards", "data/shards/train.bin",
                                                                      "train.py"]
    with pytest.raises(OmniError, match="more than 0 MiB"):
        story.copy_job_folder(src, tmp_path / "small", max_bytes=50)
    assert not (tmp_path / "small").exists()          # nothing half-copied
