"""Did the run that survived faults train on exactly what a run that never failed trained on?

Two checks against a reference run (same job file, no fault), by the job's **data contract**: what
"equivalent" means depends on what a change of the replica count does to the data. The contract is
named in the compare's line (:meth:`Equivalence.summary`):

- **bitwise** (every step ran at the reference's replica count): the loss of every step is bitwise
  equal to the reference's and every step trained on the reference's sample ids, in the same order.
  Same samples, same reduction order, same RNG streams: a correct resume changes nothing.
- **global order** (``[training.parallel] data_order = "global"``, the default, and some steps ran at
  another replica count): the samples of a step come from one global order cut per replica, and the
  global batch is kept, so every step still trains on the reference's sample ids. Up to the first
  resized step the loss is bitwise; from it on the reduction order differs and the loss must agree
  within the documented relative tolerance :data:`DEFAULT_RTOL` (1e-3: another order of the same
  float sums, not other samples).
- **per-replica draws** (``data_order = "per_replica"``, and some steps ran at another replica
  count): each replica draws its own batches (random offsets from a per-rank generator, a sampler
  split by the replica count), so from the first resized step on a step trains on other samples than
  the reference's and its loss is not comparable (it is shown, not judged). Compared is what stays
  defined: bitwise loss and the same ids up to the resize; after it, full global batches, no step
  replaying an earlier step's batch (a sampler restarted instead of restored), and, when the
  reference consumed no id twice (sampling without replacement inside one epoch), no id twice.

The data check also makes sure that every stage that traced its ids saw the same ids in the same
slots as the loss-reporting stage (in a vision-language job a misaligned pair trains images against
the wrong text while the loss can look fine). No stage name is assumed: the loss-reporting stage is
the job's last (``RunHistory.main_stage``).

Pure: takes histories, returns findings.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

from slurm_omni.drill.history import RunHistory

DEFAULT_RTOL = 1e-3
MAX_LISTED = 8

DataOrder = Literal["global", "per_replica"]
Contract = Literal["bitwise", "global_order", "per_replica"]
CONTRACT_NAMES = {"bitwise": "bitwise", "global_order": "global order", "per_replica": "per-replica draws"}
_PER_REPLICA_HINT = ('if the script draws its batches per replica, say so: [training.parallel] data_order = '
                     '"per_replica"')


@dataclass(frozen=True, slots=True)
class LossCheck:
    mode: Literal["bitwise", "tolerance", "before_resize"]
    """``bitwise``: every step; ``tolerance``: bitwise before ``resized_at``, within ``rtol`` from it;
    ``before_resize``: bitwise before ``resized_at``, not compared from it (other samples)."""
    steps_compared: int
    max_rel_diff: float
    """Over every step in common, compared or not."""
    first_diverging_step: int | None
    missing_steps: tuple[int, ...]
    """Steps of the reference that the run never completed."""
    rtol: float
    resized_at: int | None = None
    """The first step that ran at another replica count than the reference's (None: none did)."""

    @property
    def ok(self) -> bool:
        return ((self.steps_compared > 0 or self.mode == "before_resize") and self.first_diverging_step is None
                and not self.missing_steps)


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
    """(step, slot, main stage's id, other stage's id) where two stages disagree."""
    paired: bool
    """Both stages traced their ids (a colocated run checks its pairs inside the model)."""
    replayed_steps: tuple[int, ...] = ()
    """Per-replica draws: steps after the resize whose batch is an earlier step's (a restarted sampler)."""
    short_steps: tuple[int, ...] = ()
    """Per-replica draws: steps after the resize with another number of ids than the reference's step."""
    once_checked: bool = True
    """Per-replica draws: whether "no id twice" applied (the reference repeats none)."""
    pair: tuple[str, str] = ("", "")
    """(main stage, other stage) of the first misaligned slot."""

    @property
    def ok(self) -> bool:
        return (self.steps_compared > 0 and not self.skipped and not self.repeated
                and not self.reordered_steps and not self.misaligned and not self.replayed_steps
                and not self.short_steps)


