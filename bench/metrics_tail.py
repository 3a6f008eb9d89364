"""The scale bench's reader of the job's metrics folder: each line parsed once, as it comes.

``formats.metrics.read_folder`` reads and parses every line of every file on each call; the bench
asked it several times per recovery, and at 512 nodes (2,044 ranks, some 100,000 lines by the last
fault) one call took seconds of the bench's CPU on a machine at load 1,000+, while the ranks stepped
on (issue 19: the 512 hang was not injected in time). This reader keeps each file's offset and reads
only the whole lines appended since (a rank's own file and its node's file carry the same lines; each
counts once). It keeps, per incarnation, each rank's first line (the earliest ``time``: its
``task_started_at``, ``groups_ready_at`` and ``restored_step``) and the highest step any rank made.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.formats.metrics import NODE_FILE_GLOB

READ_CHUNK = 1 << 22
"""Bytes read per file per update at most (a file that grew more is read on at the next update)."""


@dataclass
class _File:
    inode: int
    offset: int = 0


@dataclass
class MetricsTail:
    """The job's metrics folder, read on from where the last :meth:`update` stopped."""

    folder: Path
    files: dict[str, _File] = field(default_factory=dict)
    first: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    """incarnation -> rank -> that rank's first line of it (the earliest ``time``)."""
    last_step: dict[int, int] = field(default_factory=dict)
    """incarnation -> the highest ``step`` any of its ranks reported."""
    torn: int = 0
    """Lines that were not one JSON object with an int rank and incarnation (skipped)."""

    def update(self) -> None:
        try:
            names = [p.name for p in self.folder.glob("metrics-*.jsonl")]
            names += [p.name for p in self.folder.glob(NODE_FILE_GLOB)]
        except OSError:
            return
        for name in names:
            self._read(name)

    def _read(self, name: str) -> None:
        try:
            fd = os.open(self.folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            known = self.files.get(name)
            if known is None or known.inode != st.st_ino or st.st_size < known.offset:
                known = self.files[name] = _File(st.st_ino)   # new, or replaced: from its start
            if st.st_size == known.offset:
                return
            data = os.pread(fd, min(READ_CHUNK, st.st_size - known.offset), known.offset)
        finally:
            os.close(fd)
        end = data.rfind(b"\n")
        if end < 0:   # no whole line yet: the writer's append is still under way
            return
        known.offset += end + 1
        for line in data[:end].splitlines():
            self._take(line)

    def _take(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            obj = json.loads(line)
            inc, rank = obj["incarnation"], obj["rank"]
        except (ValueError, TypeError, KeyError):
            self.torn += 1
            return
        if not isinstance(inc, int) or not isinstance(rank, int) or isinstance(inc, bool) or isinstance(rank, bool):
            self.torn += 1
            return
        step = obj.get("step")
        if isinstance(step, int) and step > self.last_step.get(inc, -1):
            self.last_step[inc] = step
        ranks = self.first.setdefault(inc, {})
        had = ranks.get(rank)
        if had is None or _time(obj) < _time(had):
            ranks[rank] = obj

    def first_lines(self, incarnation: int) -> dict[int, dict[str, Any]]:
        self.update()
        return dict(self.first.get(incarnation, {}))


def _time(obj: dict[str, Any]) -> float:
    t = obj.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else float("inf")
