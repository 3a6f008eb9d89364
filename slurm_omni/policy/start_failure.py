"""A launch that failed before its first heartbeat: what it said, and when a second one is the same (pure).

A script that crashes at start (an import error, a missing data file, a bad argument) fails the same
way in every launch: relaunching it is a restart loop, and its traceback is the one thing the user
needs. Both recovery paths use these functions: the step supervisor for its launches inside the
allocation (``supervisor/run.py``), the manager for the lives it resubmits (``manager/daemon.py``).
They run no command and read no clock or file: the callers hand in the tail of the launch's log.

**The failure's line** (:func:`failure_line`): the last line of the last Python traceback in the
log (the exception, ``ModuleNotFoundError: No module named 'foo'``), else the last line that is
not Slurm's or slurm-omni's own (``python: can't open file ...``), else empty.

**The same way** (:func:`same_failure`): two launches that both ended before their first heartbeat,
each on its own (no node of it lost, not stopped on request), with the same exit code and the same
line once whatever varies between runs is taken out (:func:`failure_key`): hexadecimal addresses,
numbers (pids, ports, ranks, times, line numbers of generated code), a ``[rankN]:`` prefix. Two lines
that differ only there are one failure; a different exception, message or exit code is another, and
the launch after it is a fresh chance. A failure of the rendezvous, the network or the device
(``DistNetworkError``, ``EADDRINUSE``, a refused connection, a timeout, a CUDA or NCCL error) is never
the same way: the next launch has other ports, peers or nodes (:func:`environmental`).

**The verdict** (:func:`repeated_failure`): the newest two failures of consecutive launches are the
same -> stop with one line (exit 78, bad input: no restart can fix it), naming the line, the exit
code and the full log.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_LINE_CHARS = 300
TAIL_BYTES = 256 << 10
"""How much of a launch's log the callers read back (its end): a traceback is well inside it."""

_TRACEBACK = "Traceback (most recent call last):"
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure)\b[\w.]*(?::.*)?$"
                        r"|^[A-Za-z_][\w.]*\.[A-Za-z_]\w*(?::.*)?$"
                        r"|^[A-Za-z_]\w*: .*$")
_NOISE = re.compile(r"^(?:srun|slurmstepd(?:-\S+)?|omni|supervisor|slurm_omni|sbatch|scontrol)\b[:\s-]"
                    r"|^\s*$|^\[\d{4}-\d\d-\d\d")
_GLUED = re.compile(r"(?<=\S)(?:srun|slurmstepd(?:-\S+)?): ")
"""Slurm's own line glued to a rank's unfinished one: the rank was killed mid-write, its line cut."""
_TASK_EXIT = re.compile(r"^srun: error: \S+: tasks? \d+(?:-\d+)?: Exited with exit code (\d+)$", re.MULTILINE)
_ENVIRONMENT = re.compile(r"DistNetworkError|DistStoreError|EADDRINUSE|address already in use|Connection refused|"
                          r"Connection reset|Broken pipe|No route to host|Network is unreachable|timed out|"
                          r"timeout|CUDA error|NCCL|\bECC\b|InfiniBand|socket", re.IGNORECASE)
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on \S+$", re.MULTILINE)
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True, kw_only=True, slots=True)
class StartFailure:
    """One launch (or life) that ended before any rank wrote a heartbeat, on its own."""

    launch: int
    """The launch's number inside the allocation, or the life's incarnation on the resubmission path."""
    exit_code: int
    """The failing task's exit code (the step's, when no task said)."""
    line: str
    """:func:`failure_line` of its log (may be empty)."""
    log: str = ""
    """Where the whole output is (the launch's log, the job's output file)."""


def _strip(line: str) -> str:
    return _RANK_PREFIX.sub("", line.rstrip("\r\n"))


