"""Per-step compute and data-loading time of one rank, for the heartbeat's ``compute_s`` and ``data_s``.

A slow peer makes every rank's step slow (they wait for it in a receive or an all-reduce), so the
step's wall time cannot say which rank is slow. Compute time can: it is the wall time spent inside
this rank's own work (its modules' forward and backward, the optimizer step), measured by hooks on
the modules (:meth:`StepTimer.watch`) or by explicit regions (:meth:`StepTimer.compute`). Regions
nest without counting twice. On CUDA the regions measure host time (kernels run asynchronously):
pass ``synchronize=True`` to :meth:`StepTimer.watch` to wait for the device at each region's end.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

# torch warns once per module when no input of a module requires grad (the first pipeline stage):
# the hook then fires for the gradients of its outputs, which is what we time.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


class StepTimer:
    """Accumulates compute and data time until :meth:`take` reads and resets them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compute = 0.0
        self._data = 0.0
        self._depth = 0
        self._since = 0.0

    def _enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._since = time.monotonic()
            self._depth += 1

    def _leave(self, sync: bool = False) -> None:
        if sync:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0:
                self._compute += time.monotonic() - self._since

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """``with timer.compute(): optimizer.step()``: this rank's own work."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """``with timer.data(): batch = next(it)``: reading and preparing the step's samples."""
        started = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._data += time.monotonic() - started

    def watch(self, module: nn.Module, *, synchronize: bool = False) -> list[RemovableHandle]:
        """Count ``module``'s forward and backward as compute (hooks; remove them with the handles)."""
        def enter(*_: Any) -> None:
            self._enter()

        def leave(*_: Any) -> None:
            self._leave(synchronize)

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave),
                module.register_full_backward_pre_hook(enter), module.register_full_backward_hook(leave)]

    def take(self) -> tuple[float, float]:
        """``(compute_s, data_s)`` since the last call; resets both (an unfinished region is dropped)."""
        with self._lock:
            out = (self._compute, self._data)
            self._compute = self._data = 0.0
            self._depth = 0
        return out
