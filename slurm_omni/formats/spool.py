"""The two kinds of file in the manager's spool, one JSON object each (written to a temporary name
and renamed).

``node-<kind>-<ns>-<pid>.json``, written by the strigger program (``manager/events.trigger_main``;
strigger appends the hostlist to the program's arguments)::

    {"version": 1, "kind": "down", "nodes": "node[1-2]", "time": 1764460000.12}

``kind`` is one of down, fail, drained, up; ``nodes`` a Slurm hostlist; ``time`` epoch seconds.

``fault-<job>.<step>-<node>-<task>-<ns>.json``, written by the SPANK plugin for a task that exited
abnormally (spank/fault.c, ``omni_fault_format``, version 1; it formats into 2048 bytes)::

    {"version": 1, "kind": "task_exit", "job_id": 43, "het_job_id": 42, "het_offset": 1,
     "step_id": 0, "node": "n3", "stage": "text", "stage_index": 1, "stage_rank": 2, "task_id": 5,
     "local_task_id": 1, "pid": 77, "exit_code": null, "signal": 9, "core_dumped": false,
     "time": "2026-11-30T00:00:00.120Z", "time_unix": 1764460800.120000000}

-1 in ``het_job_id``, ``het_offset``, ``stage_index`` and ``stage_rank`` means none (an ordinary
job, or no stage). Keys are closed: an unknown key is an error.
"""

from __future__ import annotations

import functools
from typing import Annotated, Literal

import msgspec

from slurm_omni.errors import SlurmError
from slurm_omni.policy.confirm import NodeObservation, TaskExit
from slurm_omni.slurm import hostlist
from slurm_omni.slurm.types import NodeState

VERSION = 1
MAX_NODE_EVENT_BYTES = 64 * 1024    # a hostlist of thousands of unrelated names still fits
MAX_FAULT_BYTES = 4096              # spank/fault.c formats into 2048 bytes at most
NODE_EVENT_KINDS = ("down", "fail", "drained", "up")
NodeEventKind = Literal["down", "fail", "drained", "up"]

_KIND_STATE = {"down": NodeState.DOWN, "fail": NodeState.FAIL, "drained": NodeState.DRAINED,
               "up": NodeState.IDLE}

Time = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
OrNone = Annotated[int, msgspec.Meta(ge=-1)]
"""-1: none."""


def printable_name(value: str, key: str) -> None:
    if not 0 < len(value) < 256 or not value.isprintable():
        raise ValueError(f"{key} = {value[:80]!r} is not allowed (1 to 255 printable characters)")


class NodeEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True, dict=True):
    version: Literal[1]
    kind: NodeEventKind
    nodes: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NODE_EVENT_BYTES)]
    """A Slurm hostlist."""
    time: Time

    def __post_init__(self) -> None:
        try:
            names = hostlist.expand(self.nodes)
        except SlurmError as e:
            raise ValueError(str(e)) from None
        if not names:
            raise ValueError(f"nodes = {self.nodes[:80]!r} names no node")
        for name in names:
            printable_name(name, "nodes")
        self.__dict__["node_names"] = tuple(names)

    @functools.cached_property
    def node_names(self) -> tuple[str, ...]:
        """The hostlist expanded (done once, when the record is made)."""
        return tuple(hostlist.expand(self.nodes))

    def observations(self) -> list[NodeObservation]:
        state = _KIND_STATE[self.kind]
        return [NodeObservation(self.time, n, state, f"strigger {self.kind}") for n in self.node_names]


class FaultRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: Literal[1]
    kind: Literal["task_exit"]
    job_id: Annotated[int, msgspec.Meta(gt=0)]
    het_job_id_or_none: OrNone = msgspec.field(name="het_job_id")
    het_offset_or_none: OrNone = msgspec.field(name="het_offset")
    step_id: Count
    node: str
    stage: Annotated[str, msgspec.Meta(max_length=255)]
    stage_rank_or_none: OrNone = msgspec.field(name="stage_rank")
    task_id: Count
    local_task_id: Count
    pid: Count
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=255)] | None
    signal: Annotated[int, msgspec.Meta(gt=0, lt=128)] | None
    core_dumped: bool
    time_text: Annotated[str, msgspec.Meta(max_length=63)] = msgspec.field(name="time")
    time: Time = msgspec.field(name="time_unix")
    stage_index: OrNone = -1   # spank/fault.c writes it since ec131cd

    def __post_init__(self) -> None:
        printable_name(self.node, "node")
        if self.stage and not self.stage.isprintable():
            raise ValueError(f"stage = {self.stage[:80]!r} is not printable")
        if (self.exit_code is None) == (self.signal is None):
            raise ValueError("expected exactly one of exit_code and signal")

    @property
    def het_job_id(self) -> int | None:
        return None if self.het_job_id_or_none < 0 else self.het_job_id_or_none

    @property
    def het_offset(self) -> int | None:
        return None if self.het_offset_or_none < 0 else self.het_offset_or_none

    @property
    def stage_rank(self) -> int | None:
        return None if self.stage_rank_or_none < 0 else self.stage_rank_or_none

    def observation(self) -> TaskExit:
        return TaskExit(self.time, self.node, self.het_offset, self.task_id, self.exit_code, self.signal)


SpoolEvent = NodeEvent | FaultRecord
