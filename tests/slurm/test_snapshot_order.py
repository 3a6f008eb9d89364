"""A poll reads the jobs before the nodes, so that a node failure that already changed a job is in the
same snapshot: ``scontrol update state=DOWN`` requeues a batch job on that node (JobRequeue) within the
same RPC, and a snapshot that read the nodes first could show the requeued job beside a healthy node
(the 24.11 lane, 2026-12-02: the manager named the recovery's cause "requeued" instead of "down").
The runner here replays 24.11's recorded outputs and lets the node fail right after its first call."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.runner import CommandResult, CommandRunner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-24.11"


def _before_the_failure() -> dict[str, str]:
    """Jobs 6 and 7 still running on node2 (the recorded requeue, one moment earlier), every node up."""
    doc = json.loads((FIXTURES / "squeue_requeued.json").read_text())
    for job in doc["jobs"]:
        if job["job_id"] in (6, 7):
            job.update(job_state=["RUNNING"], nodes="node2", restart_cnt=0)
    return {"squeue": json.dumps(doc), "sinfo": (FIXTURES / "sinfo_idle.json").read_text()}


AFTER = {"squeue": (FIXTURES / "squeue_requeued.json").read_text(),
         "sinfo": (FIXTURES / "sinfo_down_drain.json").read_text()}


class FailingBetweenReads(CommandRunner):
    """The cluster before node2 fails for the first command, after it for every later one."""

    def __init__(self) -> None:
        super().__init__({})
        self.argv: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str], **kw: Any) -> CommandResult:
        self.argv.append(tuple(argv))
        if argv[:3] == ["scontrol", "show", "topology"]:
            return CommandResult(tuple(argv), 0, (FIXTURES / "topology.txt").read_text(), "", 0.0)
        world = _before_the_failure() if len([a for a in self.argv if a[0] != "scontrol"]) == 1 else AFTER
        return CommandResult(tuple(argv), 0, world[argv[0]], "", 0.0)


def test_a_node_failure_that_requeued_a_job_in_the_jobs_read_is_in_the_nodes_read() -> None:
    runner = FailingBetweenReads()
    snap = CliBackend(runner=runner).snapshot()
    assert [a[0] for a in runner.argv if a[0] != "scontrol"] == ["squeue", "sinfo"]
    node2 = next(n for n in snap.nodes if n.name == "node2")
    job6 = snap.job(6)
    assert job6 is not None
    # the failure is seen (next poll: the requeue too), never a requeue beside a healthy node2
    assert node2.state.failed and job6.restart_count == 0 and "node2" in job6.nodes
