"""Did the run that survived faults train on exactly what a run that never failed trained on?

Two checks against a reference run (same job file, no fault):

- **Loss curve.** The effective loss of every step (the latest incarnation's) against the
  reference's. With the same layout on every step (data-parallel size and micro-batches), a correct
  resume is bitwise identical: same samples, same reduction order, same RNG streams. After a shrink
  the reduction order changes, so the curve must agree within a relative tolerance instead.
- **Data.** Every sample id is consumed exactly as often as in the reference (none skipped, none
  repeated), step by step in the same order, and the vision stage and the text stage saw the same
  ids in the same slots (a misaligned pair trains images against the wrong text while the loss
  curve can look fine).

Pure: takes histories, returns findings.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

from slurm_omni.drill.history import RunHistory

DEFAULT_RTOL = 1e-3
PAIRED_STAGES = ("vision", "text")
MAX_LISTED = 8


@dataclass(frozen=True, slots=True)
class LossCheck:
    mode: Literal["bitwise", "tolerance"]
    steps_compared: int
    max_rel_diff: float
    first_diverging_step: int | None
    missing_steps: tuple[int, ...]
    """Steps of the reference that the run never completed."""
    rtol: float

    @property
    def ok(self) -> bool:
        return self.steps_compared > 0 and self.first_diverging_step is None and not self.missing_steps


@dataclass(frozen=True, slots=True)
class DataCheck:
    steps_compared: int
    skipped: tuple[int, ...]
    """Ids the reference consumed more often than the run."""
    repeated: tuple[int, ...]
    """Ids the run consumed more often than the reference."""
    reordered_steps: tuple[int, ...]
    """Steps holding other ids (or another order) than the reference's same step."""
    misaligned: tuple[tuple[int, int, int, int], ...]
    """(step, slot, vision id, text id) where the two stages disagree."""
    paired: bool
    """Both stages traced their ids (a colocated run checks its pairs inside the model)."""

    @property
    def ok(self) -> bool:
        return (self.steps_compared > 0 and not self.skipped and not self.repeated
                and not self.reordered_steps and not self.misaligned)


@dataclass(frozen=True, slots=True)
class Equivalence:
    loss: LossCheck
    data: DataCheck | None
    problems: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.loss.ok and (self.data is None or self.data.ok)

    def summary(self) -> str:
        """One line: what passed, or the first problems found."""
        if self.ok:
            data = "no sample ids traced" if self.data is None else (
                f"{self.data.steps_compared} steps of sample ids exactly once"
                + (", pairs aligned" if self.data.paired else ""))
            return (f"loss {self.loss.mode} over {self.loss.steps_compared} steps "
                    f"(max rel diff {self.loss.max_rel_diff:.2g}); {data}")
        return "; ".join(self.problems)

    def to_json(self) -> dict[str, object]:
        d = self.data
        return {
            "ok": self.ok, "loss_mode": self.loss.mode, "loss_ok": self.loss.ok,
            "loss_steps": self.loss.steps_compared, "loss_max_rel_diff": self.loss.max_rel_diff,
            "loss_first_diverging_step": self.loss.first_diverging_step, "rtol": self.loss.rtol,
            "missing_steps": list(self.loss.missing_steps),
            "data_ok": None if d is None else d.ok, "data_steps": None if d is None else d.steps_compared,
            "skipped_ids": None if d is None else list(d.skipped),
            "repeated_ids": None if d is None else list(d.repeated),
            "reordered_steps": None if d is None else list(d.reordered_steps),
            "misaligned": None if d is None else [list(m) for m in d.misaligned],
            "problems": list(self.problems),
        }


def compare_losses(run: dict[int, float], reference: dict[int, float], *, bitwise: bool,
                   rtol: float = DEFAULT_RTOL) -> LossCheck:
    common = sorted(set(run) & set(reference))
    missing = tuple(sorted(set(reference) - set(run)))
    worst, first = 0.0, None
    for step in common:
        a, b = run[step], reference[step]
        rel = 0.0 if a == b else abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        if first is None and ((bitwise and a != b) or (not bitwise and rel > rtol)):
            first = step
    return LossCheck("bitwise" if bitwise else "tolerance", len(common), worst, first, missing, rtol)


