"""How a scale-bench job ends, and what its waits say when they end without what they waited for
(bench/scale_bench.py; pure: no command, no file, no clock of its own).

The ranks run with a step budget they never reach (``step_budget``: the job's time limit at the
pace), and the bench ends the run itself once its last fault is checked: it writes a finish time
(``finish_time``) that every light rank turns into one last step (bench/light_rank.py,
``OMNI_LIGHT_FINISH_FILE``). So no fault depends on a step plan guessed from the size before
(23:55, 512 nodes: a 56-step plan from 256's figures, the killed step's old ranks ran on 34-38 steps,
and the crash and hang were never injected).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

JOB_TIME_S = 3600
"""The jobs' time limit (sbatch and salloc ``--time``): Slurm ends a job the bench lost."""
FINISH_AHEAD_S = 2.0
"""The finish time is at least this far ahead of its write (and at least FINISH_STEPS paced steps):
a rank reads the file after every step and none is ahead of its life's clock, so one step ahead is
enough for none to have passed the last step; the rest is for the write itself at load 2,000."""
FINISH_STEPS = 3


class Beat(Protocol):
    """What the checks read of a heartbeat (formats/heartbeat.HeartbeatRecord)."""

    @property
    def step(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def exit_code(self) -> int | None: ...
    @property
    def last_checkpoint_step(self) -> int | None: ...


def step_budget(pace_s: float, job_time_s: float = JOB_TIME_S) -> int:
    """OMNI_MAX_STEPS for the ranks: more steps than the job's time limit holds at the pace (a rank
    never steps faster than paced), so that the budget never ends a run before the bench does."""
    if pace_s <= 0:
        raise ValueError(f"scale bench: couldn't size the step budget: pace {pace_s} s (must be > 0)")
    return math.ceil(job_time_s / pace_s) + 1


def finish_time(now: float, pace_s: float) -> float:
    """The finish time to write at ``now`` (seconds since the epoch)."""
    return now + max(FINISH_AHEAD_S, FINISH_STEPS * pace_s)


def wait_ended(job_state: str, waited_s: float, timeout_s: float) -> str:
    """What ended a wait that did not see what it waited for: the job (its Slurm state), or the
    wait's own timeout."""
    if job_state:
        return f"the job ended ({job_state}) after {waited_s:.0f} s of the wait's {timeout_s:.0f} s"
    return f"timed out after {waited_s:.0f} s"


def beats_said(beats: Sequence[Beat], ranks: int, launch: int, budget: int) -> str:
    """What the ranks of ``launch`` said when a wait gave up: how many beat, their steps and least
    checkpoint, and whether they ran out of steps (a rank done at the budget)."""
    if not beats:
        return f"no rank beat in launch {launch}"
    steps = sorted(b.step for b in beats)
    least = min((b.last_checkpoint_step or 0) for b in beats)
    out = (f"{len(beats)}/{ranks} ranks beat in launch {launch}: steps {steps[0]}-{steps[-1]}, the least "
           f"checkpoint step {least}")
    phases = sorted({b.phase for b in beats})
    if phases != ["training"]:
        out += f", phases {', '.join(phases)}"
    if any(b.phase == "done" and b.step >= budget for b in beats):
        out += f"; steps exhausted: ranks ended at their budget of {budget}"
    return out


def finish_check(beats: Sequence[Beat], ranks: int, budget: int) -> tuple[bool, str]:
    """Every rank of the last launch done (exit 0) at one step, its last checkpoint, below the budget
    (the finish time ended the run, not the steps running out): (ok, what was found)."""
    done = [b for b in beats if b.phase == "done" and b.exit_code == 0]
    steps = sorted({b.step for b in done})
    saved = all(b.last_checkpoint_step == b.step for b in done)
    where = (f"at step {steps[0]}" if len(steps) == 1 else f"at steps {steps[0]}-{steps[-1]} ({len(steps)} different)"
             if steps else "")
    said = f"{len(done)}/{ranks} ranks done {where}".rstrip()
    if steps and steps[-1] >= budget:
        said += f" (steps exhausted: the budget is {budget})"
    elif steps and not saved:
        said += " (not every one saved its last step)"
    ok = len(done) == ranks and len(steps) == 1 and steps[0] < budget and saved
    return ok, said


def unplanned(launches: int, injected: Iterable[int]) -> list[int]:
    """The relaunches (launch numbers 1 .. launches - 1) that followed no injected fault: launch j
    follows a fault injected into launch j - 1."""
    caused = {k + 1 for k in injected}
    return [j for j in range(1, launches) if j not in caused]


def launch_ranks(components: Sequence[Sequence[str]], tasks_per_node: int) -> int:
    """How many ranks a launch runs: its nodes as the supervisor journaled them (a relaunch it shrank
    runs fewer than the job's first launch), ``tasks_per_node`` on each. The bench's waits and checks
    count a launch's ranks by this, not by the job's size (08:02, 512 nodes: a relaunch shrunk to 1,852
    ranks was waited for as 2,044 until the wait's 600 s ran out)."""
    if tasks_per_node < 1:
        raise ValueError(f"scale bench: couldn't count a launch's ranks: {tasks_per_node} tasks per node (must be >= 1)")
    return tasks_per_node * sum(len(c) for c in components)


def ranks_said(ranks: int, first_ranks: int) -> str:
    """A launch's rank count as the checks say it: ``N`` or ``N (shrunk from M)``."""
    return f"{ranks}" if ranks == first_ranks else f"{ranks} (shrunk from {first_ranks})"
