"""The heartbeat poll reads what changed (issue 19): per-rank and per-node files, a cache keyed by
inode, size and times, and beats that arrive late, twice or out of order (fake clock: the beats'
own times; no wall clock is asserted)."""

from __future__ import annotations

import os
import random
from pathlib import Path

from slurm_omni.formats import encode
from slurm_omni.formats.heartbeat import HeartbeatRecord, NodeHeader, node_file_name
from slurm_omni.fsio import write_atomic
from slurm_omni.manager.events import HeartbeatScanner, merge_beats, read_heartbeats
from slurm_omni.policy.confirm import ConfirmConfig, Confirmer, Verdict


def beat(rank: int, t: float, *, step: int = 5, incarnation: int = 0, node: str = "", beats: int = 1,
         phase: str = "training") -> HeartbeatRecord:
    return HeartbeatRecord(rank=rank, stage=0, dp_rank=rank, pid=100 + rank, incarnation=incarnation, job_id="42",
                           step=step, phase=phase, time=t, node=node, beats=beats)  # type: ignore[arg-type]


def write_node(folder: Path, node: str, records: list[HeartbeatRecord], t: float) -> None:
    data = b"".join([encode(NodeHeader(node=node, time=t)), *(encode(r) for r in records)])
    write_atomic(folder / node_file_name(node), data, durable=False)


def test_node_and_rank_files_merge_to_the_newest_beat_per_rank(tmp_path: Path) -> None:
    write_node(tmp_path, "n1", [beat(0, 10.0, node="n1"), beat(1, 10.5, node="n1")], 11.0)
    write_node(tmp_path, "n2", [beat(2, 10.2, node="n2"), beat(3, 9.0, node="n2")], 11.0)
    # rank 1's own file is older than its node's copy; rank 3's (its last beat) is newer
    write_atomic(tmp_path / "rank-1.json", encode(beat(1, 8.0)), durable=False)
    write_atomic(tmp_path / "rank-3.json", encode(beat(3, 12.0, phase="done")), durable=False)
    got = {hb.rank: (hb.time, hb.phase) for hb in read_heartbeats(tmp_path)}
    assert got == {0: (10.0, "training"), 1: (10.5, "training"), 2: (10.2, "training"), 3: (12.0, "done")}


def test_a_bad_beat_in_a_node_file_hides_only_itself(tmp_path: Path) -> None:
    good, dup = encode(beat(0, 10.0)), encode(beat(2, 10.0)).replace(b'"rank":2', b'"rank":2,"rank":3')
    bad = b'{"rank": 1, "phase": "sleeping"}\n'
    (tmp_path / "node-n1.jsonl").write_bytes(b'{"node": "n1", "time": 11.0}\n' + good + bad + dup)
    assert [hb.rank for hb in read_heartbeats(tmp_path)] == [0]


def test_a_malformed_node_file_is_set_aside(tmp_path: Path) -> None:
    (tmp_path / "node-n1.jsonl").write_text('{"node": "n1"}\n' + encode(beat(0, 3.0)).decode())   # no time
    write_atomic(tmp_path / "rank-2.json", encode(beat(2, 3.0)), durable=False)
    assert [hb.rank for hb in read_heartbeats(tmp_path)] == [2]
    assert (tmp_path / "rejected" / "node-n1.jsonl").exists()


def test_the_scanner_opens_only_files_that_changed(tmp_path: Path) -> None:
    for n in range(8):
        write_node(tmp_path, f"n{n}", [beat(4 * n + k, 1.0, node=f"n{n}") for k in range(4)], 1.0)
    scanner = HeartbeatScanner()
    assert len(scanner.scan(tmp_path)) == 32
    assert scanner.stats == {"listdir": 1, "stat": 8, "open": 8}
    assert len(scanner.scan(tmp_path)) == 32
    assert scanner.stats == {"listdir": 1, "stat": 8, "open": 0}
    write_node(tmp_path, "n3", [beat(12 + k, 2.0, node="n3", step=6) for k in range(4)], 2.0)
    beats = scanner.scan(tmp_path)
    assert scanner.stats["open"] == 1
    assert {hb.rank: hb.step for hb in beats if hb.node == "n3"} == {12: 6, 13: 6, 14: 6, 15: 6}
    # a node file rewritten with one rank's line changed: the others are the records decoded before
    before = {hb.rank: hb for hb in beats}
    write_node(tmp_path, "n3", [before[12], before[13], beat(14, 3.0, node="n3", step=7), before[15]], 3.0)
    after = {hb.rank: hb for hb in scanner.scan(tmp_path)}
    assert after[14].step == 7 and after[13] is before[13] and after[12] is before[12]
    os.unlink(tmp_path / node_file_name("n0"))   # a removed file's beats go with it
    assert sorted(hb.rank for hb in scanner.scan(tmp_path)) == list(range(4, 32))


