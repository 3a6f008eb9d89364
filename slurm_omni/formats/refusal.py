"""The batch script's refusal: ``<OMNI_HEARTBEAT_DIR>/refused-<SLURM_JOB_ID>-<OMNI_INCARNATION>.txt``.

When the batch script cannot start the step at all (the training command's program is not there)
no rank runs, so no heartbeat can say why. The script (sbatch_templates/_step.sh.j2) writes this
file, one line of text, before it exits 78; the manager (manager/sources.read_refusal) reads it and
closes the job with that line instead of restarting it (policy/bad_input.py). Plain text rather
than JSON because bash writes it; the reader takes the first line, printable, bounded.
"""

from __future__ import annotations

from slurm_omni.formats import RecordRejected
from slurm_omni.fsio import one_line

MAX_REFUSAL_BYTES = 2048
MAX_REFUSAL_CHARS = 300


def refusal_name(slurm_job_id: int, incarnation: int) -> str:
    return f"refused-{slurm_job_id}-{incarnation}.txt"


def decode_refusal(data: bytes, what: str = "refusal") -> str:
    """The refusal's line; an empty or non-UTF-8 file is a ``RecordRejected``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordRejected(f"couldn't accept {one_line(what)}: not UTF-8 ({e.reason})") from None
    line = text.strip().split("\n", 1)[0].strip()
    if not line:
        raise RecordRejected(f"couldn't accept {one_line(what)}: empty")
    return one_line(line, MAX_REFUSAL_CHARS)
