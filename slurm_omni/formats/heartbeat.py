"""The per-rank heartbeat file: ``<OMNI_HEARTBEAT_DIR>/rank-<RANK>.json``, one JSON object::

    {"rank": 3, "stage": 1, "dp_rank": 1, "pid": 1234, "incarnation": 0, "job_id": "42",
     "step": 17, "phase": "training", "time": 1764460000.12, "step_time_s": 0.031,
     "compute_s": 0.021, "data_s": 0.002, "node": "node3", "last_checkpoint_step": 10, "beats": 9,
     "metrics": {"loss": 2.31, "samples": 8}}

The meaning of each key is documented with the writer, ``slurm_omni.elastic.heartbeat`` (every
training script's heartbeat, the built-in trainer's too); the manager (manager/events.py) reads it.
Keys this reader does not know are ignored (a newer writer may add measurements); the known ones are
checked strictly.

The per-node heartbeat file: ``<OMNI_HEARTBEAT_DIR>/node-<NODE>.jsonl``, the default under Slurm
(``OMNI_HEARTBEAT_NODE_DIR``, a node-local folder, ``/dev/shm`` when unset; :func:`node_dir_setting`):
each rank writes its beat
there (``rank-<RANK>.json`` in ``<dir>/omni-beats-<uid>-<job>-<node>/``) and one rank per node, the
one holding that folder's lock, copies every beat of its launch into one file on the shared file
system, twice per interval (``elastic/heartbeat.py``). JSON lines: a header, then one line per rank,
each exactly the bytes of that rank's beat::

    {"node": "node3", "time": 1764460000.31}
    {"rank": 12, "stage": 0, ...a rank's beat...}
    {"rank": 13, ...}

Each line is decoded on its own: one bad beat does not hide the node's other ranks, and a reader
that polls again decodes only the lines that changed (the manager's ``HeartbeatScanner``). A reader takes, per rank, the newest beat it finds in the per-rank and
the per-node files (by incarnation, then time): the per-rank file stays the fallback (no node folder,
no leader alive, a rank's last beat) and the contract of scripts that write their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from slurm_omni.policy.confirm import Heartbeat

MAX_HEARTBEAT_BYTES = 4096
MAX_RANKS_PER_NODE = 256
MAX_NODE_BEATS_BYTES = MAX_HEARTBEAT_BYTES * MAX_RANKS_PER_NODE + 4096
RANK_PREFIX = "rank-"
NODE_PREFIX = "node-"
NODE_SUFFIX = ".jsonl"
MAX_METRICS = 16
DEFAULT_NODE_DIR = Path("/dev/shm")
"""Where the node's ranks aggregate their beats when ``OMNI_HEARTBEAT_NODE_DIR`` is unset."""
NODE_DIR_OFF = ("", "off", "none", "0")
"""``OMNI_HEARTBEAT_NODE_DIR`` set to one of these: every rank writes its own file (the fallback)."""
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


class NodeHeader(msgspec.Struct, frozen=True, kw_only=True):
    """The first line of ``node-<NODE>.jsonl``: which node, and when its leader wrote it."""

    node: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    time: Annotated[float, msgspec.Meta(gt=0)]


def node_file_name(node: str) -> str:
    """The per-node file's name: the node's name with anything but ``[A-Za-z0-9_.-]`` as ``_``."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "_.-") else "_" for c in node)[:200]
    return f"{NODE_PREFIX}{safe}{NODE_SUFFIX}"


def newer(a: HeartbeatRecord, b: HeartbeatRecord) -> bool:
    """``a`` replaces ``b`` as a rank's newest beat: a later incarnation, or the same one written later
    (a beat that arrives late or out of order never replaces a newer one)."""
    return (a.incarnation, a.time, a.beats) > (b.incarnation, b.time, b.beats)


def node_dir_setting(env: Mapping[str, str] | None = None) -> Path | None:
    """The node-local folder the ranks aggregate their beats in (``OMNI_HEARTBEAT_NODE_DIR``):
    :data:`DEFAULT_NODE_DIR` when unset and it exists, None (a file per rank) when set to one of
    :data:`NODE_DIR_OFF` or when the default is missing (not Linux)."""
    env = os.environ if env is None else env
    raw = env.get("OMNI_HEARTBEAT_NODE_DIR")
    if raw is None:
        return DEFAULT_NODE_DIR if DEFAULT_NODE_DIR.is_dir() else None
    return None if raw.strip().lower() in NODE_DIR_OFF else Path(raw)
