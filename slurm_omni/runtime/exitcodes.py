"""Exit codes of a training rank: :mod:`slurm_omni.elastic.codes`, under the runtime's old name."""

from __future__ import annotations

from slurm_omni.elastic.codes import (
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINTED,
    EXIT_DONE,
    EXIT_FAILED,
    EXIT_MISALIGNED,
    Outcome,
    outcome,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_CHECKPOINTED", "EXIT_DONE", "EXIT_FAILED", "EXIT_MISALIGNED", "Outcome",
           "outcome"]