def check_data(run: RunHistory, reference: RunHistory | None) -> DataCheck | None:
    """Exactly-once and pairing; None when the run traced no sample ids."""
    stages = run.stages
    if not stages:
        return None
    main = "text" if "text" in stages else stages[0]
    ids = run.ids(main)
    misaligned: list[tuple[int, int, int, int]] = []
    paired = all(s in stages for s in PAIRED_STAGES)
    if paired:
        vision, text = run.ids("vision"), run.ids("text")
        for step in sorted(set(vision) | set(text)):
            v, t = vision.get(step, []), text.get(step, [])
            for slot in range(max(len(v), len(t))):
                vid = v[slot] if slot < len(v) else -1
                tid = t[slot] if slot < len(t) else -1
                if vid != tid:
                    misaligned.append((step, slot, vid, tid))
    skipped: list[int] = []
    repeated: list[int] = []
    reordered: list[int] = []
    compared = len(ids)
    if reference is not None and reference.stages:
        ref_ids = reference.ids("text" if "text" in reference.stages else reference.stages[0])
        steps = sorted(set(ids) & set(ref_ids))
        compared = len(steps)
        got = collections.Counter(i for s in steps for i in ids[s])
        want = collections.Counter(i for s in steps for i in ref_ids[s])
        skipped = sorted((want - got).elements())
        repeated = sorted((got - want).elements())
        reordered = [s for s in steps if ids[s] != ref_ids[s]]
    else:
        # Without a reference only repeats inside the run can be seen (within one epoch of data).
        counts = collections.Counter(i for s in ids for i in ids[s])
        repeated = sorted(i for i, n in counts.items() if n > 1)
    return DataCheck(compared, tuple(skipped), tuple(repeated), tuple(reordered), tuple(misaligned), paired)


def same_layout(run: RunHistory, reference: RunHistory) -> bool:
    """Every step ran with the reference's data-parallel size (then the curve must be bitwise)."""
    ref = {s: r.data_parallel_size for s, r in reference.effective().items()}
    return all(r.data_parallel_size == ref.get(s, r.data_parallel_size) for s, r in run.effective().items())


def check_equivalence(run: RunHistory, reference: RunHistory, *, rtol: float = DEFAULT_RTOL,
                      bitwise: bool | None = None) -> Equivalence:
    """Compare ``run`` with ``reference``; ``bitwise`` None: bitwise exactly when the layouts agree."""
    exact = same_layout(run, reference) if bitwise is None else bitwise
    loss = compare_losses(run.losses(), reference.losses(), bitwise=exact, rtol=rtol)
    data = check_data(run, reference)
    problems = []
    if loss.steps_compared == 0:
        problems.append("no step in common with the reference")
    if loss.first_diverging_step is not None:
        step = loss.first_diverging_step
        a, b = run.losses()[step], reference.losses()[step]
        problems.append(f"loss differs from the reference at step {step} ({a!r} vs {b!r}; "
                        f"{loss.mode}, rtol {rtol:g})")
    if loss.missing_steps:
        problems.append(f"{len(loss.missing_steps)} reference steps never completed "
                        f"(first {loss.missing_steps[0]})")
    if data is not None:
        if data.skipped:
            problems.append(f"{len(data.skipped)} sample ids skipped: {_ids(data.skipped)}")
        if data.repeated:
            problems.append(f"{len(data.repeated)} sample ids repeated: {_ids(data.repeated)}")
        if data.reordered_steps:
            problems.append(f"{len(data.reordered_steps)} steps hold other samples than the reference "
                            f"(first step {data.reordered_steps[0]})")
        if data.misaligned:
            step, slot, v, t = data.misaligned[0]
            problems.append(f"{len(data.misaligned)} misaligned pairs (first: step {step} slot {slot}: "
                            f"image of sample {v} with text of sample {t})")
    return Equivalence(loss, data, tuple(problems))


def _ids(ids: tuple[int, ...]) -> str:
    head = ", ".join(str(i) for i in ids[:MAX_LISTED])
    return head + (", ..." if len(ids) > MAX_LISTED else "")