def failure_line(text: str) -> str:
    """The line that says why the launch failed, from the tail of its output (see the module)."""
    lines = [_strip(x) for x in text.splitlines()]
    headers = [i for i, x in enumerate(lines) if x.strip() == _TRACEBACK]
    # frames are indented ("  File ...", "    code", "    ^^^"); the exception is the first line at
    # column 0 after them that reads like one. Ranks that crash together interleave their lines, and a
    # rank killed by srun mid-traceback leaves one without its exception, or with its exception cut
    # and srun's line glued to it ("ModuleNotFoundErrorsrun: error: node4: task 0: Terminated"):
    # then the one before counts.
    for start in reversed(headers):
        for x in lines[start + 1:]:
            if x and not x[0].isspace() and x.strip() != _TRACEBACK and not _NOISE.match(x) \
                    and _EXCEPTION.match(x.strip()):
                if _GLUED.search(x):
                    break
                return _clip(x.strip())
    for x in reversed(lines):
        if x.strip() and not _NOISE.match(x) and x.strip() != _TRACEBACK and not x[0].isspace():
            return _clip(x.strip())
    return ""


def task_exit_code(text: str, default: int) -> int:
    """The first failing task's exit code as srun reported it in the output (Slurm 22.05-26.05:
    ``srun: error: NODE: task N: Exited with exit code C``): the step's own code is srun's, which may
    be a peer's SIGKILL (137) when ``--kill-on-bad-exit`` ended it; ``default`` when srun said none."""
    m = _TASK_EXIT.search(text)
    return int(m[1]) if m else default


def node_failed(text: str) -> bool:
    """srun reported a node of the step lost: the launch's end is the cluster's, not the script's."""
    return bool(_NODE_FAILURE.search(text))


def from_output(text: str, rc: int, *, launch: int, log: str, srun: str | None = None) -> StartFailure:
    """The failure a launch's output shows: its line and its first failing task's exit code, from
    srun's own lines (``srun``: its stderr where it is kept apart from the ranks' output, the step
    supervisor's ``.srun.log``; None: in ``text`` itself, the batch job's output)."""
    code = task_exit_code(text if srun is None else srun, rc)
    return StartFailure(launch=launch, exit_code=code if 0 <= code <= 255 else 255, line=failure_line(text), log=log)


def _clip(line: str) -> str:
    out = "".join(c if c.isprintable() else " " for c in line)
    return out if len(out) <= MAX_LINE_CHARS else out[:MAX_LINE_CHARS] + "..."


def failure_key(failure: StartFailure) -> tuple[int, str]:
    """What must match for two failures to be the same: the exit code and the line without what
    varies from run to run (addresses, numbers, runs of spaces)."""
    line = _HEX.sub("0x#", failure.line)
    line = _NUMBER.sub("#", line)
    return failure.exit_code, _SPACE.sub(" ", line).strip()


def environmental(failure: StartFailure) -> bool:
    """The failure names the rendezvous, the network or the device: not the script's to repeat."""
    return bool(_ENVIRONMENT.search(failure.line))


def same_failure(a: StartFailure, b: StartFailure) -> bool:
    return not environmental(a) and not environmental(b) and failure_key(a) == failure_key(b)


def repeated_failure(failures: Sequence[StartFailure | None]) -> StartFailure | None:
    """Of consecutive launches, oldest first (None for one that reached its first heartbeat, or
    that ended for a reason not its own: a node lost, a stop that was asked for): the newest
    failure when the launch before it failed the same way, else None."""
    if len(failures) < 2:
        return None
    before, last = failures[-2], failures[-1]
    if before is None or last is None or not same_failure(before, last):
        return None
    return last


def stop_line(label: str, failure: StartFailure) -> str:
    """The one line the job is stopped with (supervisor's output, manager's log, ``omni status``)."""
    what = failure.line or "no error line in its output"
    where = f"; full log: {failure.log}" if failure.log else ""
    return (f"{label}: the training command failed the same way twice before its first heartbeat "
            f"(exit {failure.exit_code}): {what}{where}; stopped, not relaunched: fix it and submit again")


def first_line(label: str, failure: StartFailure) -> str:
    """The line shown for a launch that failed before its first heartbeat (relaunched once)."""
    what = failure.line or "no error line in its output"
    where = f" (full log: {failure.log})" if failure.log else ""
    return (f"{label}: launch {failure.launch} failed before its first heartbeat (exit {failure.exit_code}): "
            f"{what}{where}")
