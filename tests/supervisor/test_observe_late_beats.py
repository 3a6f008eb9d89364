"""The step supervisor's launch observer over 2,048 ranks' beats that arrive through node files and
rank files late, out of order, twice, and from the life before (issue 19). Fake clock: the beats'
own times and the ``now`` given to the confirmer; nothing waits."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord, NodeHeader, node_file_name
from slurm_omni.fsio import write_atomic
from slurm_omni.policy.confirm import NodeObservation, Verdict
from slurm_omni.policy.in_allocation import StepLayout
from slurm_omni.slurm.types import NodeState
from slurm_omni.supervisor.journal import Launch
from slurm_omni.supervisor.observe import BeatReader, LaunchObserver, Scan

NODES, PER_NODE, LIFE = 512, 4, 3


def beat(rank: int, t: float, step: int, life: int = LIFE) -> HeartbeatRecord:
    return HeartbeatRecord(rank=rank, stage=0, dp_rank=rank, pid=1000 + rank, incarnation=life, job_id="42",
                           step=step, phase="training", time=t, node=f"n{rank // PER_NODE}", beats=1)


def publish(folder: Path, node: int, beats: list[HeartbeatRecord]) -> None:
    name = f"n{node}"
    write_atomic(folder / node_file_name(name),
                 b"".join([encode(NodeHeader(node=name, time=max(b.time for b in beats))), *map(encode, beats)]),
                 durable=False)


def test_late_and_out_of_order_beats_neither_hide_the_first_step_nor_make_a_rank_stale(tmp_path: Path) -> None:
    rng = random.Random(7)
    layout = StepLayout((tuple(f"n{i}" for i in range(NODES)),), (), (), 1, {})
    launch = Launch(number=1, layout=layout, data_parallel_size=NODES * PER_NODE, port=0, incarnation=LIFE,
                    started_at=100.0)
    obs = LaunchObserver(launch, job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0)
    ranks = range(NODES * PER_NODE)
    # the life before left per-rank files, and a few of its ranks still write late, ahead in step and time
    for r in ranks:
        write_atomic(tmp_path / f"rank-{r}.json", encode(beat(r, 99.0, 40, life=LIFE - 1)), durable=False)
    # round 0: every node's ranks restored step 10, their nodes published in a random order
    by_round: list[dict[int, list[HeartbeatRecord]]] = []
    for k in range(4):   # round k: step 10 + k, each rank at its own moment of the second
        by_round.append({n: [beat(r, 100.0 + k + rng.random() / 2, 10 + k) for r in range(n * PER_NODE,
                                                                                           (n + 1) * PER_NODE)]
                         for n in range(NODES)})
    order = list(range(NODES))
    rng.shuffle(order)
    for n in order:
        publish(tmp_path, n, by_round[0][n])
    assert obs.beats() is None   # everyone at the restored step: no new step yet
    # round 1 reaches half the nodes; the other half lag a round; zombies of the old life write late
    ahead = set(order[: NODES // 2])
    for n in ahead:
        publish(tmp_path, n, by_round[1][n])
    for r in rng.sample(list(ranks), 200):
        write_atomic(tmp_path / f"rank-{r}.json", encode(beat(r, 101.9, 41, life=LIFE - 1)), durable=False)
    first = obs.beats()
    expected = min((b for n in ahead for b in by_round[1][n]), key=lambda b: b.time)
    assert first == (expected.time, 11)
    launch.first_step_at = first[0]
    # rounds 2 and 3 arrive out of order: some nodes' round 3 before their round 2, some round 2
    # after round 3 (a late rewrite with older beats), the rest in order
    for i, n in enumerate(order):
        sequence = [2, 3] if n % 3 else [3, 2]
        for k in sequence:
            publish(tmp_path, n, by_round[k][n])
            if i % 64 == 0:
                obs.beats()   # a poll between the two copies of a node now and then
        if i % 64 == 63:
            obs.beats()
    decision = obs.confirmer.evaluate(104.0)
    assert decision.verdict is Verdict.NONE and decision.ranks == ()
    # the folder holds round 2 where a late copy rewrote round 3 with it, round 3 elsewhere; the
    # life before never shows (its rank files are newer in time, not in life)
    held = {b.rank: b for b in obs.heartbeats()}
    assert set(held) == set(ranks) and {b.incarnation for b in held.values()} == {LIFE}
    assert {r: b.step for r, b in held.items()} == {
        r: 12 if (r // PER_NODE) % 3 == 0 else 13 for r in ranks}
    # and when the beats stop, every rank goes stale: the rule still confirms
    assert obs.confirmer.evaluate(400.0).verdict is not Verdict.NONE


def test_the_sites_confirmation_window_sets_the_supervisors_hang_timeout(tmp_path: Path) -> None:
    """A rank that stops beating with no level-1 signal is a hang once the window has passed: the
    site's ``confirmation_window_s`` (``omni supervise --confirmation-window``), as for the manager."""
    layout = StepLayout((("n0", "n1"),), (), (), 1, {})
    launch = Launch(number=0, layout=layout, data_parallel_size=2 * PER_NODE, port=0, incarnation=LIFE,
                    started_at=100.0)
    verdicts = {}
    for window in (12.0, 30.0):
        obs = LaunchObserver(launch, job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0,
                             confirmation_window_s=window)
        for t in range(50):   # every rank beats and steps every 0.1 s, then none beats again
            for r in range(2 * PER_NODE):
                obs.confirmer.observe(beat(r, 100.0 + t / 10, 10 + t).observation())
        verdicts[window] = obs.confirmer.evaluate(105.0 + 20.0)
    assert verdicts[12.0].verdict is Verdict.CONFIRMED and verdicts[12.0].cause == "hang"
    assert verdicts[30.0].verdict is not Verdict.CONFIRMED


