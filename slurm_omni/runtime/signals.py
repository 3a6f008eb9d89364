"""SIGUSR1/SIGTERM -> "checkpoint at the end of this step, then exit 75".

Installed by ``omni train`` before it imports torch (seconds), so a signal that arrives while a
rank is still starting is kept instead of killing it (the default action of both signals).
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by a stop signal; the training loop reads it at every step boundary."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum)
        log.warning("runtime: got %s; checkpointing at the end of this step", self.signal.name)
