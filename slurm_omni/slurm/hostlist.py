"""Slurm hostlist expressions: ``n[1-3,5],m7`` <-> ``["n1", "n2", "n3", "n5", "m7"]``.

Pure functions. Zero padding is kept (``n[01-03]`` gives ``n01 n02 n03``), as Slurm does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from slurm_omni.errors import SlurmError

_MAX_HOSTS = 1_000_000
_NAME_NUM = re.compile(r"^(.*?)(\d+)$")


def expand(expr: str) -> list[str]:
    """Expand a hostlist expression; the order of the expression is kept."""
    out: list[str] = []
    for part in _split_top(expr.strip()):
        out.extend(_expand_one(part, expr))
        if len(out) > _MAX_HOSTS:
            raise SlurmError(f"hostlist: couldn't expand {expr[:80]!r}: more than {_MAX_HOSTS} hosts")
    return out


def _split_top(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise SlurmError(f"hostlist: couldn't parse {expr!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"hostlist: couldn't parse {expr!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmError(f"hostlist: couldn't parse {expr!r}: unclosed '['")
    parts.append(expr[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(part: str, whole: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
    if m is None:
        if "[" in part or "]" in part:
            raise SlurmError(f"hostlist: couldn't parse {whole!r}: bad brackets in {part!r}")
        return [part]
    prefix, ranges, suffix = m.groups()
    if "[" in suffix:
        raise SlurmError(f"hostlist: couldn't parse {whole!r}: more than one bracket group in {part!r}")
    names: list[str] = []
    for rng in ranges.split(","):
        rng = rng.strip()
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"hostlist: couldn't parse {whole!r}: bad range {rng!r} (use N or N-M)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise SlurmError(f"hostlist: couldn't parse {whole!r}: range {rng!r} goes backwards")
        if b - a > _MAX_HOSTS:
            raise SlurmError(f"hostlist: couldn't expand {whole!r}: range {rng!r} too large")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        names.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(a, b + 1))
    return names


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
