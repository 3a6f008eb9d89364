"""The fence: once a newer incarnation started on a checkpoint root, an older one commits nothing.

An incarnation still running after the next one restored (a node that stopped answering keeps it
alive until Slurm's KillWait) could otherwise commit a step newer than the one the next incarnation
restored, and the restore after that would take it. ``<root>/FENCE`` (JSON, replaced atomically)::

    {"format": 1, "incarnation": 4, "run": "1234.4",
     "raises": [{"incarnation": 3, "run": "1233.3", "horizon": 120},
                {"incarnation": 4, "run": "1234.4", "horizon": 180}]}

``incarnation`` is the highest OMNI_INCARNATION that has started on this root. Rank 0 of each
incarnation raises it when it restores (or first saves without a restore), in this order:

1. write the fence with its raise's ``horizon`` pending (null): from here on a commit by an older
   incarnation is refused (``fenced``): its shards are dropped and its temporary directory removed;
2. list the root: the newest checkpoint that counts is the horizon, and a checkpoint of an older
   incarnation newer than an earlier raise's horizon gets a ``FENCED`` marker;
3. write the fence again with the horizon; only then do the ranks read which checkpoint to restore.

Between 1 and 2 the caller may finish what an older incarnation left one commit short (``finish``:
``persist.finish_orphaned``, a step every rank of it wrote but its rank 0, lost with its node, never
committed): with the fence pending no older incarnation commits any more, and the step is listed in 2
like a commit that landed before the fence.

A commit of an older incarnation that checked the fence just before step 1 can still land after it.
Landing before step 2, it is complete when listed and counts (its check came first); landing after,
it is newer than the horizon (that incarnation saves ascending steps from what it restored) and does
not count: a complete checkpoint counts only if, for every raise by a higher incarnation, its step is
at most that raise's horizon. Checkpoints made before the fence rose, by any incarnation, are exactly
what the new one restores from. Other ranks wait for their incarnation's horizon before they read,
so every rank picks the same checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_omni.checkpoint import format as fmt
from slurm_omni.errors import CheckpointError
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic

log = logging.getLogger(__name__)

FENCE = "FENCE"
FENCE_FORMAT = 1
KEEP_RAISES = 32
"""Raises kept in the file: a late commit is marked FENCED at the next raise, so older ones are done."""


@dataclass(frozen=True, slots=True)
class Raise:
    incarnation: int
    run: str
    horizon: int | None    # newest step that counted when it listed the root; None: still listing
    pending: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "run": self.run,
                "horizon": "pending" if self.pending else self.horizon}


@dataclass(frozen=True, slots=True)
class Fence:
    incarnation: int
    run: str
    raises: tuple[Raise, ...]

    def counts(self, step: int, incarnation: int | None) -> bool:
        """Does a complete checkpoint of ``step`` committed by ``incarnation`` count?"""
        inc = -1 if incarnation is None else incarnation
        return all(r.pending or inc >= r.incarnation or (r.horizon is not None and step <= r.horizon)
                   for r in self.raises)

    def horizon_of(self, incarnation: int) -> Raise | None:
        return next((r for r in reversed(self.raises) if r.incarnation == incarnation), None)


def read_fence(root: Path) -> Fence | None:
    """The root's fence, or None when no fenced incarnation started there."""
    try:
        data = json.loads(read_bounded(root / FENCE, 1 << 20))   # a fifo is refused, not waited on
    except FileRejected as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None
        raise CheckpointError(f"checkpoint: couldn't read {root / FENCE}: {e} (remove it only once no "
                              f"older incarnation of the job can still run)") from e
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint: couldn't read {root / FENCE}: {e} (remove it only once no "
                              f"older incarnation of the job can still run)") from e
    try:
        raises = tuple(Raise(int(r["incarnation"]), str(r["run"]),
                             None if r["horizon"] in (None, "pending") else int(r["horizon"]),
                             pending=r["horizon"] == "pending")
                       for r in data["raises"])
        return Fence(int(data["incarnation"]), str(data["run"]), raises)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: couldn't read {root / FENCE}: malformed ({e!r})") from e


