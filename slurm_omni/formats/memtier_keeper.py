"""The memory tier's local records (``checkpoint/held.py``): what a rank and its node's keeper say over
the keeper's Unix socket (``/dev/shm/omni-<uid>/<job>/keeper.sock``, in the job's 0700 folder; the
keeper also checks the caller's uid with SO_PEERCRED).

Each record is one length-prefixed (4 bytes, big-endian) JSON object::

    request  {"op": "hold", "job": "42", "names": ["step-30.rank-00003.42.1.h5"],
              "source": "/ckpt/step-30.tmp.1/rank-00003.h5.42.1.partial", "number": 1}
    reply    {"ok": true, "pid": 777, "copies": [{"name": "step-30.rank-00003.42.1.h5", "size": 1048576,
              "addr": 140230000000000}], "used": 2097152, "refused": "", "error": ""}

``hold``: copy the file ``source`` into the keeper's memory as ``names[0]`` (refused once incarnation
``number`` is fenced); ``where``: the held copies among ``names`` (all for none); ``drop``: forget
them; ``used``:
the bytes the keeper holds.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_RECORD_BYTES = 64 << 10
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.-]+$")]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class HoldRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["hold", "where", "drop", "used"]
    job: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    names: Annotated[list[_Name], msgspec.Meta(max_length=256)] = []
    source: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    """hold: the file whose bytes the keeper copies (a shard file this rank just wrote)."""
    number: _Count | None = None
    """hold: the sender's incarnation number (refused once a newer one raised the fence)."""


class HeldCopyRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: _Name
    size: _Count
    addr: Annotated[int, msgspec.Meta(ge=1)]
    """Where the copy starts in the keeper's address space (read with process_vm_readv)."""


class HoldReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ok: bool
    pid: _Count = 0
    copies: Annotated[list[HeldCopyRecord], msgspec.Meta(max_length=256)] = []
    used: _Count = 0
    refused: Literal["", "fenced", "cap", "full", "source"] = ""
    """Why a hold was refused: fenced, over the cap, no memory, the source file unusable."""
    error: Annotated[str, msgspec.Meta(max_length=400)] = ""
