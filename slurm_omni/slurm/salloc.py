"""An allocation without a batch script (``salloc --no-shell --no-kill``), for allocation mode.

salloc waits until Slurm grants the allocation (hours at a busy centre), so it is started detached
with its output in a file, and only its job id is waited for: it prints "Pending job allocation N"
when the job is queued, "Granted job allocation N" when it starts at once. With ``--no-shell`` it
leaves once granted; the allocation stays until the time limit or ``scancel``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from slurm_omni.errors import SlurmError
from slurm_omni.fsio import one_line
from slurm_omni.slurm.hostlist import compress, expand
from slurm_omni.slurm.parse_text import parse_salloc_job_id
from slurm_omni.slurm.runner import CommandRunner


def request_allocation(runner: CommandRunner, argv: Sequence[str], output: Path, *, timeout_s: float = 120.0,
                       poll_s: float = 0.1) -> int:
    """Start ``salloc`` (``argv``) detached, its output appended to ``output``; its job id once it
    printed one. A salloc that leaves first (a refused request) is a SlurmError with its first line."""
    if not argv or os.path.basename(argv[0]) != "salloc" or "--no-shell" not in argv:
        raise SlurmError(f"salloc: couldn't request an allocation with {list(argv)[:3]!r} (salloc --no-shell only)")
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        start = os.fstat(fd).st_size
        proc = runner.spawn(argv, stdout=fd, stderr=fd, detach=True)
    finally:
        os.close(fd)
    deadline = time.monotonic() + timeout_s
    while True:
        with open(output, "rb") as f:
            f.seek(start)
            text = f.read(1 << 16).decode(errors="replace")
        job_id = parse_salloc_job_id(text)
        if job_id is not None:
            return job_id
        rc = proc.poll()
        if rc is not None:
            line = next((ln for ln in text.splitlines() if ln.strip()), f"exit {rc}")
            raise SlurmError(f"salloc: couldn't get an allocation: {one_line(line)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise SlurmError(f"salloc: couldn't get a job id within {timeout_s:.0f}s (output in {output})")
        time.sleep(poll_s)


_REPLACED = ("--nodes=", "--constraint=", "--job-name=", "--time=", "--switches=", "--exclude=")


def pool_salloc_argv(base: Sequence[str], *, name: str, nodes: int, minutes: int, constraint: str = "",
                     switches: str = "", exclude: Sequence[str] = ()) -> list[str]:
    """A pool allocation's salloc: the job's own (``base``: its partition, gres, tasks per node,
    CPUs per task, account, QOS) with the pool's node count, name, time limit, constraint and
    switches instead of the job's; ``exclude`` (the nodes the job lost) added to the job's own
    ``--exclude``. Pure."""
    if not base or os.path.basename(base[0]) != "salloc" or "--no-shell" not in base:
        raise SlurmError(f"salloc: couldn't build a pool allocation from {list(base)[:3]!r} (salloc --no-shell only)")
    argv = [a for a in base if not a.startswith(_REPLACED)]
    argv += [f"--job-name={name}", f"--nodes={nodes}", f"--time={minutes}"]
    if constraint:
        argv.append(f"--constraint={constraint}")
    if switches:
        argv.append(f"--switches={switches}")
    excluded = [n for a in base if a.startswith("--exclude=") for n in expand(a.split("=", 1)[1])]
    excluded += [n for n in exclude if n not in excluded]
    if excluded:
        argv.append(f"--exclude={compress(excluded)}")
    return argv


def successor_salloc_argv(base: Sequence[str], *, name: str, exclude: Sequence[str] = ()) -> list[str]:
    """The time limit's successor allocation: the job's own salloc (``base``: its whole shape, nodes,
    partition, gres, constraint, switches, time limit) under its own name, ``exclude`` (the nodes the
    job lost) added to the job's own ``--exclude``. Pure."""
    if not base or os.path.basename(base[0]) != "salloc" or "--no-shell" not in base:
        raise SlurmError(f"salloc: couldn't build a successor allocation from {list(base)[:3]!r} "
                         f"(salloc --no-shell only)")
    argv = [a for a in base if not a.startswith(("--job-name=", "--exclude="))]
    argv.append(f"--job-name={name}")
    excluded = [n for a in base if a.startswith("--exclude=") for n in expand(a.split("=", 1)[1])]
    excluded += [n for n in exclude if n not in excluded]
    if excluded:
        argv.append(f"--exclude={compress(excluded)}")
    return argv


def switch_wait(base: Sequence[str]) -> str:
    """The wait of the job's own ``--switches=N@WAIT`` (empty without one)."""
    for a in base:
        if a.startswith("--switches=") and "@" in a:
            return a.partition("@")[2]
    return ""
