"""The stop protocol: SIGUSR1 (Slurm's requeue signal) or SIGTERM -> "checkpoint at the end of this
step, then exit 75".

The handler only records the signal; the loop asks :meth:`StopSignals.requested` (or the collective
``Run.should_stop()``) at every step boundary, saves synchronously and exits with
:data:`~slurm_omni.elastic.codes.EXIT_CHECKPOINTED`. Install it early (before importing torch takes
seconds) so that a signal that arrives while the process is still starting is kept instead of killing
it (the default action of both signals).
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopSignals:
    """Set by a stop signal; the training loop reads it at every step boundary."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.installed = False

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> StopSignals:
        if not self.installed:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)
            self.installed = True
        return self

    def ignore_while_exiting(self) -> None:
        """Ignore stop signals from here on: the rank's exit code is decided (after a save, 75).

        A handled signal is no protection while the process exits: CPython 3.11 puts back the
        default action of every signal with a Python handler when the interpreter finalizes
        (``_PySignal_Fini``), before torch's and gloo's teardown, which takes long enough for srun's
        SIGTERM (--kill-on-bad-exit, sent when the first rank exits 75) to land there and kill a
        rank that has saved. An ignored signal stays ignored through finalization."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum)
        log.warning("runtime: got %s; checkpointing at the end of this step", self.signal.name)
