"""Slurm hostlist expressions: ``n[1-3,5],m7`` <-> ``["n1", "n2", "n3", "n5", "m7"]``.

Pure functions. Zero padding is kept (``n[01-03]`` gives ``n01 n02 n03``), as Slurm does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from slurm_omni.errors import SlurmError

MAX_HOSTS = 1_000_000
"""The most names one expression may expand to; counted before any name is made."""
_NAME_NUM = re.compile(r"^(.*?)([0-9]+)$")
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")   # ASCII digits only: str.isdigit() takes '٣' and '²'

_Ranges = tuple[str, str, tuple[tuple[int, int, int], ...]]
"""prefix, suffix, (first, last, zero-padded width) of each range."""


def expand(expr: str, *, limit: int = MAX_HOSTS) -> list[str]:
    """Expand a hostlist expression; the order of the expression is kept. The names are counted
    first: an expression of more than ``limit`` names is refused before any is made."""
    parts = [_parse_one(part, expr) for part in _split_top(expr.strip(), expr)]
    total = sum(1 if isinstance(p, str) else sum(hi - lo + 1 for lo, hi, _ in p[2]) for p in parts)
    if total > limit:
        raise SlurmError(f"hostlist: couldn't expand {_short(expr)}: {total} hosts (limit {limit})")
    out: list[str] = []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        prefix, suffix, ranges = part
        for lo, hi, width in ranges:
            out.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(lo, hi + 1))
    return out


def _short(expr: str) -> str:
    return repr(expr[:80]) + ("..." if len(expr) > 80 else "")


def _split_top(expr: str, whole: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: unclosed '['")
    parts.append(expr[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _parse_one(part: str, whole: str) -> str | _Ranges:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
    if m is None:
        if "[" in part or "]" in part:
            raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: bad brackets in {_short(part)}")
        return part
    prefix, ranges, suffix = m.groups()
    parsed = []
    for rng in ranges.split(","):
        rm = _RANGE.fullmatch(rng.strip())
        if rm is None:
            raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: bad range {_short(rng)} "
                             "(use N or N-M: at most 18 ASCII digits each)")
        lo_text, hi_text = rm.group(1), rm.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise SlurmError(f"hostlist: couldn't parse {_short(whole)}: range {_short(rng)} goes backwards")
        width = len(lo_text) if lo_text.startswith("0") and len(lo_text) > 1 else 0
        parsed.append((lo, hi, width))
    return prefix, suffix, tuple(parsed)


def compress(names: Iterable[str]) -> str:
    """The shortest ordinary hostlist for ``names`` (sorted by prefix, then number; duplicates dropped)."""
    groups: dict[tuple[str, int], set[int]] = {}
    plain: set[str] = set()
    for name in names:
        m = _NAME_NUM.match(name)
        if m is None:
            plain.add(name)
            continue
        prefix, digits = m.groups()
        width = len(digits) if digits.startswith("0") and len(digits) > 1 else 0
        groups.setdefault((prefix, width), set()).add(int(digits))
    parts = sorted(plain)
    for (prefix, width), nums in sorted(groups.items()):
        ordered = sorted(nums)
        if len(ordered) == 1:
            parts.append(f"{prefix}{ordered[0]:0{width}d}")
            continue
        ranges: list[str] = []
        start = prev = ordered[0]
        for n in [*ordered[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)
