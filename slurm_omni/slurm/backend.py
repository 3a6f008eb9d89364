"""The interface every Slurm backend offers, and the choice between them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurm_omni.slurm.types import Job, Node, Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """One poll of the cluster: serves every registered job (never a query per job)."""

    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    topology: Topology
    taken_at: float           # time.time() when the poll finished
    unreadable_jobs: frozenset[int] = frozenset()
    """Ids of jobs whose records Slurm printed but could not be read: skipped, not gone."""

    def job(self, job_id: int) -> Job | None:
        return next((j for j in self.jobs if j.job_id == job_id
                     or any(c.job_id == job_id for c in j.components)), None)


class SlurmBackend(Protocol):
    name: str

    def topology(self, *, refresh: bool = False) -> Topology: ...
    def nodes(self) -> list[Node]: ...
    def jobs(self, *, user: str | None = None) -> list[Job]: ...
    def snapshot(self, *, user: str | None = None) -> ClusterSnapshot: ...
    def submit(self, script_path: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None) -> int: ...
    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None: ...
    def requeue(self, job_ref: str, *, hold: bool = False) -> None: ...
    def set_node_state(self, node: str, state: str, reason: str = "") -> None: ...


def get_backend(prefer: str = "auto", env: Mapping[str, str] | None = None) -> SlurmBackend:
    """``pyslurm`` when it imports (and ``prefer`` allows), else the command-line backend."""
    from slurm_omni.slurm.cli_backend import CliBackend

    if prefer in ("auto", "pyslurm"):
        from slurm_omni.slurm import pyslurm_backend

        if pyslurm_backend.available():
            return pyslurm_backend.PyslurmBackend(env=env)
        if prefer == "pyslurm":
            from slurm_omni.errors import SlurmError
            raise SlurmError(f"backend: couldn't use pyslurm: {pyslurm_backend.unavailable_reason()}")
        log.debug("pyslurm unavailable (%s); using the command-line backend",
                  pyslurm_backend.unavailable_reason())
    return CliBackend(env=env)