@dataclass(frozen=True, slots=True)
class Equivalence:
    loss: LossCheck
    data: DataCheck | None
    problems: tuple[str, ...] = field(default=())
    contract: Contract = "bitwise"
    resize: str = ""
    """``replicas 2 -> 1 from step 21`` when some steps ran at another replica count."""

    @property
    def ok(self) -> bool:
        return self.loss.ok and (self.data is None or self.data.ok)

    def summary(self) -> str:
        """One line naming the contract: what it compared and found, or the first problems."""
        where = self.resize or ("every step at the reference's replica count" if self.loss.mode == "bitwise"
                                else f"within rtol {self.loss.rtol:g} as asked")
        name = f"contract {CONTRACT_NAMES[self.contract]} ({where})"
        if not self.ok:
            return f"{name}: " + "; ".join(self.problems)
        return f"{name}: {self._loss_text()}; {self._data_text()}"

    def _loss_text(self) -> str:
        lc = self.loss
        if lc.resized_at is None:
            return (f"loss {'bitwise' if lc.mode == 'bitwise' else f'within rtol {lc.rtol:g}'} over "
                    f"{lc.steps_compared} steps")
        before = f"loss bitwise over steps 1-{lc.resized_at - 1}" if lc.resized_at > 1 else "no step before it"
        if lc.mode == "tolerance":
            return f"{before}, within rtol {lc.rtol:g} from step {lc.resized_at} (max rel diff {lc.max_rel_diff:.2g})"
        return (f"{before}, not compared from step {lc.resized_at} (other samples; max rel diff "
                f"{lc.max_rel_diff:.2g})")

    def _data_text(self) -> str:
        d = self.data
        if d is None:
            return "no sample ids traced"
        pairs = ", pairs aligned" if d.paired else ""
        if self.contract != "per_replica" or self.loss.resized_at is None:
            return f"{d.steps_compared} steps of sample ids as the reference's{pairs}"
        once = ("each id at most once" if d.once_checked
                else "ids drawn with replacement (the reference repeats some): no step replays an earlier batch")
        return (f"sample ids as the reference's before step {self.loss.resized_at}, then full global batches, "
                f"{once}{pairs}")

    def to_json(self) -> dict[str, object]:
        d = self.data
        return {
            "ok": self.ok, "contract": self.contract, "resize": self.resize, "summary": self.summary(),
            "loss_mode": self.loss.mode, "loss_ok": self.loss.ok,
            "loss_steps": self.loss.steps_compared, "loss_max_rel_diff": self.loss.max_rel_diff,
            "loss_first_diverging_step": self.loss.first_diverging_step, "rtol": self.loss.rtol,
            "resized_at": self.loss.resized_at, "missing_steps": list(self.loss.missing_steps),
            "data_ok": None if d is None else d.ok, "data_steps": None if d is None else d.steps_compared,
            "skipped_ids": None if d is None else list(d.skipped),
            "repeated_ids": None if d is None else list(d.repeated),
            "reordered_steps": None if d is None else list(d.reordered_steps),
            "replayed_steps": None if d is None else list(d.replayed_steps),
            "misaligned": None if d is None else [list(m) for m in d.misaligned],
            "problems": list(self.problems),
        }


def compare_losses(run: dict[int, float], reference: dict[int, float], *, bitwise: bool,
                   rtol: float = DEFAULT_RTOL, resized_at: int | None = None,
                   after_resize: Literal["tolerance", "none"] = "tolerance") -> LossCheck:
    """``bitwise`` with no ``resized_at``: every step bitwise; else bitwise before ``resized_at`` and,
    from it, within ``rtol`` (``after_resize = "tolerance"``) or not compared (``"none"``). Without
    ``bitwise`` and ``resized_at``: every step within ``rtol``."""
    common = sorted(set(run) & set(reference))
    missing = tuple(sorted(set(reference) - set(run)))
    worst, first, compared = 0.0, None, 0
    for step in common:
        a, b = run[step], reference[step]
        rel = 0.0 if a == b else abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        resized = resized_at is not None and step >= resized_at
        if resized and after_resize == "none":
            continue
        compared += 1
        exact = bitwise and not resized
        if first is None and ((exact and a != b) or (not exact and rel > rtol)):
            first = step
    if resized_at is None:
        mode: Literal["bitwise", "tolerance", "before_resize"] = "bitwise" if bitwise else "tolerance"
    else:
        mode = "tolerance" if after_resize == "tolerance" else "before_resize"
    return LossCheck(mode, compared, worst, first, missing, rtol, resized_at)


