"""The equivalence checker on synthetic metrics: bitwise pass, tolerance after a shrink, and each
kind of data fault it must catch (a skipped sample, a repeated sample, a misaligned pair)."""

from __future__ import annotations

from pathlib import Path

import pytest
from drill_support import batches, losses, write_run

from slurm_omni.drill.equivalence import check_equivalence, compare_losses
from slurm_omni.drill.history import HistoryError, load_history

N = 12


def reference(tmp_path: Path) -> Path:
    ids, loss = batches(N), losses(N)
    return write_run(tmp_path / "ref", [(s + 1, 0, loss[s], ids[s]) for s in range(N)])


def resumed(tmp_path: Path, *, killed_after: int = 8, restored: int = 5, loss_fn=None, ids_fn=None,
            **kw) -> Path:
    """Incarnation 0 ran steps 1..killed_after, incarnation 1 resumed from ``restored``."""
    ids, loss = batches(N), losses(N)
    loss_fn = loss_fn or (lambda s, inc: loss[s - 1])
    ids_fn = ids_fn or (lambda s, inc: ids[s - 1])
    steps = [(s, 0, loss_fn(s, 0), ids_fn(s, 0)) for s in range(1, killed_after + 1)]
    steps += [(s, 1, loss_fn(s, 1), ids_fn(s, 1)) for s in range(restored + 1, N + 1)]
    return write_run(tmp_path / "run", steps, **kw)


def test_same_layout_resume_passes_bitwise(tmp_path: Path) -> None:
    eq = check_equivalence(load_history(resumed(tmp_path)), load_history(reference(tmp_path)))
    assert eq.ok, eq.problems
    assert eq.loss.mode == "bitwise" and eq.loss.steps_compared == N and eq.loss.max_rel_diff == 0.0
    assert eq.data is not None and eq.data.paired and eq.data.steps_compared == N


def test_bitwise_means_bitwise(tmp_path: Path) -> None:
    """One ulp off after the resume fails the same-layout check."""
    run = resumed(tmp_path, loss_fn=lambda s, inc: losses(N)[s - 1] + (1e-12 if inc == 1 and s == 10 else 0.0))
    eq = check_equivalence(load_history(run), load_history(reference(tmp_path)))
    assert not eq.ok and eq.loss.first_diverging_step == 10
    assert "step 10" in eq.summary()


def test_shrink_passes_within_tolerance(tmp_path: Path) -> None:
    """After a shrink to one replica the reduction order changes: a small drift is allowed..."""
    drift = lambda s, inc: losses(N)[s - 1] * (1 + 2e-5 * inc)
    run = resumed(tmp_path, loss_fn=drift, layout={s: 1 for s in range(6, N + 1)})
    eq = check_equivalence(load_history(run), load_history(reference(tmp_path)))
    assert eq.ok, eq.problems
    assert eq.loss.mode == "tolerance" and 0 < eq.loss.max_rel_diff < 1e-3


def test_shrink_beyond_tolerance_fails(tmp_path: Path) -> None:
    """... a jump (data state lost in the resume) does not."""
    jump = lambda s, inc: losses(N)[s - 1] * (1.05 if inc else 1.0)
    run = resumed(tmp_path, loss_fn=jump, layout={s: 1 for s in range(6, N + 1)})
    eq = check_equivalence(load_history(run), load_history(reference(tmp_path)))
    assert not eq.ok and eq.loss.mode == "tolerance" and eq.loss.first_diverging_step == 6


def test_skipped_sample_is_found(tmp_path: Path) -> None:
    """The resumed incarnation starts one sample late: sample 20 is never trained on."""
    ids = batches(N)
    late = lambda s, inc: [i + 1 for i in ids[s - 1]] if inc == 1 and s == 6 else ids[s - 1]
    eq = check_equivalence(load_history(resumed(tmp_path, ids_fn=late)), load_history(reference(tmp_path)))
    assert not eq.ok
    assert eq.data is not None and eq.data.skipped == (20,) and eq.data.repeated == (24,)
    assert eq.data.reordered_steps == (6,)
    assert "1 sample ids skipped: 20" in eq.summary()


