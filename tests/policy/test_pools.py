"""Pool allocations and the grow-back (policy/pools.py): pure, a fake clock."""

from __future__ import annotations

from slurm_omni.policy.in_allocation import StageSpec, StepLayout, parse_stages
from slurm_omni.policy.pools import (
    Pool,
    grow_now,
    grow_plan,
    missing_nodes,
    pool_ask,
    pool_constraint,
    pool_kinds,
    pool_minutes,
    pool_warm,
    span_end,
    successor_due,
    successor_lead_for,
    successor_lead_s,
)

STAGES = parse_stages("vision:2:1:1,text:2:1:1")
FULL = StepLayout((("n1", "n2"), ("n3", "n4")), ("n5", "n6"), (), 2, {})
# both spares used, then a third node lost: one unit of two
SHRUNK = StepLayout((("n5",), ("n6",)), ("n2",), ("n1", "n3", "n4"), 1, {})
SHRUNK_NO_SPARE = StepLayout((("n5",), ("n6",)), (), ("n1", "n2", "n3", "n4"), 1, {})
NOW = 1000.0


def test_a_job_at_full_size_asks_for_nothing() -> None:
    assert pool_ask(STAGES, FULL, (), end_time=NOW + 3600, now=NOW, default_minutes=60) is None


def test_a_shrunk_job_asks_for_the_nodes_it_misses_less_the_spares_it_holds() -> None:
    assert missing_nodes(STAGES, SHRUNK_NO_SPARE) == {"": 2}
    assert missing_nodes(STAGES, SHRUNK) == {"": 1}     # the healthy node the shrink let go of is a spare
    ask = pool_ask(STAGES, SHRUNK_NO_SPARE, (), end_time=NOW + 600, now=NOW, default_minutes=60)
    assert ask is not None and ask.nodes == 2 and ask.per_kind == () and ask.switches == 1
    assert ask.minutes == 10                           # no longer than the job's own allocation lives
    assert pool_constraint(ask) == ""
    assert "1 of 2 unit(s)" in ask.reason
    assert ask.exclude == ("n1", "n2", "n3", "n4")    # the nodes it lost: a pool on one would be no use


def test_one_pool_waiting_at_a_time_and_not_forever() -> None:
    pending = Pool(job_id="7", state="requested", name="p0")
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, (pending,), end_time=None, now=NOW, default_minutes=60) is None
    asking = Pool(job_id="", state="asking", name="p0")
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, (asking,), end_time=None, now=NOW, default_minutes=60) is None
    # granted, the grow-back onto its nodes not made yet: nothing more is asked for
    granted = Pool(job_id="7", state="granted", name="p0", nodes=("n7",))
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, (granted,), end_time=None, now=NOW, default_minutes=60) is None
    # its nodes taken in and lost again (a shrink after the grow-back): another pool is asked for
    lost = StepLayout((("n5",), ("n6",)), (), ("n1", "n2", "n3", "n4", "n7"), 1, {})
    again = pool_ask(STAGES, lost, (granted,), end_time=None, now=NOW, default_minutes=60)
    assert again is not None and "n7" in again.exclude
    ended = [Pool(job_id=str(i), state="ended", name=f"p{i}") for i in range(3)]
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, ended[:2], end_time=None, now=NOW, default_minutes=60) is not None
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, ended, end_time=None, now=NOW, default_minutes=60, max_asks=3) is None


def test_no_pool_when_the_allocation_is_about_to_end_and_no_switch_preference_without_spares_policy() -> None:
    assert pool_ask(STAGES, SHRUNK_NO_SPARE, (), end_time=NOW + 30, now=NOW, default_minutes=60) is None
    ask = pool_ask(STAGES, SHRUNK_NO_SPARE, (), end_time=None, now=NOW, default_minutes=45, spare_scope="none")
    assert ask is not None and ask.switches == 0 and ask.minutes == 45
    assert pool_minutes(NOW + 61, NOW, default_minutes=5) == 2 and pool_minutes(NOW - 5, NOW, default_minutes=5) == 1


def test_stages_told_apart_by_features_ask_constraint_counts_per_kind() -> None:
    stages = (StageSpec("vision", 2, 1, 0, "vis"), StageSpec("text", 4, 1, 0, "txt"))
    layout = StepLayout((("a",), ("b", "c")), (), ("d", "e", "f"), 1, {"a": "vis", "b": "txt", "c": "txt"})
    ask = pool_ask(stages, layout, (), end_time=None, now=NOW, default_minutes=60)
    assert ask is not None and ask.nodes == 3 and ask.per_kind == (("txt", 2), ("vis", 1))
    assert pool_constraint(ask) == "[txt*2&vis*1]"
    assert pool_kinds(stages, ["x", "y", "z"], {"x": {"vis"}, "y": {"txt", "ib"}}) == {"x": "vis", "y": "txt", "z": ""}


def test_grow_back_takes_the_pools_nodes_to_the_full_size() -> None:
    pool = Pool(job_id="9", state="granted", name="p0", nodes=("n7", "n8"), kind_of={"n7": "", "n8": ""})
    plan = grow_plan(STAGES, SHRUNK_NO_SPARE, (pool,))
    assert plan is not None and plan.layout.units == 2 and not plan.shrunk
    assert plan.layout.components == (("n5", "n7"), ("n6", "n8")) and plan.added == ("n7", "n8")
    assert plan.removed == () and plan.layout.spares == () and plan.layout.failed == SHRUNK_NO_SPARE.failed
    # a spare the job still holds goes first; the pool's extra node stays a spare
    plan = grow_plan(STAGES, SHRUNK, (pool,))
    assert plan is not None and plan.layout.components == (("n5", "n2"), ("n6", "n7")) and plan.layout.spares == ("n8",)


