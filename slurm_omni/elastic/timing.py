"""Per-step compute and data-loading time of one rank, for the heartbeat's ``compute_s`` and ``data_s``.

A slow peer makes every rank's step slow (they wait for it in a receive or an all-reduce), so the
step's wall time cannot say which rank is slow. Compute time can: it is the wall time spent inside
this rank's own work (its modules' forward and backward, the optimizer step), measured by hooks on
the modules (:meth:`StepTimer.watch`), by explicit regions (:meth:`StepTimer.compute`), or, for a
``torch.distributed.pipelining`` schedule, by the stages' own chunks
(:class:`slurm_omni.elastic.pipelining.TimedStage`). Regions nest without counting twice. On CUDA
the regions measure host time (kernels run asynchronously): pass ``synchronize=True`` to
:meth:`StepTimer.watch` or :meth:`StepTimer.compute` to wait for the device at each region's end.

Inside those regions the timer also counts the time this thread was runnable but waited for a CPU
(the kernel's run-queue delay, ``/proc/thread-self/schedstat``): ``cpu_wait_s``. Where several
"nodes" share a host's cores (the embedded cluster, an oversubscribed node), a rank that waits for
the CPU another job holds is not slow itself, and a stalled rank's pipeline partner gets the cores
and looks fast; the fail-slow detector leaves that wait out (site ``[failslow] count_cpu_wait``).
A stopped process (SIGSTOP) or a slow device is not waiting for a CPU: that time stays the rank's own.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:   # torch only for the hooks' types: the drill and the manager import cpu_wait_s cheaply
    from torch import nn
    from torch.utils.hooks import RemovableHandle

# torch warns once per module when no input of a module requires grad (the first pipeline stage):
# the hook then fires for the gradients of its outputs, which is what we time.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")


SCHEDSTAT = "/proc/thread-self/schedstat"
_schedstat_ok = os.path.exists(SCHEDSTAT)


def cpu_wait_s() -> float:
    """This thread's run-queue delay so far (seconds runnable without a CPU); 0.0 where the kernel
    does not say (no schedstat)."""
    global _schedstat_ok
    if not _schedstat_ok:
        return 0.0
    try:
        fd = os.open(SCHEDSTAT, os.O_RDONLY)
        try:
            fields = os.read(fd, 128).split()
        finally:
            os.close(fd)
        return int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        _schedstat_ok = False
        return 0.0


class StepTimes(NamedTuple):
    compute_s: float
    data_s: float
    cpu_wait_s: float
    """Of ``compute_s + data_s``: the time the timed thread waited for a CPU (run-queue delay)."""


class StepTimer:
    """Accumulates compute and data time until :meth:`take` reads and resets them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        """Seconds, monotonic (a test passes its own)."""
        self.on_draw: Callable[[bool], None] | None = None
        """Called with True when a :meth:`data` region begins and False when it ends."""
        self._lock = threading.Lock()
        self._compute = 0.0
        self._data = 0.0
        self._wait = 0.0
        self._depth = 0
        self._since = 0.0
        self._wait_since = 0.0

    def _enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._since = self._clock()
                self._wait_since = cpu_wait_s()
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
                self._compute += self._clock() - self._since
                self._wait += max(0.0, cpu_wait_s() - self._wait_since)

    @contextlib.contextmanager
    def compute(self, *, synchronize: bool = False) -> Iterator[None]:
        """``with timer.compute(): optimizer.step()``: this rank's own work. ``synchronize``: wait for
        the CUDA device at the region's end, so that its kernels count here and not in the next wait."""
        self._enter()
        try:
            yield
        finally:
            self._leave(synchronize)

    @contextlib.contextmanager
    def data(self) -> Iterator[None]:
        """``with timer.data(): batch = next(it)``: reading and preparing the step's samples. Each
        region is one draw for :attr:`on_draw` (the run counts them: ``elastic/draws.py``)."""
        if self.on_draw is not None:
            self.on_draw(True)
        started, waited = self._clock(), cpu_wait_s()
        try:
            yield
        finally:
            with self._lock:
                self._data += self._clock() - started
                self._wait += max(0.0, cpu_wait_s() - waited)
            if self.on_draw is not None:
                self.on_draw(False)

    def watch(self, module: nn.Module, *, synchronize: bool = False) -> list[RemovableHandle]:
        """Count ``module``'s forward and backward as compute (hooks; remove them with the handles)."""
        def enter(*_: Any) -> None:
            self._enter()

        def leave(*_: Any) -> None:
            self._leave(synchronize)

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave),
                module.register_full_backward_pre_hook(enter), module.register_full_backward_hook(leave)]

    def take(self) -> tuple[float, float]:
        """``(compute_s, data_s)`` since the last call; resets them (an unfinished region is dropped)."""
        t = self.take_times()
        return t.compute_s, t.data_s

    def take_times(self) -> StepTimes:
        """Compute, data and CPU-wait time since the last call; resets them."""
        with self._lock:
            out = StepTimes(self._compute, self._data, min(self._wait, self._compute + self._data))
            self._compute = self._data = self._wait = 0.0
            self._depth = 0
        return out