def test_repeated_sample_is_found(tmp_path: Path) -> None:
    """Data positions restored one step too early: step 6 trains on step 5's samples again."""
    ids = batches(N)
    replay = lambda s, inc: ids[s - 2] if inc == 1 and s == 6 else ids[s - 1]
    eq = check_equivalence(load_history(resumed(tmp_path, ids_fn=replay)), load_history(reference(tmp_path)))
    assert eq.data is not None and not eq.data.ok
    assert eq.data.repeated == (16, 17, 18, 19) and eq.data.skipped == (20, 21, 22, 23)
    assert any("repeated" in p for p in eq.problems)


def test_misaligned_pair_is_found(tmp_path: Path) -> None:
    """The vision stage resumed one slot off: images of one sample with the text of another."""
    ids = batches(N)
    shifted = {(s, 1): ids[s - 1][1:] + ids[s][:1] for s in range(6, N)}
    run = resumed(tmp_path, vision_ids=shifted)
    eq = check_equivalence(load_history(run, ("vision", "text")), load_history(reference(tmp_path)))
    assert not eq.ok and eq.data is not None
    assert not eq.data.skipped and not eq.data.repeated   # the text side alone looks perfect
    assert eq.data.misaligned[0] == (6, 0, 20, 21) and eq.data.pair == ("text", "vision")
    assert "misaligned pairs (first: step 6 slot 0: vision read sample 21 where text read sample 20)" in eq.summary()


@pytest.mark.parametrize("stages", [("gpt",), ("speech", "image", "lm"), ("audio", "vision", "text")])
def test_any_stage_names_and_counts(tmp_path: Path, stages: tuple[str, ...]) -> None:
    """No stage name is assumed: the loss is the last stage's (by the job's names or found from the files),
    and every stage's ids are checked against it. Before, a stage named gpt had "no metrics-text-0.jsonl"."""
    ids, loss = batches(N), losses(N)
    ref = write_run(tmp_path / "ref", [(s + 1, 0, loss[s], ids[s]) for s in range(N)], stages=stages)
    run = resumed(tmp_path, stages=stages)
    for names in (stages, ()):
        eq = check_equivalence(load_history(run, names), load_history(ref, names))
        assert eq.ok, eq.problems
        assert eq.loss.steps_compared == N and eq.data is not None and eq.data.paired == (len(stages) > 1)
    if len(stages) > 1:
        shifted = {(s, 1): ids[s - 1][1:] + ids[s][:1] for s in range(6, N)}
        eq = check_equivalence(load_history(resumed(tmp_path / "bad", vision_ids=shifted, stages=stages), stages),
                               load_history(ref, stages))
        assert not eq.ok and eq.data is not None and eq.data.pair[0] == stages[-1]
        assert eq.data.misaligned[0] == (6, 0, 20, 21)
    with pytest.raises(HistoryError, match="no metrics-absent-0.jsonl or metrics-other[+](.*[+])?absent-0.jsonl"):
        load_history(ref, ("other", *stages[:-1], "absent"))


def test_superseded_incarnation_does_not_count(tmp_path: Path) -> None:
    """Steps 6..8 of the killed incarnation trained on something else; the replay is what counts."""
    ids = batches(N)
    wrong = lambda s, inc: [99, 98, 97, 96] if inc == 0 and s > 5 else ids[s - 1]
    eq = check_equivalence(load_history(resumed(tmp_path, ids_fn=wrong)), load_history(reference(tmp_path)))
    assert eq.ok, eq.problems


def test_unfinished_run_is_not_equivalent(tmp_path: Path) -> None:
    ids, loss = batches(N), losses(N)
    run = write_run(tmp_path / "short", [(s + 1, 0, loss[s], ids[s]) for s in range(N - 3)])
    eq = check_equivalence(load_history(run), load_history(reference(tmp_path)))
    assert not eq.ok and eq.loss.missing_steps == (10, 11, 12)