def test_no_grow_before_the_pool_runs_at_full_size_or_when_no_unit_fits() -> None:
    pending = Pool(job_id="9", state="requested", name="p0")
    assert grow_plan(STAGES, SHRUNK_NO_SPARE, (pending,)) is None
    granted = Pool(job_id="9", state="granted", name="p0", nodes=("n7", "n8"))
    assert grow_plan(STAGES, FULL, (granted,)) is None
    one = Pool(job_id="9", state="granted", name="p0", nodes=("n7",))
    assert grow_plan(STAGES, SHRUNK_NO_SPARE, (one,)) is None       # a unit needs a node of each stage
    lost = Pool(job_id="9", state="granted", name="p0", nodes=("n7", "n1"))
    assert grow_plan(STAGES, SHRUNK_NO_SPARE, (lost,)) is None      # n1 failed before: never used again


def test_grow_back_by_the_units_that_fit_and_divide() -> None:
    stages = parse_stages("vision:3:1:0,text:3:1:0")
    layout = StepLayout((("a",), ("b",)), (), (), 1, {})
    pool = Pool(job_id="9", state="granted", name="p0", nodes=("c", "d", "e", "f"))
    plan = grow_plan(stages, layout, (pool,))
    assert plan is not None and plan.layout.units == 3
    plan = grow_plan(stages, layout, (pool,), units_divide=4)      # 3 does not divide the batch: 2
    assert plan is not None and plan.layout.units == 2 and plan.layout.spares == ("e", "f")


def test_the_successor_is_asked_once_ahead_of_the_limit_while_training_can_still_overlap() -> None:
    lead = successor_lead_s(600.0, 30.0)
    assert lead == 930.0
    end = NOW + 2000
    assert not successor_due(end, NOW, lead_s=lead, stop_before_s=60, asked=False)
    assert successor_due(end, end - 900, lead_s=lead, stop_before_s=60, asked=False)
    assert not successor_due(end, end - 900, lead_s=lead, stop_before_s=60, asked=True)
    assert not successor_due(end, end - 30, lead_s=lead, stop_before_s=60, asked=False)
    assert not successor_due(None, NOW, lead_s=lead, stop_before_s=60, asked=False)


def test_the_grow_back_waits_for_a_stepping_launch_and_warm_standbys() -> None:
    pool = Pool(job_id="9", state="granted", name="p0", nodes=("n7", "n8"))
    plan = grow_plan(STAGES, SHRUNK_NO_SPARE, (pool,))
    assert grow_now(stepped=True, stopping=False, warm=[True], plan=plan)
    assert not grow_now(stepped=False, stopping=False, warm=[True], plan=plan)      # still restoring
    assert not grow_now(stepped=True, stopping=True, warm=[True], plan=plan)        # already stopping
    assert not grow_now(stepped=True, stopping=False, warm=[True, False], plan=plan)
    assert not grow_now(stepped=True, stopping=False, warm=[], plan=None)
    kw = {"nodes": ("n7", "n8"), "seen_at": NOW, "bound_s": 60.0}
    assert pool_warm(standby=False, warm_nodes=(), now=NOW, **kw)                    # no standbys: at once
    assert not pool_warm(standby=True, warm_nodes=("n7",), now=NOW + 5, **kw)
    assert pool_warm(standby=True, warm_nodes=("n8", "n7"), now=NOW + 5, **kw)
    assert pool_warm(standby=True, warm_nodes=(), now=NOW + 60, **kw)                # not forever


def test_a_launch_across_allocations_ends_with_its_every_srun_or_with_the_first_failure() -> None:
    assert span_end([False, False]) == (False, None, False)
    assert span_end([0, False]) == (False, None, False)             # done here, the other still finishing
    assert span_end([0, 0]) == (True, 0, False)
    assert span_end([75, 0]) == (True, 75, False) and span_end([0, 75]) == (True, 75, False)
    assert span_end([False, 137]) == (True, 137, True)              # a failure ends it: kill the others
    assert span_end([137, 1]) == (True, 137, False)                 # every srun ended already
    assert span_end([None, None]) == (True, None, False)            # adopted and gone: from the heartbeats
    assert span_end([None, 75]) == (True, 75, False)


def test_the_successors_lead_uses_the_newest_relaunch_the_job_measured_within_half_the_allocation() -> None:
    day = 86400.0
    assert successor_lead_for(600.0, [], limit_s=day) == 0.0
    assert successor_lead_for(600.0, [(100.0, None)], limit_s=day) == 0.0
    assert successor_lead_for(600.0, [(100.0, 130.0), (500.0, 510.0), (900.0, None)], limit_s=day) == \
        successor_lead_s(600.0, 10.0)
    assert successor_lead_for(0.0, [(100.0, 130.0)], limit_s=day) == 0.0          # the site asks for none
    # a lead as long as the allocation itself: none (it would be asked at once, for every successor)
    assert successor_lead_for(3600.0, [(100.0, 130.0)], limit_s=600.0) == 0.0
    assert successor_lead_for(3600.0, [(100.0, 130.0)], limit_s=None) == 0.0
    assert successor_lead_for(40.0, [(100.0, 110.0)], limit_s=1000.0) == 70.0
    # never in the first half of the allocation's life (a slow relaunch on a busy machine)
    assert successor_lead_for(40.0, [(100.0, 110.0)], limit_s=120.0) == 60.0
    assert successor_lead_for(45.0, [(100.0, 143.0)], limit_s=180.0) == 90.0