def _write(root: Path, fence: Fence) -> None:
    data = {"format": FENCE_FORMAT, "incarnation": fence.incarnation, "run": fence.run,
            "raises": [r.to_json() for r in fence.raises]}
    write_atomic(root / FENCE, json.dumps(data).encode(), owner=fence.run)


def fenced_by(root: Path, incarnation: int | None) -> Fence | None:
    """The fence that shuts ``incarnation`` out of ``root``, or None when it may commit."""
    if incarnation is None:
        return None
    fence = read_fence(root)
    return fence if fence is not None and fence.incarnation > incarnation else None


def raise_fence(root: Path, incarnation: int, run: str, *,
                finish: Callable[[Path, int], object] | None = None) -> Fence:
    """Rank 0 of a starting incarnation: shut older ones out, then fix the horizon (see the module);
    ``finish(root, incarnation)`` runs once older incarnations are shut out, before the listing."""
    cur = read_fence(root)
    if cur is not None and cur.incarnation > incarnation:
        log.warning("checkpoint: incarnation %d (%s) starts after incarnation %d (%s) on %s: it restores, "
                    "but it will commit nothing", incarnation, run, cur.incarnation, cur.run, root)
        return cur
    earlier = cur.raises if cur is not None else ()
    done = next((r for r in earlier if r.incarnation == incarnation and r.run == run and not r.pending), None)
    if done is not None:
        return cur  # type: ignore[return-value]   # raised already (restore called again)
    if cur is not None and cur.incarnation == incarnation and cur.run != run:
        log.warning("checkpoint: incarnation %d started twice on %s (%s, now %s): numbers should not repeat",
                    incarnation, root, cur.run, run)
    kept = tuple(r for r in earlier if r.incarnation < incarnation)[-(KEEP_RAISES - 1):]
    before = Fence(incarnation, run, kept)
    _write(root, Fence(incarnation, run, (*kept, Raise(incarnation, run, None, pending=True))))
    if finish is not None:
        finish(root, incarnation)
    horizon = None
    for entry in fmt.scan(root):
        if entry.status is not fmt.Status.COMPLETE:
            continue
        if before.counts(entry.step, entry.incarnation):
            horizon = entry.step if horizon is None else max(horizon, entry.step)
        else:
            mark_fenced(entry.path, f"committed by incarnation {entry.incarnation} after a newer one started")
    fence = Fence(incarnation, run, (*kept, Raise(incarnation, run, horizon)))
    _write(root, fence)
    log.info("checkpoint: incarnation %d (%s) raised the fence on %s; newest checkpoint before it: %s",
             incarnation, run, root, "none" if horizon is None else f"step-{horizon}")
    return fence


def await_raise(root: Path, incarnation: int, timeout_s: float) -> Fence | None:
    """Ranks other than 0: wait until rank 0 of ``incarnation`` fixed its horizon (or a newer one
    started), so that every rank reads the same checkpoints."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        fence = read_fence(root)
        if fence is not None and (fence.incarnation > incarnation or (
                (r := fence.horizon_of(incarnation)) is not None and not r.pending)):
            return fence
        if time.monotonic() > deadline:
            log.warning("checkpoint: rank 0 of incarnation %d raised no fence on %s within %.1f s; restoring "
                        "without waiting", incarnation, root, timeout_s)
            return fence
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def mark_fenced(path: Path, reason: str) -> None:
    """Take a late commit of an older incarnation out of use, keeping its files."""
    try:
        write_atomic(path / fmt.FENCED, (reason.strip() + "\n").encode())
        log.warning("checkpoint: %s marked FENCED: %s", path.name, reason)
    except OSError as e:
        log.warning("checkpoint: couldn't mark %s FENCED: %s", path, e)
