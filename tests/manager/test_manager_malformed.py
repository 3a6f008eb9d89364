"""Thousands of generated malformed files in a real manager's spool, registry and a watched job's
heartbeat folder (the manager in-process, polling the real cluster): every one is set aside with
one log line, the manager keeps ticking, and a valid event and heartbeat after them still count."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manager_cluster_support import job_file_text
from omni_configs import site_toml

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.manager.events import NODES_SUBDIR, REJECTED, write_event_file
from slurm_omni.ownership import ensure_own_dir
from slurm_omni.render.registry import RegistryRecord, register, registered_stages
from slurm_omni.render.request import StagePlan

pytestmark = pytest.mark.cluster

JOB_ID = 990001   # never a job of the cluster: the watch stays active and reads its heartbeats
FILES_PER_TICK = 12
EXAMPLES = int(os.environ.get("OMNI_MALFORMED_TICKS", "250"))   # x FILES_PER_TICK files

FAULT = {"version": 1, "kind": "task_exit", "job_id": JOB_ID, "het_job_id": JOB_ID, "het_offset": 1, "step_id": 0,
         "node": "node3", "stage": "text", "stage_index": 1, "stage_rank": 0, "task_id": 1, "local_task_id": 0,
         "pid": 77, "exit_code": None, "signal": 9, "core_dumped": False, "time": "2026-11-30T00:00:00.120Z",
         "time_unix": 1764460800.12}
BEAT = {"rank": 0, "stage": 0, "dp_rank": 0, "pid": 1234, "incarnation": 0, "job_id": str(JOB_ID), "step": 17,
        "phase": "training", "time": 1764460000.12, "step_time_s": 0.031, "last_checkpoint_step": 10, "beats": 9}
NODE = {"version": 1, "kind": "down", "nodes": "node[1-2]", "time": 1764460000.0}
REG = {"format": 1, "job_id": 5, "kind": "het", "name": "x", "user": "u", "job_file": "/j.toml", "job_sha256": "a",
       "ckpt_dir": "/c", "data_parallel_size": 1, "max_requeues": 1, "stages": [
           {"het_group": 0, "name": "v", "partition": "vision", "nodes": 1, "tasks_per_node": 1, "gres": ""}]}


@pytest.fixture(scope="module")
def manager(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Manager]:
    tmp = tmp_path_factory.mktemp("malformed")
    spool = tmp / "spool"                       # deployment.md: root's 0755, <user>/ 0700, nodes/ 0755
    spool.mkdir(mode=0o755)
    (spool / NODES_SUBDIR).mkdir(mode=0o755)
    # windows no generated timestamp can reach: a valid heartbeat or fault record among the garbage
    # is observed, but never confirms a failure (that would resubmit the job for real)
    (tmp / "site.toml").write_text(site_toml(tmp, spool_dir=spool, tables=(
        "[detection]\nconfirmation_window_s = 1e12\nprogress_window_s = 1e12\n"
        "[detection.confirm]\nstale_floor_s = 1e12\nstartup_timeout_s = 1e12\n")))
    site = load_site(tmp / "site.toml")
    job_file = tmp / "job.toml"
    job_file.write_text(job_file_text("fuzz", tmp, tmp / "shards"))
    stages = tuple(StagePlan(i, s, s, 1, 1, "gpu:h100:4", 1, "10:00", 0) for i, s in enumerate(("vision", "text")))
    register(site.manager.registry_dir, RegistryRecord(
        job_id=JOB_ID, kind="het", name="fuzz", cluster=site.cluster, job_file=job_file,
        job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(), script=None,
        ckpt_dir=site.checkpoint.root / "fuzz", data_parallel_size=1, max_requeues=3, stages=registered_stages(stages)))
    m = Manager(ManagerConfig(site=site, state_dir=tmp / "state", poll_interval_s=3600.0), slurm_cluster.backend())
    ensure_own_dir(spool / m.user, private=True)
    m.tick(force_poll=True)
    (w,) = m.watches.values()
    w.heartbeat_dir.mkdir(mode=0o700, parents=True)
    try:
        yield m
    finally:
        m.close()


def _garbage_of(valid: dict[str, object]) -> st.SearchStrategy[bytes]:
    from malformed_inputs import garbage
    return garbage(valid)


FILES = st.lists(st.one_of(
    st.tuples(st.just("spool"), st.sampled_from(["fault-x-{}.json", "other-{}.txt"]), _garbage_of(FAULT)),
    st.tuples(st.just("nodes"), st.sampled_from(["node-down-{}.json", "other-{}.txt"]), _garbage_of(NODE)),
    st.tuples(st.just("heartbeat"), st.sampled_from(["rank-{}.json"]), _garbage_of(BEAT)),
    st.tuples(st.just("registry"), st.sampled_from(["{}.json"]), _garbage_of(REG)),
), min_size=FILES_PER_TICK, max_size=FILES_PER_TICK)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=FILES)
def test_malformed_files_never_stop_the_manager(manager: Manager, files: list[tuple[str, str, bytes]],
                                                caplog: pytest.LogCaptureFixture) -> None:
    (w,) = (w for w in manager.watches.values() if w.key == f"fuzz-{JOB_ID}")
    spool = manager.config.site.manager.spool_dir
    folders = {"spool": spool / manager.user, "nodes": spool / NODES_SUBDIR, "heartbeat": w.heartbeat_dir,
               "registry": manager.config.site.manager.registry_dir}
    written = []
    for n, (where, name, data) in enumerate(files):
        path = folders[where] / name.format(100 + n)   # registry names: ids 100+, never the watched job's
        path.write_bytes(data)
        written.append(path)
    with caplog.at_level(logging.WARNING):
        manager.tick()
        # the registry is read on every poll; here without polling Slurm once per example
        manager._sync_registry(manager.clock(), None)
    assert not [r for r in caplog.records if r.getMessage().startswith("manager: couldn't handle")]
    for (where, _name, data), path in zip(files, written, strict=True):
        rejected = path.parent / REJECTED / path.name
        if path.exists() and where != "nodes":   # only a valid file stays: an event for later, a beat, a record
            assert not rejected.exists() and _valid(where, path.name, data), path
        path.unlink(missing_ok=True)   # <spool>/nodes is every manager's: a bad file there is skipped, not moved
        rejected.unlink(missing_ok=True)


def _valid(where: str, name: str, data: bytes) -> bool:
    from slurm_omni.manager import events
    from slurm_omni.manager.registry import parse_record
    parse = {"heartbeat": events.parse_heartbeat, "registry": lambda d: parse_record(d, name),
             "spool": events.parse_fault_record, "nodes": events.parse_node_event}[where]
    try:
        parse(data)
    except events.EventRejected:
        return False
    return True


def test_after_the_garbage_a_valid_event_and_heartbeat_still_count(manager: Manager) -> None:
    (w,) = (w for w in manager.watches.values() if w.key == f"fuzz-{JOB_ID}")
    before = manager.journal.count("observations", w.key)
    own = manager.config.site.manager.spool_dir / manager.user
    write_event_file(own, "fault-valid.json", json.dumps(FAULT).encode())
    (w.heartbeat_dir / "rank-0.json").write_text(json.dumps({**BEAT, "phase": "checkpointing"}))
    manager.tick()
    with sqlite3.connect(manager.config.journal_path) as db:
        kinds = [k for (k,) in db.execute("SELECT kind FROM observations WHERE job = ? ORDER BY id",
                                          (w.key,)).fetchall()][before:]
    assert "task_exit" in kinds and "heartbeat_phase" in kinds
    assert manager.journal.count("actions", w.key) == 0 and w.incarnation == 0
    assert not (own / "fault-valid.json").exists()
