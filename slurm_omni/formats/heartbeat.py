"""The per-rank heartbeat file: ``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json``, one JSON object::

    {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42",
     "step": 17, "phase": "training", "time": 1764460000.12, "step_time_s": 0.031,
     "compute_s": 0.021, "data_s": 0.002, "node": "node3", "last_checkpoint_step": 10, "beats": 9,
     "metrics": {"loss": 2.31, "samples": 8}}

The meaning of each key is documented with the writer, ``slurm_omni.elastic.heartbeat`` (every
training script's heartbeat, the built-in trainer's too); the manager (manager/events.py) reads it.
Keys this reader does not know are ignored (a newer writer may add measurements); the known ones are
checked strictly.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slurm_omni.policy.confirm import Heartbeat

MAX_HEARTBEAT_BYTES = 4096
MAX_METRICS = 16
MAX_ERROR_CHARS = 400
PHASES = ("starting", "training", "checkpointing", "stopping", "done", "failed")
Phase = Literal["starting", "training", "checkpointing", "stopping", "done", "failed"]

_Count = Annotated[int, msgspec.Meta(ge=0)]
_MetricName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
_Seconds = Annotated[float, msgspec.Meta(ge=0)]


class HeartbeatRecord(msgspec.Struct, frozen=True, kw_only=True):
    rank: _Count
    stage: _Count
    dp_rank: _Count
    pid: _Count
    incarnation: _Count
    job_id: Annotated[str, msgspec.Meta(max_length=63)]
    step: Annotated[int, msgspec.Meta(ge=-1)]
    phase: Phase
    time: Annotated[float, msgspec.Meta(gt=0)]
    step_time_s: _Seconds | None = None
    last_checkpoint_step: int | None = None
    beats: _Count = 0
    node: Annotated[str, msgspec.Meta(max_length=255)] = ""
    compute_s: _Seconds | None = None
    """Of ``step_time_s``: the time in the model's forward and backward (absent from older runtimes)."""
    data_s: _Seconds | None = None
    """Of ``step_time_s``: the time waiting for the next batch (absent from older runtimes)."""
    cpu_wait_s: _Seconds | None = None
    """Of ``compute_s + data_s``: the time the rank was runnable but waited for a CPU (absent from
    older runtimes)."""
    metrics: Annotated[dict[_MetricName, int | float], msgspec.Meta(max_length=MAX_METRICS)] = msgspec.field(
        default_factory=dict)
    """Numbers the training script passed with its last step (loss, samples, tokens, ...)."""
    error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] = ""
    """With phase ``failed``: the script's one line saying what went wrong (slurm_omni.elastic)."""
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=255)] | None = None
    """The exit code the rank chose in its last beat (78: bad input, restarting cannot help)."""

    def __post_init__(self) -> None:
        if self.node and not self.node.isprintable():
            raise ValueError(f"node = {self.node[:80]!r} is not printable")

    def observation(self, *, het_job: bool = True) -> Heartbeat:
        """Stage n runs in het component n (elastic/layout.py); an ordinary job has only offset 0."""
        return Heartbeat(self.time, self.rank, self.step, self.node, self.stage if het_job else None, self.phase)
