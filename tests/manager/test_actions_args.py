"""The sbatch options of a resubmission: per component for a heterogeneous job, one --exclude for an
in-allocation job (its supervisor places the stages inside the allocation)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from manager_cluster_support import job_file_text, site_text

from slurm_omni.config.site import load_site
from slurm_omni.formats.registry import RegisteredStage, RegistryRecord
from slurm_omni.manager.actions import Actions, exclude_args, placement_args
from slurm_omni.manager.shape import Shape
from slurm_omni.policy.placement import Action, ComponentPlan, Plan

PLAN = Plan(Action.RESUBMIT, 2, (ComponentPlan(0, ("node1", "node2")), ComponentPlan(1, ("node5", "node7"))),
            exclude=("node3", "node6"))


def test_het_job_gets_a_nodelist_per_component() -> None:
    assert placement_args(PLAN, "tag-1", 2) == ["--comment=tag-1", "--nodelist=node[1-2]", "--exclude=node[3,6]",
                                               ":", "--nodelist=node[5,7]", "--exclude=node[3,6]"]


def test_in_allocation_job_gets_only_the_excluded_nodes() -> None:
    assert exclude_args(PLAN, "tag-1") == ["--comment=tag-1", "--exclude=node[3,6]"]
    assert exclude_args(Plan(Action.RESUBMIT, 2), "t") == ["--comment=t"]


def registered(tmp: Path, *, switch_wait: str, switches: int = 1) -> RegistryRecord:
    """A job of two stages on two nodes each (dp 2), each stage allowed ``switches`` leaf switches."""
    job_file = tmp / f"job-{switches}.toml"
    job_file.write_text(job_file_text("sw", tmp, tmp / "shards", dp=2).replace(
        "nodes = 2\n", f'nodes = 2\nswitches = {switches}\nswitch_wait = "{switch_wait}"\n'))
    stages = (RegisteredStage(0, "vision", "vision", 2, 1, "gpu:h100:4", switches),
              RegisteredStage(1, "text", "text", 2, 1, "gpu:h100:4", switches))
    return RegistryRecord(job_id=7, kind="het", name="sw", user="me", job_file=job_file,
                          job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(), ckpt_dir=tmp / "ckpt" / "sw",
                          data_parallel_size=2, max_requeues=3, stages=stages)


def _switches(script: str) -> list[str]:
    return [line.split("=", 1)[1] for line in script.splitlines() if line.startswith("#SBATCH --switches=")]


def test_a_pinned_resubmission_asks_for_the_leaf_switches_its_plan_spans(tmp_path: Path) -> None:
    # the text stage's replacement sits on another leaf: a --nodelist over two leaves with the job
    # file's --switches=1 would wait up to switch_wait for a placement that cannot exist
    (tmp_path / "site.toml").write_text(site_text(tmp_path, tmp_path / "spool"))
    reg = registered(tmp_path, switch_wait="00:10:00")
    actions = Actions(backend=None, site=load_site(tmp_path / "site.toml"), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    plan = Plan(Action.RESUBMIT, 2, (ComponentPlan(0, ("node1", "node2"), leaf_switches=1),
                                     ComponentPlan(1, ("node3", "node5"), ("node5",), ("node4",), leaf_switches=2)))
    script = actions.render(reg, Shape(reg.stages, 2), plan, 2, "omni.sw-7.1", 1).read_text()
    assert _switches(script) == ["1@00:10:00", "2@00:10:00"]
    # no node list, or no topology: the job file's count
    for unpinned in (Plan(Action.RESUBMIT, 2), Plan(Action.RESUBMIT, 2, (ComponentPlan(0, ("node1", "node2")),
                                                                         ComponentPlan(1, ("node3", "node5"))))):
        script = actions.render(reg, Shape(reg.stages, 2), unpinned, 2, "omni.sw-7.1", 1).read_text()
        assert _switches(script) == ["1@00:10:00", "1@00:10:00"]
    # a shrunk resubmission on one leaf per stage: one each, even where the job file allows more
    reg3 = registered(tmp_path, switch_wait="00:10:00", switches=3)
    shrunk = Plan(Action.SHRINK, 1, (ComponentPlan(0, ("node1",), leaf_switches=1),
                                     ComponentPlan(1, ("node3",), leaf_switches=1)))
    script = actions.render(reg3, Shape(reg3.stages, 2), shrunk, 1, "omni.sw-7.2", 2).read_text()
    assert _switches(script) == ["1@00:10:00", "1@00:10:00"] and "#SBATCH --nodes=1" in script


def test_an_in_allocation_resubmission_keeps_the_job_files_switches(tmp_path: Path) -> None:
    # its allocation is not pinned (--exclude only): the supervisor places the stages inside it
    (tmp_path / "site.toml").write_text(site_text(tmp_path, tmp_path / "spool").replace(
        "[elasticity]\n", '[elasticity]\nrecovery = "in_allocation"\ndefault_spares = 1\n').replace(
        'partition = "vision"', 'partition = "debug"').replace('partition = "text"', 'partition = "debug"'))
    reg = registered(tmp_path, switch_wait="00:10:00")
    actions = Actions(backend=None, site=load_site(tmp_path / "site.toml"), state_dir=tmp_path / "state")  # type: ignore[arg-type]
    plan = Plan(Action.RESUBMIT, 2, (ComponentPlan(0, ("node1", "node2"), leaf_switches=2),
                                     ComponentPlan(1, ("node3", "node5"), leaf_switches=2)))
    script = actions.render(reg, Shape(reg.stages, 2), plan, 2, "omni.sw-7.1", 1).read_text()
    assert "OMNI_RECOVERY=in_allocation" in script and _switches(script) == ["2@00:10:00"]   # the stages' sum
