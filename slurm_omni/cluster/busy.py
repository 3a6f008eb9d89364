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
    queued: int = 0
    """Filler jobs to leave pending in the queue besides (any node): a node that a cancelled job frees
    goes to them first (FIFO: they were submitted earlier), as at a centre whose queue is never empty,
    instead of to that job's own resubmission."""
    jobs: list[int] = field(default_factory=list)

    def fill(self) -> list[str]:
        """One filler job on every node that is idle now, then ``queued`` pending ones; returns the
        nodes filled."""
        idle = sorted(n.name for n in self.backend.nodes() if n.state is NodeState.IDLE
                      and not (n.flags & {"DRAIN", "NOT_RESPONDING", "MAINT"}))
        for node in idle:
            self._submit(f"--nodelist={node}")
        for _ in range(self.queued):
            self._submit()
        log.warning("busy: %d filler job(s) of %d s on %s, %d queued", len(idle), self.seconds,
                    ",".join(idle) or "no node", self.queued)
        return idle

    def _submit(self, *where: str) -> None:
        args = ["sbatch", "--parsable", f"--job-name={FILLER_NAME}", f"--comment={self.tag}", "--nodes=1",
                "--exclusive",   # the whole node: another job must not share it (cons_tres shares CPUs)
                *where, "--output=/dev/null", f"--time={max(1, self.seconds // 60 + 1)}",
                f"--wrap=sleep {int(self.seconds)}"]
        if self.partition:
            args.insert(2, f"--partition={self.partition}")
        out = self.backend.runner.run(args).stdout.strip()
        self.jobs.append(int(out.split(";")[0]))

    def clear(self) -> None:
        if self.jobs:
            self.backend.runner.run(["scancel", *map(str, self.jobs)], check=False)
        self.jobs = []
