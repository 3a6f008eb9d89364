"""A slurmctld that answers slowly right after a failure (hundreds of nodes on one loaded host, issue
19): the relaunch's read of the job and node states asks once more with a longer wait instead of
ending the supervisor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slurm_omni.errors import SlurmError, SlurmUnreachable
from slurm_omni.slurm.allocation import AllocationView
from slurm_omni.slurm.runner import CommandResult
from slurm_omni.supervisor.run import SLOW_SLURM_S, Supervisor

NODE = ("NodeName=node3 Arch=x86_64 CoresPerSocket=1 CPUAlloc=4 CPUTot=4 NodeAddr=127.0.0.1 "
        "State=ALLOCATED ThreadsPerCore=1 RealMemory=4096 Partitions=debug\n")


class SlowRunner:
    """Times out on any command given less than ``needs`` seconds; records the timeouts it was given."""

    def __init__(self, needs: float) -> None:
        self.needs = needs
        self.timeouts: list[tuple[str, float]] = []

    def run(self, argv: list[str], *, timeout_s: float | None = None, check: bool = True,
            **_: object) -> CommandResult:
        if argv[:3] == ["scontrol", "show", "topology"]:   # asked once, cached
            return CommandResult(tuple(argv), 0, "", "", 0.0)
        took = 30.0 if timeout_s is None else timeout_s   # the runner's own default
        self.timeouts.append((argv[0], took))
        if took < self.needs:
            raise SlurmUnreachable(f"{argv[0]}: couldn't finish within {took:.0f}s")
        out = "RUNNING\n" if argv[0] == "squeue" else NODE
        return CommandResult(tuple(argv), 0, out, "", 0.0)


def test_the_relaunch_asks_a_slow_slurmctld_again_with_a_longer_wait() -> None:
    runner = SlowRunner(needs=SLOW_SLURM_S)
    view = AllocationView(runner, "7")   # type: ignore[arg-type]
    state, nodes = Supervisor._job_state_and_nodes(SimpleNamespace(slurm=view), ["node3"])  # type: ignore[arg-type]
    assert state == "RUNNING" and [n.name for n in nodes] == ["node3"]
    asked = sorted({t for cmd, t in runner.timeouts if cmd == "squeue"})
    assert asked == [10.0, SLOW_SLURM_S]


def test_a_slurmctld_that_never_answers_is_still_an_error() -> None:
    view = AllocationView(SlowRunner(needs=1e9), "7")   # type: ignore[arg-type]
    with pytest.raises(SlurmError):
        Supervisor._job_state_and_nodes(SimpleNamespace(slurm=view), ["node3"])  # type: ignore[arg-type]