def test_a_scan_stuck_beside_the_loop_holds_up_neither_srun_and_slurm_nor_makes_a_rank_stale(tmp_path: Path) -> None:
    """The beats are read by a ``BeatReader`` beside the loop: while its scan is stuck in the kernel
    (512 emulated nodes: 17.41 s with no CPU) srun's report and Slurm's answer still confirm a node
    loss, the ranks' silence is judged only as of the last scan that ended, and the scans come back."""
    layout = StepLayout((("n0", "n1"),), (), (), 1, {})
    launch = Launch(number=0, layout=layout, data_parallel_size=2 * PER_NODE, port=0, incarnation=LIFE,
                    started_at=100.0)
    obs = LaunchObserver(launch, job_id="42", heartbeat_dir=tmp_path, heartbeat_interval_s=1.0)
    for n in range(2):
        publish(tmp_path, n, [beat(r, 100.0, 10) for r in range(n * PER_NODE, (n + 1) * PER_NODE)])
    now = [100.5]
    reader = BeatReader(obs, 0.01, lambda: now[0])
    try:
        first = _wait_scans(reader)
        assert first and first[0].fresh and obs.take(first[0]) is None
        stuck, release = threading.Event(), threading.Event()
        scan_fresh = obs.scanner.scan_fresh

        def stuck_scan(folder: Path) -> list[HeartbeatRecord]:
            stuck.set()
            release.wait(10)
            return scan_fresh(folder)

        obs.scanner.scan_fresh = stuck_scan   # type: ignore[method-assign]
        for s in _wait_scans(reader, until=stuck.wait):
            obs.take(s)
        now[0] = 120.0   # 20 s on, no scan ended: no rank is stale, nothing is a hang
        assert obs.confirmer.evaluate(now[0]).verdict is Verdict.NONE
        obs.confirmer.observe(NodeObservation(120.1, "n1", NodeState.DOWN, "srun: node failure", source="srun"))
        obs.confirmer.observe(NodeObservation(120.2, "n1", NodeState.DOWN, "Not responding"))
        d = obs.confirmer.evaluate(120.3)
        assert d.verdict is Verdict.CONFIRMED and d.nodes == ("n1",)
        release.set()
        assert _wait_scans(reader)   # the stuck scan ends and the reader goes on
    finally:
        reader.close()


def _wait_scans(reader: BeatReader, until: Callable[[float], bool] | None = None) -> list[Scan]:
    """The scans that ended: once ``until`` holds (then whatever came), else the first to come."""
    if until is not None:
        assert until(10)
        return reader.scans()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = reader.scans()
        if got:
            return got
        time.sleep(0.01)
    return []
