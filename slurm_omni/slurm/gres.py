"""Gres strings: ``gpu:h100:4``, ``gpu:4``, ``gpu:h100:4(S:0-1),mps:100`` (pure)."""

from __future__ import annotations

import re

from slurm_omni.slurm.types import Gres

_GRES = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?::(?P<type>[A-Za-z0-9_.-]+))?(?::(?P<count>[0-9]+[KMG]?))?$")


def parse_gres(text: str) -> tuple[Gres, ...]:
    """Parse a node's gres list; ``(null)``, ``N/A`` and empty give ()."""
    text = (text or "").strip()
    if text in ("", "(null)", "N/A"):
        return ()
    out = []
    for item in _split(text):
        item = re.sub(r"\(.*\)$", "", item.strip())  # socket or index annotations
        item = item.removeprefix("gres:").removeprefix("gres/")  # TRES strings: gres: (22.05), gres/ (24.11+)
        m = _GRES.match(item)
        if m is None:
            continue
        type_ = m["type"]
        count = m["count"]
        if count is None and type_ is not None and type_.isdigit():
            type_, count = None, type_
        out.append(Gres(m["name"], type_, _count(count or "1")))
    return tuple(out)


def _split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _count(text: str) -> int:
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * mult