def test_compare_losses_tolerance_edge() -> None:
    assert compare_losses({1: 1.0}, {1: 1.0 + 1e-4}, bitwise=False, rtol=1e-3).ok
    assert not compare_losses({1: 1.0}, {1: 1.0 + 1e-4}, bitwise=True).ok


def test_torn_last_line_is_ignored_but_a_torn_middle_is_not(tmp_path: Path) -> None:
    run = reference(tmp_path)
    path = run / "metrics-text-0.jsonl"
    path.write_text(path.read_text() + '{"time": 1, "ste')
    assert len(load_history(run).records) == N
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"torn', *lines[1:]]) + "\n")
    with pytest.raises(HistoryError, match="line 2"):
        load_history(run)


def test_missing_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no such folder"):
        load_history(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HistoryError, match="no metrics-<stage>-0.jsonl"):
        load_history(tmp_path / "empty")
    with pytest.raises(HistoryError, match="no metrics-text-0.jsonl or metrics-vision[+]text-0.jsonl"):
        load_history(tmp_path / "empty", ("vision", "text"))


# -- the data contract named in the compare's line --------------------------------------------------
SHRUNK = {s: 1 for s in range(6, N + 1)}


def drawn(s: int, inc: int) -> list[int]:
    """Per-replica draws: after the resize (incarnation 1) every step holds other, fresh ids."""
    return batches(N)[s - 1] if inc == 0 else [100 + 4 * s + k for k in range(4)]


def test_the_line_names_the_bitwise_contract(tmp_path: Path) -> None:
    eq = check_equivalence(load_history(resumed(tmp_path)), load_history(reference(tmp_path)))
    assert eq.contract == "bitwise" and eq.summary().startswith(
        "contract bitwise (every step at the reference's replica count): loss bitwise over 12 steps; ")
    assert eq.to_json()["contract"] == "bitwise"


def test_global_order_after_a_shrink_is_bitwise_before_it_and_within_tolerance_after(tmp_path: Path) -> None:
    drift = lambda s, inc: losses(N)[s - 1] * (1 + 2e-5 * inc)
    eq = check_equivalence(load_history(resumed(tmp_path, loss_fn=drift, layout=SHRUNK)),
                           load_history(reference(tmp_path)))
    assert eq.ok and eq.contract == "global_order" and eq.loss.resized_at == 6, eq.summary()
    assert eq.summary().startswith("contract global order (replicas 2 -> 1 from step 6, the global batch kept): "
                                   "loss bitwise over steps 1-5, within rtol 0.001 from step 6 (max rel diff 2e-05)")
    # a drift before the resize is a fault: those steps ran as the reference's did
    early = lambda s, inc: losses(N)[s - 1] * (1 + 1e-9 * (s == 3))
    bad = check_equivalence(load_history(resumed(tmp_path / "b", loss_fn=early, layout=SHRUNK)),
                            load_history(reference(tmp_path / "b")))
    assert not bad.ok and bad.loss.first_diverging_step == 3 and "bitwise" in bad.summary()


def test_per_replica_draws_after_a_shrink_pass_on_what_is_defined_not_the_loss(tmp_path: Path) -> None:
    """The issue's run: other samples after the shrink, the loss 0.6 % off at step 6: correct."""
    off = lambda s, inc: losses(N)[s - 1] * (1.006 if inc else 1.0)
    run = load_history(resumed(tmp_path, loss_fn=off, ids_fn=drawn, layout=SHRUNK))
    ref = load_history(reference(tmp_path))
    assert not check_equivalence(run, ref).ok            # judged as a global order, it fails...
    assert 'data_order = "per_replica"' in check_equivalence(run, ref).summary()   # ...and says what to declare
    eq = check_equivalence(run, ref, data_order="per_replica")
    assert eq.ok and eq.contract == "per_replica" and eq.loss.mode == "before_resize", eq.summary()
    assert eq.loss.steps_compared == 5 and 0.005 < eq.loss.max_rel_diff < 0.007
    assert eq.summary() == ("contract per-replica draws (replicas 2 -> 1 from step 6, the global batch kept): "
                            "loss bitwise over steps 1-5, not compared from step 6 (other samples; max rel diff "
                            "0.006); sample ids as the reference's before step 6, then full global batches, each id "
                            "at most once, pairs aligned")


