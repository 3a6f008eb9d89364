"""Where an allocation-mode step supervisor runs: ``<ckpt>/supervisor/<slurm job id>.process.json``.

Written by the supervisor when it starts outside its allocation (``omni supervise --allocation``,
docs/allocation-mode.md); read by the manager, which starts a new supervisor when this one is gone
(``policy/supervision.supervisor_gone``)::

    {"version": 1, "slurm_job_id": "2001", "host": "login1", "pid": 4242, "started_at": 1764460000.5}
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slurm_omni.formats import decode, encode

MAX_PROCESS_BYTES = 4096


class SupervisorProcess(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: Literal[1]
    slurm_job_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9]+$", max_length=20)]
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    pid: Annotated[int, msgspec.Meta(gt=1)]
    started_at: Annotated[float, msgspec.Meta(gt=0)]


def encode_process(record: SupervisorProcess) -> bytes:
    return encode(record)


def decode_process(data: bytes, what: str) -> SupervisorProcess:
    return decode(data, SupervisorProcess, what)
