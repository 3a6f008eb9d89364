"""Slurm's node and job states mapped onto ours, through one table each; anything else is UNKNOWN."""

from __future__ import annotations

from collections.abc import Iterable

from slurm_omni.slurm.types import JobState, NodeState

# Base states as Slurm 22.05 prints them (sinfo --json "state", scontrol "State=" before the first '+').
SLURM_NODE_STATES: dict[str, NodeState] = {
    "IDLE": NodeState.IDLE,
    "ALLOCATED": NodeState.ALLOCATED,
    "ALLOC": NodeState.ALLOCATED,
    "MIXED": NodeState.MIXED,
    "DOWN": NodeState.DOWN,
    "ERROR": NodeState.FAIL,
    "FUTURE": NodeState.FUTURE,
    "UNKNOWN": NodeState.UNKNOWN,
}

SLURM_JOB_STATES: dict[str, JobState] = {
    "PENDING": JobState.PENDING,
    "RUNNING": JobState.RUNNING,
    "SUSPENDED": JobState.SUSPENDED,
    "COMPLETING": JobState.COMPLETING,
    "COMPLETED": JobState.COMPLETED,
    "FAILED": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT,
    "NODE_FAIL": JobState.NODE_FAIL,
    "PREEMPTED": JobState.PREEMPTED,
    "REQUEUED": JobState.REQUEUED,
    "REQUEUE_FED": JobState.REQUEUED,
    "REQUEUE_HOLD": JobState.REQUEUED,
    "OUT_OF_MEMORY": JobState.OUT_OF_MEMORY,
    "BOOT_FAIL": JobState.BOOT_FAIL,
    "DEADLINE": JobState.DEADLINE,
    "CONFIGURING": JobState.PENDING,
    "RESIZING": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.COMPLETING,
    "RESV_DEL_HOLD": JobState.PENDING,
}


def node_state(base: str, flags: Iterable[str] = ()) -> NodeState:
    """Our state for Slurm's base state and flags; flags that mean trouble win over the base state."""
    flags = {f.upper() for f in flags}
    base = base.upper()
    if "FAIL" in flags:
        return NodeState.FAIL
    if base == "DOWN":
        return NodeState.DOWN
    if "NOT_RESPONDING" in flags:
        return NodeState.NOT_RESPONDING
    if "DRAIN" in flags:
        return NodeState.DRAINING if base in ("ALLOCATED", "ALLOC", "MIXED") else NodeState.DRAINED
    if "FUTURE" in flags:
        return NodeState.FUTURE
    return SLURM_NODE_STATES.get(base, NodeState.UNKNOWN)


def split_node_state(text: str) -> tuple[str, frozenset[str]]:
    """``IDLE+DRAIN`` -> ("IDLE", {"DRAIN"}); ``idle*`` (sinfo's not-responding mark) is handled too."""
    text = text.strip()
    flags: set[str] = set()
    if text.endswith("*"):
        text = text[:-1]
        flags.add("NOT_RESPONDING")
    base, *rest = text.upper().split("+")
    flags.update(rest)
    return base, frozenset(flags)


def job_state(text: str) -> JobState:
    return SLURM_JOB_STATES.get(text.strip().upper(), JobState.UNKNOWN)
