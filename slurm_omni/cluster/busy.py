"""A busy cluster for drills and benchmarks: every free node gets another job that runs for a while,
so that a job which leaves the allocation (a resubmission, Slurm's requeue) waits in the queue as
it would at a centre; an in-allocation relaunch does not.

Filler jobs are ordinary ``sbatch --wrap 'sleep N'`` jobs named ``omni-busy`` with a comment tag, one
per node; ``clear`` cancels exactly the ones this filler submitted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.types import NodeState

log = logging.getLogger(__name__)

FILLER_NAME = "omni-busy"


@dataclass
class BusyCluster:
    backend: CliBackend
    seconds: int = 180
    """How long each filler job runs (a few minutes: a resubmission waits about that long)."""
    partition: str = ""
    tag: str = "omni-busy"
    jobs: list[int] = field(default_factory=list)

    def fill(self) -> list[str]:
        """One filler job on every node that is idle now; returns the nodes filled."""
        idle = sorted(n.name for n in self.backend.nodes() if n.state is NodeState.IDLE
                      and not (n.flags & {"DRAIN", "NOT_RESPONDING", "MAINT"}))
        for node in idle:
            args = ["sbatch", "--parsable", f"--job-name={FILLER_NAME}", f"--comment={self.tag}", "--nodes=1",
                    "--exclusive",   # the whole node: another job must not share it (cons_tres shares CPUs)
                    f"--nodelist={node}", "--output=/dev/null", f"--time={max(1, self.seconds // 60 + 1)}",
                    f"--wrap=sleep {int(self.seconds)}"]
            if self.partition:
                args.insert(2, f"--partition={self.partition}")
            out = self.backend.runner.run(args).stdout.strip()
            self.jobs.append(int(out.split(";")[0]))
        log.warning("busy: %d filler job(s) of %d s on %s", len(idle), self.seconds, ",".join(idle) or "no node")
        return idle

    def clear(self) -> None:
        if self.jobs:
            self.backend.runner.run(["scancel", *map(str, self.jobs)], check=False)
        self.jobs = []
