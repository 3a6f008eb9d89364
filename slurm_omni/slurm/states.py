"""Slurm's node and job states mapped onto ours, through one table each; anything else is UNKNOWN."""

from __future__ import annotations

from collections.abc import Iterable

from slurm_omni.slurm.types import JobState, NodeState

# Base states as every version prints them (sinfo --json "state", scontrol "State=" before the first '+');
# v0.0.40+ lists the base state with its flags, e.g. ["IDLE", "DRAIN"].
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

# Node flags each version prints (22.05 "state_flags", v0.0.40+ in the "state" list after the base).
# The ones that mean trouble are read by node_state(); the rest change nothing here.
SLURM_NODE_FLAGS = frozenset({
    "CLOUD", "COMPLETING", "DRAIN", "DYNAMIC_FUTURE", "DYNAMIC_NORM", "FAIL", "INVALID_REG",
    "MAINTENANCE", "NOT_RESPONDING", "PLANNED", "POWER_DOWN", "POWER_DRAIN", "POWERED_DOWN",
    "POWERING_DOWN", "POWERING_UP", "REBOOT_CANCELED", "REBOOT_ISSUED", "REBOOT_REQUESTED", "RES",
    "RESERVED", "RESUME", "UNDRAIN", "BLOCKED", "EXTERNAL",
})

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
    "SPECIAL_EXIT": JobState.REQUEUED,
    "STOPPED": JobState.SUSPENDED,
    "REVOKED": JobState.CANCELLED,
    "POWER_UP_NODE": JobState.PENDING,
    "LAUNCH_FAILED": JobState.FAILED,
    "RECONFIG_FAIL": JobState.FAILED,
}

JOB_BASE_STATES = frozenset({"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
                             "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"})

# A flag named here wins over the base state, in this order: the order in which Slurm's own
# job_state_string() (22.05, which printed one word) tests them, so that a v0.0.40+ list such as
# ["PENDING", "REQUEUED"] reads as 22.05's "REQUEUED". Other flags (UPDATE_DB, EXPEDITING, ...) change nothing.
JOB_FLAG_PRECEDENCE = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
                       "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT")


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


def split_state_list(states: Iterable[str], *, node: bool) -> tuple[str, frozenset[str]]:
    """``["IDLE", "DRAIN"]`` -> ("IDLE", {"DRAIN"}): the first base state, and every other word a flag
    (UNKNOWN when no base state is listed)."""
    words = [s.strip().upper() for s in states if s.strip()]
    bases = SLURM_NODE_STATES if node else JOB_BASE_STATES
    base = next((w for w in words if w in bases), "UNKNOWN")
    return base, frozenset(w for w in words if w != base)


def job_state(text: str) -> JobState:
    """Our state for one word (22.05's ``job_state``, ``squeue -o %T``)."""
    return SLURM_JOB_STATES.get(text.strip().upper(), JobState.UNKNOWN)


def job_state_of(states: Iterable[str]) -> JobState:
    """Our state for a v0.0.40+ ``job_state`` list (or a one-word list): a flag of
    JOB_FLAG_PRECEDENCE wins over the base state, as in 22.05's single word."""
    words = [s.strip().upper() for s in states if s.strip()]
    for flag in JOB_FLAG_PRECEDENCE:
        if flag in words:
            return SLURM_JOB_STATES[flag]
    base, _ = split_state_list(words, node=False)
    if base == "UNKNOWN" and len(words) == 1:
        return job_state(words[0])
    return SLURM_JOB_STATES.get(base, JobState.UNKNOWN)
