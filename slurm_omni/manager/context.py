"""What the recovery, watch and fail-slow code use of the running manager: one small context below
them, so that ``manager/`` imports run one way (daemon -> recovery, watch, failslow -> context).

``ManagerContext`` names the ten members they reach for; the daemon's ``Manager`` is one (mypy checks
it where the daemon hands itself over), and a test may pass any object that has them.
``ManagerConfig`` lives here too: the context carries it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from slurm_omni.config.site import SiteConfig
from slurm_omni.manager.actions import Actions
from slurm_omni.manager.journal import Journal
from slurm_omni.manager.sources import Poller
from slurm_omni.policy.confirm import ConfirmConfig
from slurm_omni.slurm.backend import SlurmBackend


@dataclass(frozen=True, kw_only=True, slots=True)
class ManagerConfig:
    site: SiteConfig
    state_dir: Path
    """Journal (journal.sqlite), timeline export (timeline.json) and rendered scripts."""
    poll_interval_s: float = 2.0
    """One sinfo + one squeue per this many seconds, for every job together."""
    tick_s: float = 0.25
    """How often the spool and heartbeats are read and verdicts evaluated."""
    grow: bool = True
    """Grow a shrunk job back when free nodes allow."""
    stop_timeout_s: float = 60.0
    """Before a grow: how long the ranks may take to checkpoint and stop on USR1."""
    end_wait_s: float = 35.0
    """After cancelling an incarnation: how long to wait for the poll to show it no longer RUNNING
    or COMPLETING before submitting the next (its ranks checkpoint on scancel's SIGTERM until
    KillWait, 30 s by default, ends them; once the next incarnation starts, the checkpoint fence
    refuses their saves, so waiting lets the next one restore the last of them)."""
    crash_at: str = ""
    """Drills only: SIGKILL the manager itself at this point (e.g. ``resubmit:after_submit``)."""

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.sqlite"

    @property
    def timeline_path(self) -> Path:
        return self.state_dir / "timeline.json"

    def confirm_config(self) -> ConfirmConfig:
        d = self.site.detection
        return replace(d.confirm, initial_heartbeat_s=d.heartbeat_interval_s, hang_floor_s=d.confirmation_window_s,
                       stuck_floor_s=d.progress_window_s)


class ManagerContext(Protocol):
    """The manager as its recovery, watch and fail-slow code see it."""

    config: ManagerConfig
    backend: SlurmBackend
    clock: Callable[[], float]
    user: str
    """The user the manager runs as (whose jobs it keeps)."""
    journal: Journal
    poller: Poller
    actions: Actions
    confirm_config: ConfirmConfig

    def crash(self, point: str) -> None:
        """Drills: die at ``point`` as SIGKILL would (``ManagerConfig.crash_at``)."""

    def mark_phase(self, job: str, incarnation: int, phase: str, at: float, **extra: Any) -> None:
        """Journal a phase of a recovery timeline (the timeline file follows)."""
