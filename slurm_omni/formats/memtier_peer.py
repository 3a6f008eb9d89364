"""The memory tier's peer records (``checkpoint/peer.py``): what travels between a trainer and a
node's replica keeper, and the two small files they leave in the job's private checkpoint folder.

On the wire (TCP, each record one length-prefixed JSON object followed by its HMAC-SHA256 under the
job's secret)::

    request  {"op": "put", "job": "42", "name": "step-30.rank-00003.42.1.h5", "size": 1048576,
              "number": 1, "nonce": "<base64>"}
    reply    {"ok": true, "size": 1048576, "error": ""}

Files, below ``<checkpoint root>/.memtier/`` (0700)::

    keepers/<node>.json     {"node": "node3", "host": "10.0.0.3", "port": 40122, "pid": 777, "job": "42"}
    replicas/rank-00003.json {"rank": 3, "copies": [{"step": 30, "incarnation": "42.1", "holder": "node7",
                              "name": "step-30.rank-00003.42.1.h5", "size": 1048576}, {"step": 25, ...}]}
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_RECORD_BYTES = 4096
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.-]+$")]
_Node = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class PeerRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["put", "get"]
    job: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    name: _Name
    size: _Count = 0
    """put: the bytes that follow; get: the bytes the asker expects (0: any)."""
    number: _Count | None = None
    """put: the sender's incarnation number (the keeper refuses it once a newer one raised the fence)."""
    nonce: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class PeerReply(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    ok: bool
    size: _Count = 0
    error: Annotated[str, msgspec.Meta(max_length=400)] = ""


class KeeperAddress(msgspec.Struct, frozen=True, kw_only=True):
    node: _Node
    host: _Node
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    pid: _Count
    job: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class ReplicaCopy(msgspec.Struct, frozen=True, kw_only=True):
    step: _Count
    incarnation: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    holder: _Node
    name: _Name
    size: _Count
    origin: Annotated[str, msgspec.Meta(max_length=255)] = ""
    """The node that wrote it (its own copy there; asked when the holder does not answer)."""


class ReplicaRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A rank's newest replicas (as many as a keeper keeps per rank), newest first."""
    rank: _Count
    copies: Annotated[list[ReplicaCopy], msgspec.Meta(max_length=8)]
