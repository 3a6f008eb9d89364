"""The sbatch options of a resubmission: per component for a heterogeneous job, one --exclude for an
in-allocation job (its supervisor places the stages inside the allocation)."""

from __future__ import annotations

from slurm_omni.manager.actions import exclude_args, placement_args
from slurm_omni.policy.placement import Action, ComponentPlan, Plan

PLAN = Plan(Action.RESUBMIT, 2, (ComponentPlan(0, ("node1", "node2")), ComponentPlan(1, ("node5", "node7"))),
            exclude=("node3", "node6"))


def test_het_job_gets_a_nodelist_per_component() -> None:
    assert placement_args(PLAN, "tag-1", 2) == ["--comment=tag-1", "--nodelist=node[1-2]", "--exclude=node[3,6]",
                                               ":", "--nodelist=node[5,7]", "--exclude=node[3,6]"]


def test_in_allocation_job_gets_only_the_excluded_nodes() -> None:
    assert exclude_args(PLAN, "tag-1") == ["--comment=tag-1", "--exclude=node[3,6]"]
    assert exclude_args(Plan(Action.RESUBMIT, 2), "t") == ["--comment=t"]