def check_data(run: RunHistory, reference: RunHistory | None, *, per_replica_from: int | None = None) -> DataCheck | None:
    """Exactly-once and pairing; None when the run traced no sample ids. ``per_replica_from``: the
    first resized step of a run whose replicas draw their own batches (per-replica draws): from it
    on a step is checked for a full global batch, no replay of an earlier batch and, while the
    reference repeats no id, no id twice; before it, as the reference's."""
    main = run.main_stage
    if main is None:
        return None
    ids = run.ids(main)
    misaligned: list[tuple[int, int, int, int]] = []
    pair = ("", "")
    others = [s for s in run.stages if s != main]
    for other in others:
        theirs = run.ids(other)
        for step in sorted(set(ids) | set(theirs)):
            m, o = ids.get(step, []), theirs.get(step, [])
            for slot in range(max(len(m), len(o))):
                mid = m[slot] if slot < len(m) else -1
                oid = o[slot] if slot < len(o) else -1
                if mid != oid:
                    if not misaligned:
                        pair = (main, other)
                    misaligned.append((step, slot, mid, oid))
    skipped: list[int] = []
    repeated: list[int] = []
    reordered: list[int] = []
    replayed: list[int] = []
    short: list[int] = []
    once = True
    compared = len(ids)
    if reference is not None and reference.stages:
        ref_main = main if main in reference.stages else reference.main_stage
        ref_ids = reference.ids(ref_main) if ref_main is not None else {}
        steps = sorted(set(ids) & set(ref_ids))
        compared = len(steps)
        same = [s for s in steps if per_replica_from is None or s < per_replica_from]
        got = collections.Counter(i for s in same for i in ids[s])
        want = collections.Counter(i for s in same for i in ref_ids[s])
        skipped = sorted((want - got).elements())
        repeated = sorted((got - want).elements())
        reordered = [s for s in same if ids[s] != ref_ids[s]]
        if per_replica_from is not None:
            drawn = [s for s in steps if s >= per_replica_from]
            short = [s for s in drawn if len(ids[s]) != len(ref_ids[s])]
            replayed = _replayed(ids, per_replica_from)
            ref_counts = collections.Counter(i for s in steps for i in ref_ids[s])
            once = all(n == 1 for n in ref_counts.values())
            if once:
                counts = collections.Counter(i for s in steps for i in ids[s])
                repeated = sorted(i for i, n in counts.items() if n > 1)
    else:
        # Without a reference only repeats inside the run can be seen (within one epoch of data).
        counts = collections.Counter(i for s in ids for i in ids[s])
        repeated = sorted(i for i, n in counts.items() if n > 1)
    return DataCheck(compared, tuple(skipped), tuple(repeated), tuple(reordered), tuple(misaligned), bool(others),
                     tuple(replayed), tuple(short), once, pair)


def _replayed(ids: dict[int, list[int]], since: int) -> list[int]:
    """Steps from ``since`` on that, with the step after them, hold the batches of two consecutive
    earlier steps (a sampler restarted from its start replays a sequence; one equal batch alone can
    be chance when batches are drawn with replacement)."""
    batch = {s: tuple(sorted(v)) for s, v in ids.items()}
    first_at: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    out = []
    for s in sorted(batch):
        pair = (batch[s], batch.get(s + 1, ()))
        if not pair[0] or not pair[1]:
            continue
        earlier = first_at.setdefault(pair, s)
        if s >= since and earlier < s:
            out.append(s)
    return out


def same_layout(run: RunHistory, reference: RunHistory) -> bool:
    """Every step ran with the reference's data-parallel size (then the curve must be bitwise)."""
    return first_resized_step(run, reference) is None


