"""Every life of a registered job carries its own OMNI_INCARNATION: the manager renders its
resubmission's base into the script, the script adds Slurm's restart count, and the manager judges
the heartbeats of exactly that number."""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from manager_cluster_support import job_file_text, site_text

from slurm_omni.checkpoint.fence import raise_fence
from slurm_omni.cli.submit import first_incarnation
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.formats.registry import RegisteredStage, RegisteredTask, RegistryRecord, encode_record
from slurm_omni.manager.actions import Actions
from slurm_omni.manager.journal import Journal
from slurm_omni.manager.recovery import next_incarnation
from slurm_omni.manager.registry import parse_record
from slurm_omni.manager.shape import Shape
from slurm_omni.manager.watch import Watch, live
from slurm_omni.policy.confirm import ConfirmConfig, Confirmer
from slurm_omni.policy.placement import Action, Plan
from slurm_omni.policy.watch_lifecycle import Relaunched, Requeued
from slurm_omni.policy.watch_lifecycle import initial as initial_life
from slurm_omni.render import ArrayJobRequest


def _registered(tmp: Path) -> RegistryRecord:
    job_file = tmp / "job.toml"
    job_file.write_text(job_file_text("inc", tmp, tmp / "shards"))
    stages = (RegisteredStage(0, "vision", "vision", 1, 1, "gpu:h100:4"),
              RegisteredStage(1, "text", "text", 1, 1, "gpu:h100:4"))
    return RegistryRecord(job_id=7, kind="het", name="inc", user="me", job_file=job_file,
                          job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(), ckpt_dir=tmp / "ckpt" / "inc",
                          data_parallel_size=1, max_requeues=3, stages=stages)


