"""A launch that failed before its first heartbeat, read from its output and recorded for the manager.

Used by the step supervisor after a launch inside the allocation ended (its log
``<ckpt>/supervisor/omni-<job>-launch-N.log``) and by ``omni launch-failure``, which the batch script
of a heterogeneous job runs after its step failed (its log: the job's own output file, from where
this life's step started). What the line is and when two failures are the same is pure code
(``policy/start_failure.py``); the record's schema is ``formats/start_failure.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

from slurm_omni.formats.start_failure import StartFailureRecord, encode_start_failure, start_failure_name
from slurm_omni.fsio import FileRejected, read_tail, write_atomic
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.policy.start_failure import TAIL_BYTES, StartFailure, from_output, node_failed


def read_failure(log: Path, *, start: int, rc: int, launch: int, srun_log: Path | None = None) -> StartFailure | None:
    """The failure the end of ``log`` (from byte ``start``: this launch's part) shows; an unreadable
    log gives no line, and the step's own exit code. ``srun_log``: where srun's own stderr is kept
    apart from the ranks' output (the supervisor's launches): the failing task's exit code and a lost
    node are taken from it only, never from what a rank printed. None when srun reported a node of
    the step lost (the cluster's failure, for the recovery to judge)."""
    text, srun = _tail(log, start), None if srun_log is None else _tail(srun_log, 0)
    if node_failed(text if srun is None else srun):
        return None
    return from_output(text, rc, launch=launch, log=str(log), srun=srun)


def _tail(path: Path, start: int) -> str:
    try:
        return read_tail(path, TAIL_BYTES, start=start, what=str(path))
    except FileRejected:
        return ""


def beat(heartbeat_dir: Path, job_id: str, incarnation: int) -> bool:
    """Some rank of this life wrote a heartbeat."""
    try:
        return any(hb.job_id == job_id and hb.incarnation == incarnation for hb in read_heartbeats(heartbeat_dir))
    except OSError:
        return False


def write_record(heartbeat_dir: Path, *, job_id: str, incarnation: int, failure: StartFailure,
                 stopped: str = "") -> Path:
    """``failed-<job>-<incarnation>.json`` in the heartbeat folder (made 0700 when no rank made it;
    its parent, the job's checkpoint folder, is ``omni submit``'s)."""
    record = StartFailureRecord(job_id=job_id, incarnation=incarnation, launch=failure.launch,
                                exit_code=failure.exit_code, line=failure.line, log=failure.log[:4096],
                                time=time.time(), stopped=stopped[:1000])
    heartbeat_dir.mkdir(mode=0o700, exist_ok=True)   # no rank made it: none started
    path = heartbeat_dir / start_failure_name(job_id, incarnation)
    write_atomic(path, encode_start_failure(record))
    return path
