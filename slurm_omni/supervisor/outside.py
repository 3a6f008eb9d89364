"""A step supervisor outside its allocation (allocation mode, docs/allocation-mode.md): one process
per Slurm job at a time (a lock beside its journal), where it runs (``formats/supervisor_process``,
for the manager that starts it again when it is gone), and starting it detached from its caller.

A supervisor started while another one holds the lock leaves at once: starting one is always safe,
so ``omni submit`` and the manager need not agree on who started it last.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.supervisor_process import (
    MAX_PROCESS_BYTES,
    SupervisorProcess,
    decode_process,
    encode_process,
)
from slurm_omni.fsio import FileRejected, read_bounded, write_atomic
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor.journal import SUBDIR

log = logging.getLogger(__name__)


def process_path(ckpt_dir: Path, job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{job_id}.process.json"


def lock_path(ckpt_dir: Path, job_id: str) -> Path:
    return ckpt_dir / SUBDIR / f"{job_id}.lock"


def hold_lock(ckpt_dir: Path, job_id: str) -> int | None:
    """Take the job's supervisor lock for the life of this process (the descriptor stays open); None
    when another supervisor holds it."""
    path = lock_path(ckpt_dir, job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def write_process(ckpt_dir: Path, job_id: str) -> SupervisorProcess:
    record = SupervisorProcess(version=1, slurm_job_id=job_id, host=socket.gethostname(), pid=os.getpid(),
                               started_at=time.time())
    process_path(ckpt_dir, job_id).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(process_path(ckpt_dir, job_id), encode_process(record))
    return record


def read_process(ckpt_dir: Path, job_id: str) -> SupervisorProcess | None:
    """The supervisor's process record, or None (none: not an allocation-mode job; a bad file is
    logged and read as none)."""
    path = process_path(ckpt_dir, job_id)
    try:
        return decode_process(read_bounded(path, MAX_PROCESS_BYTES), path.name)
    except RecordRejected as e:
        log.warning("supervisor: %s", e)
        return None
    except FileRejected:
        return None


def process_alive(record: SupervisorProcess, *, proc_root: str = "/proc") -> bool | None:
    """Does the recorded supervisor still run: its pid is an ``omni supervise`` of this user on this
    host; None when it runs on another host (this one cannot tell)."""
    if record.host != socket.gethostname():
        return None
    folder = os.path.join(proc_root, str(record.pid))
    try:
        if os.stat(folder).st_uid != os.geteuid():
            return False
        with open(os.path.join(folder, "cmdline"), "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"supervise" in argv and f"--allocation={record.slurm_job_id}".encode() in argv


def start_detached(runner: CommandRunner, argv: Sequence[str], env: Mapping[str, str],
                   log_file: Path) -> subprocess.Popen[bytes]:
    """Start the supervisor in a session of its own, its output appended to ``log_file`` (the caller
    reaps it with ``poll``; it outlives a caller that exits)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        proc = runner.spawn(argv, env=env, stdout=fd, stderr=fd, detach=True)
    finally:
        os.close(fd)
    return proc
