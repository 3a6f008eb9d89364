"""SIGUSR1/SIGTERM -> "checkpoint at the end of this step, then exit 75" (the public
:mod:`slurm_omni.elastic.stop`, under the name the built-in trainer has always used)."""

from __future__ import annotations

from slurm_omni.elastic.stop import STOP_SIGNALS
from slurm_omni.elastic.stop import StopSignals as StopRequest

__all__ = ["STOP_SIGNALS", "StopRequest"]