def _exported_incarnation(script: str, restart_count: str | None) -> str:
    """What the script's incarnation lines export, run by bash as Slurm would run them."""
    lines = [x for x in script.splitlines() if re.match(r"export OMNI_INCARNATION(_BASE)?=", x)]
    env = {"PATH": "/usr/bin:/bin", **({"SLURM_RESTART_COUNT": restart_count} if restart_count else {})}
    out = subprocess.run(["bash", "-c", "\n".join([*lines, 'echo "$OMNI_INCARNATION"'])], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return out.strip()


@pytest.mark.parametrize(("base", "restart_count", "expected"), [(0, None, "0"), (3, None, "3"), (3, "2", "5")])
def test_a_resubmitted_script_numbers_its_lives_from_the_managers_incarnation(
        tmp_path: Path, base: int, restart_count: str | None, expected: str) -> None:
    (tmp_path / "site.toml").write_text(site_text(tmp_path, tmp_path / "spool", quarantine_s=60))
    reg = _registered(tmp_path)
    actions = Actions(backend=None, site=load_site(tmp_path / "site.toml"), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    script = actions.render(reg, Shape(reg.stages, 1), Plan(Action.RESUBMIT, 1), 1, "omni.inc-7.3", base).read_text()
    assert _exported_incarnation(script, restart_count) == expected


def _watch(incarnation: int, restart_count: int, *, array_task: int | None = None,
           ckpt_dir: Path = Path("/nonexistent")) -> Watch:
    reg: Any = SimpleNamespace(ckpt_dir=ckpt_dir, tasks=())
    life = replace(initial_life(incarnation, 41, 1), restart_count=restart_count, slurm_restart_count=restart_count,
                   running_restart_count=restart_count)
    return Watch(key="inc-7", reg=reg, shape=None, placement=None, confirmer=None,  # type: ignore[arg-type]
                 heartbeat_dir=Path("/nonexistent"), life=life, array_task=array_task)


def test_the_life_judged_and_the_next_incarnation_follow_every_earlier_life(tmp_path: Path) -> None:
    # incarnation 2 requeued itself once (its life 3): the next submission is 4, not 3
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        m: Any = SimpleNamespace(journal=journal, poller=SimpleNamespace(last=None))
        assert _watch(0, 0).judged_incarnation == 0 and _watch(2, 1).judged_incarnation == 3
        assert _watch(1, 1, array_task=0).judged_incarnation == 1   # an array task's incarnation is its restart count
        assert next_incarnation(m, _watch(0, 0)) == 1
        # Slurm requeued incarnation 0 for a lost node and the recovery cancelled it while PENDING:
        # that life never ran and takes no number
        requeued = _watch(0, 0)
        requeued.life = replace(requeued.life, slurm_restart_count=1)
        assert next_incarnation(m, requeued) == 1
        requeued.life = replace(requeued.life, running_restart_count=1)   # ...but once Slurm showed it RUNNING, it did
        assert next_incarnation(m, requeued) == 2
        w = _watch(2, 1)
        assert next_incarnation(m, w) == 4
        # a manager restarted after journaling the number keeps it, whatever Slurm shows by then
        journal.register_job(w.key, 1000, {}, 0.0)
        journal.add_incarnation(w.key, 4, {"tag": "omni.inc-7.4"})
        assert next_incarnation(m, _watch(2, 0)) == 4
        # a life that restored (it raised the checkpoint fence) counts even if it never beat
        raise_fence(tmp_path, 6, "43.6")
        assert next_incarnation(m, _watch(5, 0, ckpt_dir=tmp_path)) == 7
    finally:
        journal.close()


def test_a_job_submitted_again_onto_a_fenced_root_numbers_its_lives_past_it(tmp_path: Path) -> None:
    assert first_incarnation(tmp_path) == 0
    raise_fence(tmp_path, 3, "41.3")
    assert first_incarnation(tmp_path) == 4
    reg = _registered(tmp_path)
    record = RegistryRecord(job_id=8, kind="het", name="inc", cluster="omni", job_file=reg.job_file,
                            job_sha256=reg.job_sha256, script=None, ckpt_dir=tmp_path, data_parallel_size=1,
                            max_requeues=3, stages=reg.stages, incarnation_base=4)
    parsed = parse_record(encode_record(record), "8.json")
    assert parsed.incarnation_base == 4 and parsed.environment is None


@pytest.mark.parametrize(("task", "restart_count", "expected"), [("0", None, "0"), ("1", None, "5"), ("1", "2", "7")])
def test_each_array_task_numbers_its_lives_from_its_own_base(
        tmp_path: Path, task: str, restart_count: str | None, expected: str) -> None:
    (tmp_path / "site.toml").write_text(site_text(tmp_path, tmp_path / "spool", quarantine_s=60))
    site = load_site(tmp_path / "site.toml")
    files = []
    for name in ("sweep-a", "sweep-b"):
        files.append(tmp_path / f"{name}.toml")
        files[-1].write_text(job_file_text(name, tmp_path, tmp_path / "shards"))
    script = ArrayJobRequest(jobs=tuple(load_job(f) for f in files), site=site, job_files=tuple(files),
                             job_sha256s=("a", "b"), incarnation_bases=(0, 5)).materialize()
    lines = script.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("task=${SLURM_ARRAY_TASK_ID"))
    end = next(i for i, x in enumerate(lines) if x.startswith("export OMNI_INCARNATION="))
    env = {"PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": task,
           **({"SLURM_RESTART_COUNT": restart_count} if restart_count else {})}
    out = subprocess.run(["bash", "-c", "\n".join([*lines[start:end + 1], 'echo "$OMNI_INCARNATION"'])], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == expected
    w = _watch(int(restart_count or 0), int(restart_count or 0), array_task=int(task))
    w.reg = RegistryRecord(job_id=9, kind="array", name="sweep-a", user="me", job_file=files[0], job_sha256="a",
                           ckpt_dir=tmp_path, data_parallel_size=1, max_requeues=3,
                           stages=_registered(tmp_path).stages, array_tasks=(
                               RegisteredTask(0, "sweep-a", tmp_path / "a"),
                               RegisteredTask(1, "sweep-b", tmp_path / "b", incarnation_base=5)))
    assert str(w.judged_incarnation) == expected    # the manager judges the heartbeats of that number


@pytest.mark.parametrize(("restart_count", "expected"), [(None, "3"), ("1", "103"), ("2", "203")])
def test_an_in_allocation_job_numbers_requeued_lives_by_the_stride_and_the_manager_judges_them(
        tmp_path: Path, restart_count: str | None, expected: str) -> None:
    # the script: base + REQUEUE_INCARNATION_STRIDE x SLURM_RESTART_COUNT (the supervisor adds its launch number)
    (tmp_path / "site.toml").write_text(site_text(tmp_path, tmp_path / "spool", quarantine_s=60).replace(
        "[elasticity]\n", '[elasticity]\nrecovery = "in_allocation"\ndefault_spares = 1\n').replace(
        'partition = "vision"', 'partition = "debug"').replace('partition = "text"', 'partition = "debug"'))
    reg = _registered(tmp_path)
    actions = Actions(backend=None, site=load_site(tmp_path / "site.toml"), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    script = actions.render(reg, Shape(reg.stages, 1), Plan(Action.RESUBMIT, 1), 1, "omni.inc-7.3", 3).read_text()
    assert "OMNI_RECOVERY=in_allocation" in script
    assert _exported_incarnation(script, restart_count) == expected
    # the manager, once the job is supervised, judges that life: after a quiet requeue (no report
    # names launch 0 of the requeued allocation) and after the supervisor's relaunch reports
    w = _watch(3, 0)
    w.confirmer = Confirmer(ConfirmConfig(), {})
    w.recovery_config = replace(w.recovery_config, supervised=True)
    assert w.judged_incarnation == 3
    live(w, Relaunched(incarnation=4), 0.0)     # relaunched-4.json: launch 1 of the first allocation
    assert w.judged_incarnation == 4
    live(w, Requeued(restart_count=int(restart_count or 0)), 0.0)   # Slurm requeued it after the ranks checkpointed
    assert str(w.judged_incarnation) == expected
    live(w, Relaunched(incarnation=int(expected) + 1), 0.0)   # the requeued allocation's supervisor relaunched once
    assert w.judged_incarnation == int(expected) + 1


def test_after_a_requeue_a_relaunched_incarnation_is_the_watchs_and_the_next_one_follows_it(tmp_path: Path) -> None:
    """An in-allocation job (base 3) that Slurm requeued once (its launch 0 is 103) and whose
    supervisor then relaunched (104, journaled as an incarnation of its own, as manager/recovery's
    WatchNext does): the watch's journal incarnation is 104, and a resubmission after it takes 105,
    never 104 again."""
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        m: Any = SimpleNamespace(journal=journal, poller=SimpleNamespace(last=None))
        w = _watch(3, 0)
        w.confirmer = Confirmer(ConfirmConfig(), {})
        w.recovery_config = replace(w.recovery_config, supervised=True)
        journal.register_job(w.key, 1000, {}, 0.0)
        journal.add_incarnation(w.key, 3, {})
        w.life = replace(w.life, slurm_restart_count=1, running_restart_count=1)
        live(w, Requeued(restart_count=1), 0.0)
        assert w.judged_incarnation == 103
        journal.add_incarnation(w.key, 104, {"in_allocation": True})
        live(w, Relaunched(incarnation=104), 0.0)
        assert (w.incarnation, w.judged_incarnation) == (104, 104)
        assert next_incarnation(m, w) == 105
    finally:
        journal.close()