def first_resized_step(run: RunHistory, reference: RunHistory) -> int | None:
    """The first step (of the run's effective history) that ran at another replica count than the
    reference's same step; None when none did."""
    ref = {s: r.data_parallel_size for s, r in reference.effective().items()}
    for s, r in run.effective().items():
        want = ref.get(s, r.data_parallel_size)
        if r.data_parallel_size is not None and want is not None and r.data_parallel_size != want:
            return s
    return None


def _resize_text(run: RunHistory, reference: RunHistory, at: int | None) -> str:
    if at is None:
        return ""
    before = reference.effective().get(at)
    now = run.effective()[at]
    was = before.data_parallel_size if before is not None else "?"
    return f"replicas {was} -> {now.data_parallel_size} from step {at}, the global batch kept"


def check_equivalence(run: RunHistory, reference: RunHistory, *, rtol: float = DEFAULT_RTOL,
                      bitwise: bool | None = None, data_order: DataOrder = "global") -> Equivalence:
    """Compare ``run`` with ``reference`` by the contract the layouts and ``data_order`` (the job's
    ``[training.parallel] data_order``) give (the module's docstring). ``bitwise`` True: every step
    bitwise whatever the layouts; False: every step within ``rtol`` (neither names a resize)."""
    resized_at = first_resized_step(run, reference) if bitwise is None else None
    contract: Contract = ("bitwise" if resized_at is None and bitwise is not False
                          else "per_replica" if data_order == "per_replica" and resized_at is not None
                          else "global_order")
    loss = compare_losses(run.losses(), reference.losses(), bitwise=bitwise is not False, rtol=rtol,
                          resized_at=resized_at, after_resize="none" if contract == "per_replica" else "tolerance")
    data = check_data(run, reference, per_replica_from=resized_at if contract == "per_replica" else None)
    problems = []
    if loss.steps_compared == 0 and loss.mode != "before_resize":
        problems.append("no step in common with the reference")
    if loss.first_diverging_step is not None:
        step = loss.first_diverging_step
        a, b = run.losses()[step], reference.losses()[step]
        how = "bitwise" if resized_at is None or step < resized_at else f"rtol {rtol:g}"
        problems.append(f"loss differs from the reference at step {step} ({a!r} vs {b!r}; {how})")
    if loss.missing_steps:
        problems.append(f"{len(loss.missing_steps)} reference steps never completed "
                        f"(first {loss.missing_steps[0]})")
    if data is not None:
        if data.skipped:
            problems.append(f"{len(data.skipped)} sample ids skipped: {_ids(data.skipped)}")
        if data.repeated:
            problems.append(f"{len(data.repeated)} sample ids repeated: {_ids(data.repeated)}")
        if data.reordered_steps:
            first = data.reordered_steps[0]
            hint = f" ({_PER_REPLICA_HINT})" if resized_at is not None and first >= resized_at else ""
            problems.append(f"{len(data.reordered_steps)} steps hold other samples than the reference "
                            f"(first step {first}){hint}")
        if data.replayed_steps:
            problems.append(f"{len(data.replayed_steps)} steps after the resize replay an earlier step's batch "
                            f"(first step {data.replayed_steps[0]}: a sampler restarted, not restored)")
        if data.short_steps:
            problems.append(f"{len(data.short_steps)} steps after the resize hold another number of samples than "
                            f"the reference's (first step {data.short_steps[0]}: the global batch not kept)")
        if data.misaligned:
            step, slot, m, o = data.misaligned[0]
            main, other = data.pair
            problems.append(f"{len(data.misaligned)} misaligned pairs (first: step {step} slot {slot}: "
                            f"{other} read sample {o} where {main} read sample {m})")
    return Equivalence(loss, data, tuple(problems), contract, _resize_text(run, reference, resized_at))


def _ids(ids: tuple[int, ...]) -> str:
    head = ", ".join(str(i) for i in ids[:MAX_LISTED])
    return head + (", ..." if len(ids) > MAX_LISTED else "")
