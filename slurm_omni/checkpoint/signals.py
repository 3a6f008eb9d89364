"""The signal Slurm sends before a time limit or preemption, as a flag the training loop polls.

``--signal=B:USR1@T`` reaches the batch shell, which forwards it to the step. Saving inside a signal
handler would run torch in the middle of whatever the step was doing; the handler only records the
signal, and the loop calls ``engine.save(step, state, sync=True)`` at the next step boundary. NCCL may
install its own SIGUSR1 handler (submitit moved to USR2 for that reason): the signals are a parameter.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any, Self

log = logging.getLogger(__name__)


class SaveRequest:
    def __init__(self, signals: Iterable[signal.Signals] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def pending(self) -> bool:
        return self.signum is not None

    def install(self) -> Self:
        """Take over the signals (main thread only); ``uninstall`` gives them back."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("checkpoint: got %s; saving at the next step boundary", signal.Signals(signum).name)

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