def test_the_scanner_reads_an_unchanged_file_again_after_refresh_polls(tmp_path: Path) -> None:
    write_atomic(tmp_path / "rank-0.json", encode(beat(0, 1.0)), durable=False)
    scanner = HeartbeatScanner(refresh_polls=3)
    opens = []
    for _ in range(7):
        scanner.scan(tmp_path)
        opens.append(scanner.stats["open"])
    assert opens == [1, 0, 0, 1, 0, 0, 1]


def test_thousands_of_late_and_out_of_order_beats_keep_the_newest(tmp_path: Path) -> None:
    """2,048 ranks x 5 beats each, delivered in a random order through node files rewritten in any
    order (and a life's late beats after the next life's): the merge and the confirmer end where
    the in-order delivery ends."""
    rng = random.Random(19)
    ranks = 2048   # 4 per node, 512 nodes
    beats = [beat(r, 100.0 + k + r * 1e-4, step=10 + k, node=f"n{r // 4}", beats=k + 1)
             for r in range(ranks) for k in range(5)]
    late_old_life = [beat(r, 200.0, step=99, incarnation=0, node=f"n{r // 4}") for r in range(0, ranks, 7)]
    next_life = [beat(r, 150.0, step=3, incarnation=1, node=f"n{r // 4}") for r in range(0, ranks, 7)]
    delivered = beats + next_life + late_old_life
    rng.shuffle(delivered)
    newest = merge_beats(delivered)
    assert len(newest) == ranks
    for hb in newest:
        if hb.rank % 7 == 0:
            assert (hb.incarnation, hb.step) == (1, 3)
        else:
            assert (hb.incarnation, hb.step, hb.beats) == (0, 14, 5)

    # the same beats through node files, each node rewritten with a random subset in a random order
    scanner = HeartbeatScanner()
    seen: dict[int, HeartbeatRecord] = {}
    for chunk in range(0, len(beats), 1024):
        part = beats[chunk:chunk + 1024]
        by_node: dict[str, list[HeartbeatRecord]] = {}
        for hb in part:
            by_node.setdefault(hb.node, []).append(hb)
        for node, records in by_node.items():
            old = [seen[hb.rank] for hb in records if hb.rank in seen]
            write_node(tmp_path, node, merge_beats(old + records), 1.0 + chunk)
        for hb in scanner.scan(tmp_path):
            seen[hb.rank] = hb
    assert {hb.rank: hb.step for hb in seen.values()} == {r: 14 for r in range(ranks)}

    # the confirmer, fed in a random order, ends where the in-order feed ends
    in_order, shuffled = Confirmer(ConfirmConfig(), {}), Confirmer(ConfirmConfig(), {})
    life0 = list(beats)
    for hb in sorted(life0, key=lambda hb: hb.time):
        in_order.observe(hb.observation(het_job=False))
    mixed = life0[:]
    rng.shuffle(mixed)
    for hb in mixed:
        shuffled.observe(hb.observation(het_job=False))
    fresh = in_order.evaluate(104.5), shuffled.evaluate(104.5)
    assert [d.verdict for d in fresh] == [Verdict.NONE, Verdict.NONE]
    gone = in_order.evaluate(400.0), shuffled.evaluate(400.0)
    assert gone[0].verdict is not Verdict.NONE
    assert [(d.verdict, d.cause, len(d.ranks)) for d in gone] == [(gone[0].verdict, gone[0].cause, ranks)] * 2


def test_scan_fresh_gives_only_the_beats_that_changed_and_newest_keeps_every_rank(tmp_path: Path) -> None:
    """The supervisor feeds its rule only what changed since its last poll (issue 19: 2,048 ranks);
    every rank's newest beat stays at hand for what needs them all."""
    scanner = HeartbeatScanner()
    write_node(tmp_path, "n1", [beat(0, 10.0, node="n1"), beat(1, 10.0, node="n1")], 10.1)
    write_node(tmp_path, "n2", [beat(2, 10.0, node="n2")], 10.1)
    assert sorted(hb.rank for hb in scanner.scan_fresh(tmp_path)) == [0, 1, 2]
    assert scanner.scan_fresh(tmp_path) == []   # nothing changed
    # n1 republished: rank 1 beat again, rank 0's line is the same bytes
    write_node(tmp_path, "n1", [beat(0, 10.0, node="n1"), beat(1, 11.0, node="n1", beats=2)], 11.1)
    write_atomic(tmp_path / "rank-3.json", encode(beat(3, 11.0)), durable=False)
    assert sorted((hb.rank, hb.time) for hb in scanner.scan_fresh(tmp_path)) == [(1, 11.0), (3, 11.0)]
    assert [(hb.rank, hb.time) for hb in scanner.newest()] == [(0, 10.0), (1, 11.0), (2, 10.0), (3, 11.0)]