def test_per_replica_draws_still_catch_a_replay_a_repeat_a_short_batch_and_a_bad_start(tmp_path: Path) -> None:
    ref = load_history(reference(tmp_path))
    restarted = lambda s, inc: batches(N)[s - 6] if inc else batches(N)[s - 1]     # the sampler from its start
    eq = check_equivalence(load_history(resumed(tmp_path / "r", ids_fn=restarted, layout=SHRUNK)), ref,
                           data_order="per_replica")
    assert not eq.ok and eq.data is not None and eq.data.replayed_steps[0] == 6
    assert "replay an earlier step's batch (first step 6" in eq.summary()
    twice = lambda s, inc: [0, 1, 2, 3] if (inc, s) == (1, 9) else drawn(s, inc)
    eq = check_equivalence(load_history(resumed(tmp_path / "t", ids_fn=twice, layout=SHRUNK)), ref,
                           data_order="per_replica")
    assert not eq.ok and eq.data is not None and eq.data.repeated == (0, 1, 2, 3)
    half = lambda s, inc: drawn(s, inc)[:2] if inc else drawn(s, inc)
    eq = check_equivalence(load_history(resumed(tmp_path / "h", ids_fn=half, layout=SHRUNK, dp=1)), ref,
                           data_order="per_replica")
    assert not eq.ok and eq.data is not None and eq.data.short_steps[0] == 6
    early = lambda s, inc: [i + 1 for i in batches(N)[s - 1]] if s == 4 else drawn(s, inc)
    eq = check_equivalence(load_history(resumed(tmp_path / "e", ids_fn=early, layout=SHRUNK)), ref,
                           data_order="per_replica")
    assert not eq.ok and eq.data is not None and eq.data.reordered_steps == (4,)


def test_per_replica_draws_with_replacement_drop_only_the_once_check(tmp_path: Path) -> None:
    """A reference that repeats ids itself (random offsets with replacement): "no id twice" is not
    defined; the line says which checks applied."""
    rep = [[s % 3, 50 + s, 60 + s, 70 + s] for s in range(N)]
    refdir = write_run(tmp_path / "ref", [(s + 1, 0, losses(N)[s], rep[s]) for s in range(N)])
    ids = lambda s, inc: rep[s - 1] if inc == 0 else [s % 2, 80 + s, 90 + s, 95 + s]
    eq = check_equivalence(load_history(resumed(tmp_path, ids_fn=ids, layout=SHRUNK)), load_history(refdir),
                           data_order="per_replica")
    assert eq.ok and eq.data is not None and not eq.data.once_checked, eq.summary()
    assert "ids drawn with replacement (the reference repeats some): no step replays an earlier batch" in eq.summary()


def test_one_batch_drawn_again_by_chance_is_no_replay(tmp_path: Path) -> None:
    """With replacement a step may draw an earlier step's batch: only a replayed sequence is a fault."""
    rep = [[s % 3, 50 + s, 60 + s, 70 + s] for s in range(N)]
    refdir = write_run(tmp_path / "ref", [(s + 1, 0, losses(N)[s], rep[s]) for s in range(N)])
    ids = lambda s, inc: rep[s - 1] if inc == 0 else rep[1] if s == 9 else [s % 2, 80 + s, 90 + s, 95 + s]
    eq = check_equivalence(load_history(resumed(tmp_path, ids_fn=ids, layout=SHRUNK)), load_history(refdir),
                           data_order="per_replica")
    assert eq.ok and eq.data is not None and eq.data.replayed_steps == (), eq.summary()
    twice = lambda s, inc: rep[s - 1] if inc == 0 else rep[s - 8] if s in (9, 10) else [s % 2, 80 + s, 90 + s, 95 + s]
    eq = check_equivalence(load_history(resumed(tmp_path / "seq", ids_fn=twice, layout=SHRUNK)),
                           load_history(refdir), data_order="per_replica")
    assert not eq.ok and eq.data is not None and eq.data.replayed_steps == (9,), eq.summary()
