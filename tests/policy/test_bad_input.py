"""Bad input recognised from how a life ended (policy/bad_input.py), alone: which end is bad input,
which is the recovery's to judge, and the one line for each."""

from __future__ import annotations

from typing import Any

import pytest

from slurm_omni.formats import RecordRejected
from slurm_omni.formats.refusal import decode_refusal, refusal_name
from slurm_omni.policy.bad_input import CAUSES, RankEnd, classify_end, job_label, never_beat, refused_by_rank

LABEL = job_label(2001, "own")
DONE = [RankEnd(rank=r, phase="done", step=80, exit_code=0) for r in range(4)]
STATE_DICT = ("checkpoint: job own: couldn't resume from /c: adamw.load_state_dict refused step-10: ValueError: "
              "loaded state dict has a different number of parameter groups (another script's or model's "
              "checkpoint: give this job its own checkpoint folder, or move the old one away)")
FOREIGN = ("checkpoint: job own: couldn't resume from /c: step-10 was written by 'other.py', this is 'train.py' "
           "(another script's or model's checkpoint: give this job its own checkpoint folder, or move the old one away)")
EARLY = "elastic: job own: rank 1 finished at step 12 before max_steps=80 (the loop must run to max_steps, ...)"


def end(**kw: Any) -> Any:
    args: dict[str, Any] = {"label": LABEL, "completed": False, "cancelled": False, "lost": False, "ranks": [],
                            "max_steps": 80, "refusal": None, "ever_beat": False}
    return classify_end(**{**args, **kw})


def test_label_names_the_slurm_job_and_the_name() -> None:
    assert LABEL == "job 2001 (own)" and job_label(None, "x") == "job - (x)"


@pytest.mark.parametrize(("error", "cause"), [(STATE_DICT, "state_dict"), (FOREIGN, "foreign_checkpoint"),
                                              (EARLY, "ended_early"), ("bad layout", "bad_input"),
                                              ("", "bad_input")])
def test_a_rank_that_exits_78_stops_the_job_with_its_own_line(error: str, cause: str) -> None:
    ranks = [RankEnd(rank=0, phase="training", step=10), RankEnd(rank=3, phase="failed", step=10, exit_code=78,
                                                                 error=error),
             RankEnd(rank=2, phase="failed", step=10, exit_code=78, error=error)]
    bad = refused_by_rank(LABEL, ranks)
    assert bad is not None and bad.cause == cause and bad.cause in CAUSES
    assert bad.line.startswith("job 2001 (own): rank 2 refused its input: ")   # the lowest rank that refused
    assert (error or "exit code 78 (bad input) without a message") in bad.line
    assert end(ranks=ranks) == bad                          # the same verdict once Slurm shows the end


def test_ranks_that_failed_otherwise_are_the_recoverys() -> None:
    ranks = [RankEnd(rank=0, phase="failed", step=7, exit_code=1, error="RuntimeError: peer gone"),
             RankEnd(rank=1, phase="training", step=7)]
    assert refused_by_rank(LABEL, ranks) is None
    assert end(ranks=ranks) is None and end(ranks=ranks, ever_beat=True) is None


def test_the_batch_scripts_workdir_refusal_names_the_workdir_to_fix() -> None:
    bad = end(refusal="couldn't enter the working folder /home/u/run on node1")
    assert bad is not None and bad.cause == "workdir_not_found" and bad.cause in CAUSES
    assert bad.line == ("job 2001 (own): couldn't enter the working folder /home/u/run on node1 (fix [job] workdir "
                        "in the job file: a folder every node sees; docs/own-script.md)")


def test_the_batch_scripts_refusal_is_a_command_not_found() -> None:
    bad = end(refusal="couldn't start the step: nosuchprog not found on node1")
    assert bad is not None and bad.cause == "command_not_found"
    assert bad.line == ("job 2001 (own): couldn't start the step: nosuchprog not found on node1 (fix "
                        "[training] command in the job file: an absolute path, or the {python}/{job_dir} fields; "
                        "docs/own-script.md)")


