"""Exit codes of a training rank, read by the sbatch template and the requeue manager.

Four outcomes matter to them: the run is finished, the run saved a checkpoint on request
(SIGUSR1/SIGTERM) and wants to be requeued, it failed (confirm, then recover), or it can never work as
given (bad input: running it again would fail the same way, so nobody restarts it). 75 is EX_TEMPFAIL
and 78 EX_CONFIG from sysexits.h; both are outside what Python (1), the shell (126-128) and signals
(128+N) use.
"""

from __future__ import annotations

import enum

EXIT_DONE = 0
"""``max_steps`` reached and the final checkpoint is complete."""
EXIT_CHECKPOINTED = 75
"""A signal asked to stop; a complete checkpoint of the current step exists. Requeue and resume."""
EXIT_FAILED = 1
"""Anything else: an error, a lost peer, a misaligned sample. Confirm the failure before acting."""
EXIT_BAD_INPUT = 78
"""The script's input cannot work: a checkpoint written by another script, a state_dict that does not
load, a layout the job file does not allow. The heartbeat's ``error`` says what to fix; no restart."""
EXIT_MISALIGNED = 3
"""A failure worth its own code: the text stage got image tokens of another sample (data state bug)."""


class Outcome(enum.Enum):
    DONE = "done"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    BAD_INPUT = "bad_input"


def outcome(exit_code: int) -> Outcome:
    """What a rank's (or srun's) exit code means; negative codes (killed by a signal) are failures."""
    if exit_code == EXIT_DONE:
        return Outcome.DONE
    if exit_code == EXIT_CHECKPOINTED:
        return Outcome.CHECKPOINTED
    if exit_code == EXIT_BAD_INPUT:
        return Outcome.BAD_INPUT
    return Outcome.FAILED
