"""The socket between root and the user's side of ``omni demo --user NAME`` (drill/user_session.py).

One JSON line per message. Root sends ``SessionStart`` once; then the user's side sends
``NodeRequest`` lines (a node of the embedded cluster set DOWN for the drill, or RESUMEd after it) and
root answers each with one ``NodeReply``::

    root -> user: {"started": 12345.6, "phases_done": 1, "total": 11}
    user -> root: {"op": "down", "node": "node8"}
    root -> user: {"ok": true, "error": ""}

The user's side is as untrusted as any input of the user's: a line longer than
``MAX_MESSAGE_BYTES`` ends the session, a malformed one is answered with an error.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

MAX_MESSAGE_BYTES = 4096

_Node = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


class SessionStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the story stands when the user's side takes over: the demo's start (``time.monotonic``,
    one clock for both processes) and how many of its phases root ran."""

    started: float
    phases_done: Annotated[int, msgspec.Meta(ge=0)]
    total: Annotated[int, msgspec.Meta(ge=1)]


class NodeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    op: Literal["down", "resume"]
    node: _Node


class NodeReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ok: bool
    error: Annotated[str, msgspec.Meta(max_length=1000)] = ""