def test_exit_0_before_the_last_step_is_bad_input() -> None:
    ranks = [RankEnd(rank=0, phase="training", step=12), RankEnd(rank=1, phase="training", step=11)]
    bad = end(completed=True, ranks=ranks)
    assert bad is not None and bad.cause == "exited_early"
    assert bad.line == ("job 2001 (own): the training command exited 0 at step 12 of 80: a script must run to its "
                        "last step or exit 75 after a checkpoint (docs/own-script.md)")
    assert "exited 0 at step 12:" in end(completed=True, ranks=ranks, max_steps=None).line


def test_exit_0_with_every_rank_done_short_of_max_steps_is_still_early() -> None:
    ranks = [RankEnd(rank=r, phase="done", step=40) for r in range(2)]
    assert end(completed=True, ranks=ranks).cause == "exited_early"


def test_exit_0_without_any_heartbeat_is_bad_input() -> None:
    bad = end(completed=True)
    assert bad is not None and bad.cause == "exited_early" and "exited 0 without writing a heartbeat" in bad.line


@pytest.mark.parametrize("max_steps", [80, None])
def test_done_at_the_last_step_is_done(max_steps: int | None) -> None:
    assert end(completed=True, ranks=DONE, max_steps=max_steps) is None


def test_a_failure_before_any_heartbeat_ever_names_slurms_end_and_the_output() -> None:
    """The batch script may fail before any rank starts (a one-stage job's HET_GROUP_0 nodelist did):
    the line leads with Slurm's end and the job's output, not with a missing elastic.init()."""
    bad = end(slurm_state="FAILED", output="/home/u/logs/own-2001.out")
    assert bad is not None and bad.cause == "no_heartbeat"
    assert bad.line == ("job 2001 (own): Slurm ended it FAILED before any rank wrote a heartbeat: the job's output "
                        "/home/u/logs/own-2001.out says why (the batch script or the training command failed at "
                        "start; a command that runs must call slurm_omni.elastic.init() on every rank, "
                        "docs/own-script.md)")
    assert "ended it without a state (it left the queue)" in end().line
    assert "the job's output (its [job] log_dir) says why" in end().line
    assert end(ever_beat=True) is None                       # an earlier life beat: the recovery judges it


@pytest.mark.parametrize("kw", [{"cancelled": True}, {"lost": True}])
def test_cancelled_or_lost_node_ends_are_never_bad_input(kw: dict[str, Any]) -> None:
    ranks = [RankEnd(rank=0, phase="training", step=3, exit_code=78, error="x")]
    assert end(completed=True, ranks=ranks, refusal="x not found", **kw) is None
    assert end(**kw) is None


def test_never_beat_after_the_limit_only_when_no_life_ever_beat() -> None:
    assert never_beat(label=LABEL, running_for_s=19.9, limit_s=20, beats=0, ever_beat=False) is None
    bad = never_beat(label=LABEL, running_for_s=21.4, limit_s=20, beats=0, ever_beat=False)
    assert bad is not None and bad.cause == "no_heartbeat"
    assert bad.line == ("job 2001 (own): no rank wrote a heartbeat in 21 s of running (detection.first_heartbeat_s "
                        "= 20): the training command must call slurm_omni.elastic.init() on every rank "
                        "(docs/own-script.md); cancelled")
    assert never_beat(label=LABEL, running_for_s=99, limit_s=20, beats=1, ever_beat=False) is None
    assert never_beat(label=LABEL, running_for_s=99, limit_s=20, beats=0, ever_beat=True) is None


def test_the_refusal_file_is_one_printable_line() -> None:
    assert refusal_name(2001, 3) == "refused-2001-3.txt"
    assert decode_refusal(b"  prog not found on node1\n(ignored)\n") == "prog not found on node1"
    assert decode_refusal(b"a\tb\x1b[2Jc\n") == "a\\tb\\x1b[2Jc"
    for bad in (b"", b"\n  \n", b"\xff\xfe"):
        with pytest.raises(RecordRejected):
            decode_refusal(bad)
