"""Bad input: a job that no restart can fix, recognised from how its life ended (pure).

A failure the manager recovers from is one of the cluster's (a node lost, a rank killed); a job
whose command cannot work fails the same way in every life, and resubmitting it is a restart loop.
These functions say which is which from what the manager saw of one life (its ranks' last
heartbeats, Slurm's end of it, the batch script's refusal) and give the one line the manager logs,
journals and shows in ``omni status``: the job, what happened, what to fix. They run no command and
read no clock (``now`` is passed in).

The cases (docs/own-script.md, "Exit codes"):

- ``command_not_found``, ``workdir_not_found``: the batch script found no program to run, or could
  not enter the job's working folder (it exits 78 before any rank starts and leaves its one line in
  the heartbeat folder);
- ``repeated_failure``: two lives in a row failed the same way before their first heartbeat (a crash
  at start, ``policy/start_failure.py``; the manager judges it, or the step supervisor did);
- ``bad_input``, ``state_dict``, ``foreign_checkpoint``, ``ended_early``: a rank exited 78 and
  said why in its last heartbeat (slurm_omni.elastic: a ``load_state_dict`` that refused, another
  script's checkpoint, a loop that ended before ``max_steps``);
- ``exited_early``: every rank exited 0 (Slurm says COMPLETED) but not at the last step;
- ``no_heartbeat``: no life of the job ever wrote a heartbeat, and this one ran past the site's
  ``detection.first_heartbeat_s`` or ended (the command never calls ``elastic.init``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slurm_omni.elastic.codes import EXIT_BAD_INPUT

DOC = "docs/own-script.md"

CAUSES = ("command_not_found", "workdir_not_found", "repeated_failure", "bad_input", "state_dict", "foreign_checkpoint", "ended_early", "exited_early",
          "no_heartbeat")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEnd:
    """What a rank's last heartbeat of the life said."""

    rank: int
    phase: str
    step: int
    exit_code: int | None = None
    error: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class BadInput:
    """Stop the job for good: ``cause`` (one of :data:`CAUSES`) and the one line saying what to fix."""

    cause: str
    line: str


def job_label(slurm_job_id: int | None, name: str) -> str:
    return f"job {slurm_job_id if slurm_job_id is not None else '-'} ({name})"


def refused_by_rank(label: str, ranks: Sequence[RankEnd]) -> BadInput | None:
    """A rank exited 78 (its last heartbeat's ``exit_code``): its own line says what to fix."""
    rank = min((r for r in ranks if r.exit_code == EXIT_BAD_INPUT), key=lambda r: r.rank, default=None)
    if rank is None:
        return None
    error = rank.error or f"exit code {EXIT_BAD_INPUT} (bad input) without a message"
    if "load_state_dict refused" in error:
        cause = "state_dict"
    elif "another script's" in error:
        cause = "foreign_checkpoint"
    elif "before max_steps" in error:
        cause = "ended_early"
    else:
        cause = "bad_input"
    return BadInput(cause=cause, line=f"{label}: rank {rank.rank} refused its input: {error} (fix that and submit again)")


def classify_end(*, label: str, completed: bool, cancelled: bool, lost: bool, ranks: Sequence[RankEnd],
                 max_steps: int | None, refusal: str | None, ever_beat: bool, slurm_state: str = "",
                 output: str = "") -> BadInput | None:
    """The life ended (Slurm shows it ended): bad input, or None for an end the recovery judges
    (done, cancelled, a node lost, a failure worth a restart).

    ``completed``: Slurm's COMPLETED (every task exited 0); ``lost``: a node of the life failed;
    ``ranks``: the last heartbeat of each rank of this life; ``refusal``: the batch script's line when
    it could not start the step; ``ever_beat``: some life of the job wrote a heartbeat before;
    ``slurm_state``: how Slurm ended it, for the line; ``output``: the job's output file (the batch
    script's and the ranks' stderr), named in the line when no rank said why."""
    if cancelled or lost:
        return None
    if refusal is not None and refusal.startswith("couldn't enter the working folder"):
        return BadInput(cause="workdir_not_found",
                        line=f"{label}: {refusal} (fix [job] workdir in the job file: a folder every node sees; "
                             f"{DOC})")
    if refusal is not None:
        return BadInput(cause="command_not_found",
                        line=f"{label}: {refusal} (fix [training] command in the job file: an "
                             "absolute path, or the {python}/{job_dir} fields; " + DOC + ")")
    refused = refused_by_rank(label, ranks)
    if refused is not None:
        return refused
    if completed:
        if ranks and all(r.phase == "done" for r in ranks) and (
                max_steps is None or min(r.step for r in ranks) >= max_steps):
            return None
        of = f" of {max_steps}" if max_steps is not None else ""
        if not ranks:
            what = "exited 0 without writing a heartbeat"
        else:
            what = f"exited 0 at step {max(0, max(r.step for r in ranks))}{of}"
        return BadInput(cause="exited_early",
                        line=f"{label}: the training command {what}: a script must run to its last step or exit 75 "
                             f"after a checkpoint ({DOC})")
    if not ranks and not ever_beat:
        # Slurm's end and the job's output come first: the batch script may have failed before any
        # rank started (then no elastic.init() could have helped), or the command failed at start.
        where = f"the job's output {output}" if output else "the job's output (its [job] log_dir)"
        return BadInput(cause="no_heartbeat",
                        line=f"{label}: Slurm ended it {slurm_state or 'without a state (it left the queue)'} before "
                             f"any rank wrote a heartbeat: {where} says why (the batch script or the training "
                             f"command failed at start; a command that runs must call "
                             f"slurm_omni.elastic.init() on every rank, {DOC})")
    return None


def never_beat(*, label: str, running_for_s: float, limit_s: float, beats: int, ever_beat: bool) -> BadInput | None:
    """The life runs, and neither it nor any earlier life of the job wrote a heartbeat within
    ``limit_s`` of Slurm showing it running: a command that never calls ``elastic.init``. A later life
    that does not beat is left to the confirmer (its predecessors did: the script can)."""
    if beats or ever_beat or running_for_s < limit_s:
        return None
    return BadInput(cause="no_heartbeat",
                    line=f"{label}: no rank wrote a heartbeat in {running_for_s:.0f} s of running "
                         f"(detection.first_heartbeat_s = {limit_s:g}): the training command must call "
                         f"slurm_omni.elastic.init() on every rank ({DOC}); cancelled")
