"""A manager whose own job's squeue record could not be read this poll (skipped by read_squeue_json,
issue 18 finding 4) takes it as no news: the job is not taken for gone (which would recover it)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from manager_cluster_support import job_file_text
from omni_configs import site_toml

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.render.registry import RegistryRecord, register, registered_stages
from slurm_omni.render.request import StagePlan
from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.types import Topology

pytestmark = pytest.mark.cluster

JOB_ID = 990002   # never a job of the cluster


@pytest.fixture
def manager(slurm_cluster, tmp_path: Path) -> Iterator[Manager]:
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o755)
    (tmp_path / "site.toml").write_text(site_toml(tmp_path, spool_dir=spool))
    site = load_site(tmp_path / "site.toml")
    job_file = tmp_path / "job.toml"
    job_file.write_text(job_file_text("unreadable", tmp_path, tmp_path / "shards"))
    stages = tuple(StagePlan(i, s, s, 1, 1, "gpu:h100:4", 1, "10:00", 0) for i, s in enumerate(("vision", "text")))
    register(site.manager.registry_dir, RegistryRecord(
        job_id=JOB_ID, kind="het", name="unreadable", cluster=site.cluster, job_file=job_file,
        job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(), script=None,
        ckpt_dir=site.checkpoint.root / "unreadable", data_parallel_size=1, max_requeues=3,
        stages=registered_stages(stages)))
    m = Manager(ManagerConfig(site=site, state_dir=tmp_path / "state", poll_interval_s=3600.0),
                slurm_cluster.backend())
    try:
        yield m
    finally:
        m.close()


def test_own_jobs_unreadable_record_is_no_news_not_the_job_gone(manager: Manager,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    manager.tick(force_poll=True)
    (w,) = manager.watches.values()
    w.life = replace(w.life, seen=True)          # as if an earlier poll had seen it running
    ended: list[int | None] = []
    monkeypatch.setattr(manager, "_ended", lambda w, job, at: ended.append(w.slurm_id))
    skipped = ClusterSnapshot((), (), Topology(), time.time(), unreadable_jobs=frozenset({JOB_ID}))
    manager._observe_poll(w, skipped, {}, time.time())
    assert ended == [] and not w.life.ended
    gone = ClusterSnapshot((), (), Topology(), time.time())
    manager._observe_poll(w, gone, {}, time.time())
    assert ended == [JOB_ID] and w.life.ended
