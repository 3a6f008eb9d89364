"""Exit codes of a training rank, read by the sbatch template and the requeue manager.

Only three outcomes matter to them: the run is finished, the run saved a checkpoint on request
(SIGUSR1/SIGTERM) and wants to be requeued, or it failed. 75 is EX_TEMPFAIL from sysexits.h
("try again later"); it is outside what Python (1), the shell (126-128) and signals (128+N) use.
"""

from __future__ import annotations

import enum

EXIT_DONE = 0
"""``max_steps`` reached and the final checkpoint is complete."""
EXIT_CHECKPOINTED = 75
"""A signal asked to stop; a complete checkpoint of the current step exists. Requeue and resume."""
EXIT_FAILED = 1
"""Anything else: an error, a lost peer, a misaligned sample. Confirm the failure before acting."""
EXIT_MISALIGNED = 3
"""A failure worth its own code: the text stage got image tokens of another sample (data state bug)."""


class Outcome(enum.Enum):
    DONE = "done"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


def outcome(exit_code: int) -> Outcome:
    """What a rank's (or srun's) exit code means; negative codes (killed by a signal) are failures."""
    if exit_code == EXIT_DONE:
        return Outcome.DONE
    if exit_code == EXIT_CHECKPOINTED:
        return Outcome.CHECKPOINTED
    return Outcome.FAILED
