"""A launch that failed before its first heartbeat: ``<OMNI_HEARTBEAT_DIR>/failed-<SLURM_JOB_ID>-<OMNI_INCARNATION>.json``.

No rank of such a launch wrote a heartbeat, so nothing else says why it failed. Its writer is the
step supervisor for a launch inside the allocation (``supervisor/run.py``), or, on the resubmission
path, the batch script through ``omni launch-failure`` (``cli/launch_failure.py``) after the step
failed. Both take the line from the end of the launch's output (``policy/start_failure.py``). The
manager reads it (``manager/sources.py``): it shows the line in ``omni status`` and, on the
resubmission path, stops the job when two lives in a row failed the same way; a supervisor that
stopped the job for that reason says so in ``stopped``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from slurm_omni.formats import decode, encode

MAX_START_FAILURE_BYTES = 8192
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Text = Annotated[str, msgspec.Meta(max_length=1000)]


class StartFailureRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    job_id: Annotated[str, msgspec.Meta(max_length=63)]
    """The Slurm job (the het leader's id) the launch ran in."""
    incarnation: _Count
    """The launch's OMNI_INCARNATION."""
    launch: _Count
    """The supervisor's launch number inside the allocation (0 on the resubmission path)."""
    exit_code: Annotated[int, msgspec.Meta(ge=0, le=255)]
    """The first failing task's exit code (srun's, when no task said)."""
    line: _Text
    """The last line of the launch's last traceback, or its last line of its own (may be empty)."""
    log: Annotated[str, msgspec.Meta(max_length=4096)]
    """Where the whole output is."""
    time: Annotated[float, msgspec.Meta(gt=0)]
    stopped: _Text = ""
    """The supervisor's one line when this failure, the second the same, stopped the job (exit 78)."""


def start_failure_name(slurm_job_id: int | str, incarnation: int) -> str:
    return f"failed-{slurm_job_id}-{incarnation}.json"


def encode_start_failure(record: StartFailureRecord) -> bytes:
    return encode(record)


def decode_start_failure(data: bytes, what: str = "start failure") -> StartFailureRecord:
    return decode(data, StartFailureRecord, what)
