"""Metrics lines per node (issue 19, elastic/node_metrics.py): the node's leader copies its ranks'
lines into ``node-<NODE>.jsonl``; no line is lost or read twice across leader changes, a leader killed
mid-copy, a rank's end and a relaunch; the readers (formats.metrics.read_folder, elastic read_jsonl,
omni report, the drill's history) read the new layout and the old."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_omni.elastic import node_metrics
from slurm_omni.elastic.heartbeat import NodeRelay
from slurm_omni.elastic.metrics import MetricsLog, read_jsonl
from slurm_omni.elastic.node_metrics import COPIED, NodeLines, read_copied
from slurm_omni.formats.metrics import read_folder
from slurm_omni.ownership import OwnDir, ensure_dir


def _dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    shm, hb, metrics = tmp_path / "shm", tmp_path / "hb", tmp_path / "metrics"
    for d in (shm, hb):
        d.mkdir(mode=0o700)
    return shm, hb, metrics


def _relay(shm: Path, hb: Path, rank: int) -> NodeRelay:
    return NodeRelay(shm, shared_dir=hb, job_id="7", node="n1", rank=rank, interval_s=1.0)


def _log(metrics: Path, relay: NodeRelay | None, rank: int, *, incarnation: int = 0) -> MetricsLog:
    return MetricsLog(metrics, stage_name="text", stage=0, rank=rank, dp_rank=rank, dp_size=2,
                      incarnation=incarnation, job_id="7", relay=relay)


def _steps(metrics: Path, dp: int) -> list[tuple[int, int]]:
    return [(int(r["incarnation"]), int(r["step"])) for r in read_jsonl(metrics / f"metrics-text-{dp}.jsonl")]  # type: ignore[call-overload]


def test_lines_go_to_the_node_file_and_each_rank_ends_with_nothing_lost(tmp_path: Path) -> None:
    shm, hb, metrics = _dirs(tmp_path)
    relays = [_relay(shm, hb, r) for r in range(2)]
    logs = [_log(metrics, relays[r], r) for r in range(2)]
    for step in range(1, 6):
        for log in logs:
            log.log_step({"step": step, "loss": 1.0})
    relays[0].lead(1.0)                     # rank 0 takes the lead and copies both ranks' lines
    relays[1].lead(1.0)                     # rank 1 cannot: the lock is held
    assert relays[0].leader and not relays[1].leader
    node_file = metrics / "node-n1.jsonl"
    assert len(node_file.read_text().splitlines()) == 10
    assert (metrics / "metrics-text-0.jsonl").read_text() == ""   # nothing per rank in steady state
    for step in range(6, 8):
        for log in logs:
            log.log_step({"step": step, "loss": 1.0})
    logs[1].close()                         # not the leader: its two uncopied lines to its own file
    assert len((metrics / "metrics-text-1.jsonl").read_text().splitlines()) == 2
    relays[0].lead(2.0)
    logs[0].close()
    assert _steps(metrics, 0) == [(0, s) for s in range(1, 8)]
    assert _steps(metrics, 1) == [(0, s) for s in range(1, 8)]
    for r in relays:
        r.beat(b"", 3.0, last=True)
    assert not any(shm.iterdir())           # the node's last rank leaves no folder


def test_a_leader_change_and_a_leader_killed_between_its_append_and_its_offsets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm, hb, metrics = _dirs(tmp_path)
    relays = [_relay(shm, hb, r) for r in range(2)]
    logs = [_log(metrics, relays[r], r) for r in range(2)]
    logs[0].log_step({"step": 1})
    logs[1].log_step({"step": 1})
    relays[0].lead(1.0)
    logs[1].log_step({"step": 2})
    real = node_metrics.write_atomic

    def killed(path: Path, data: bytes, **kw: object) -> None:
        if path.name == COPIED:
            raise OSError("killed before it recorded the offsets")
        real(path, data, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(node_metrics, "write_atomic", killed)
    relays[0].lead(2.0)                     # appended rank 1's step 2, offsets not recorded
    monkeypatch.undo()
    relays[0].close()                       # the leader's process ends: the lock is free
    relays[1].lead(3.0)                     # the next leader copies step 2 again
    assert relays[1].leader
    raw = (metrics / "node-n1.jsonl").read_text().splitlines()
    assert len(raw) == 4                    # step 2 of rank 1 twice in the file...
    assert _steps(metrics, 1) == [(0, 1), (0, 2)]    # ...and once for every reader
    assert read_copied(relays[1].folder.fd)[node_metrics.source_name(1, os.getpid())][1] > 0


def test_a_torn_line_of_a_leader_killed_mid_write_is_skipped_and_copied_again(tmp_path: Path) -> None:
    shm, hb, metrics = _dirs(tmp_path)
    relay = _relay(shm, hb, 0)
    log = _log(metrics, relay, 0)
    log.log_step({"step": 1})
    relay.lead(1.0)
    with (metrics / "node-n1.jsonl").open("a") as f:   # the half a killed leader wrote of the next line
        f.write('{"file": "metrics-text-0.jsonl", "incarnation": 0, "ra')
    log.log_step({"step": 2})
    relay.lead(2.0)
    lines = (metrics / "node-n1.jsonl").read_text().splitlines()
    assert len(lines) == 3 and lines[1].endswith('"ra')    # the torn part stands on its own line
    assert _steps(metrics, 0) == [(0, 1), (0, 2)]


def test_a_killed_rank_s_lines_wait_for_the_next_leader_of_a_relaunch(tmp_path: Path) -> None:
    """Every rank of the node killed (the step cancelled): the lines not copied stay on the node; the
    next life's leader copies them, and removes the dead rank's file once it copied all of it."""
    shm, hb, metrics = _dirs(tmp_path)
    relay = _relay(shm, hb, 0)
    folder = ensure_dir(relay.folder_path, what="node", private=True)
    dead = NodeLines(folder, metrics=ensure_dir(metrics, what="metrics", mode=0o755), node_file="node-n1.jsonl", rank=0)
    dead_name = "lines-0-999999999-0.jsonl"     # a pid no process has
    os.rename(dead.name, dead_name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
    for step in (1, 2, 3):
        os.write(dead._fd, json.dumps({"file": "metrics-text-0.jsonl", "time": 100.0 + step, "rank": 0,
                                       "incarnation": 0, "step": step}).encode() + b"\n")
    os.utime(dead_name, (1.0, 1.0), dir_fd=folder.fd)   # written long ago
    new = _log(metrics, relay, 0, incarnation=1)
    new.log_step({"step": 3})
    relay.lead(1.0)
    assert _steps(metrics, 0) == [(0, 1), (0, 2), (0, 3), (1, 3)]
    assert dead_name not in os.listdir(folder.fd)
    new.close()


def test_no_node_folder_every_line_to_the_rank_s_own_file(tmp_path: Path) -> None:
    _, _, metrics = _dirs(tmp_path)
    log = _log(metrics, None, 0)
    log.log_step({"step": 1})
    log.close()
    assert not list(metrics.glob("node-*"))
    assert [json.loads(line)["step"] for line in (metrics / "metrics-text-0.jsonl").read_text().splitlines()] == [1]


def test_read_folder_old_layout_kept_as_is_and_both_layouts_merged(tmp_path: Path) -> None:
    old = ['{"time": 2.0, "rank": 0, "step": 2}', '{"time": 1.0, "rank": 0, "step": 1}']
    (tmp_path / "metrics-text-0.jsonl").write_text("\n".join(old) + "\n")
    assert [t for _, t in read_folder(tmp_path)["metrics-text-0.jsonl"]] == old   # no node file: untouched
    own = '{"file": "metrics-text-1.jsonl", "incarnation": 1, "time": 5.0, "rank": 1, "step": 5}'
    (tmp_path / "metrics-text-1.jsonl").write_text(own + "\n")
    copied = ['{"file": "metrics-text-1.jsonl", "incarnation": 0, "time": 3.0, "rank": 1, "step": 3}', own,
              '{"file": "metrics-text-1.jsonl", "incarn', '{"file": "/etc/passwd", "time": 1, "rank": 0, "step": 0}']
    (tmp_path / "node-n2.jsonl").write_text("\n".join(copied) + "\n")
    got = read_folder(tmp_path)
    assert [json.loads(t)["step"] for _, t in got["metrics-text-1.jsonl"]] == [3, 5]
    assert got["metrics-text-1.jsonl"][0][0] == f"{tmp_path / 'node-n2.jsonl'} line 1"
    assert set(got) == {"metrics-text-0.jsonl", "metrics-text-1.jsonl"}


def test_the_node_folder_checked_a_planted_source_is_never_copied(tmp_path: Path) -> None:
    shm, hb, metrics = _dirs(tmp_path)
    relay = _relay(shm, hb, 0)
    secret = tmp_path / "secret"
    secret.write_text('{"file": "metrics-text-0.jsonl", "time": 1, "rank": 0, "step": 99}\n')
    os.symlink(secret, relay.folder_path / "lines-1-1-0.jsonl")
    log = _log(metrics, relay, 0)
    log.log_step({"step": 1})
    relay.lead(1.0)
    assert _steps(metrics, 0) == [(0, 1)]
    log.close()
    assert isinstance(relay.folder, OwnDir)


def test_omni_report_and_the_drill_read_a_run_of_node_files(tmp_path: Path) -> None:
    """A run whose lines went per node: the report and the drill's history read every step once, the
    last lines of an ended rank from its own file included."""
    from slurm_omni.drill.history import load_history
    from slurm_omni.report.inputs import load_metrics

    shm, hb, metrics = _dirs(tmp_path)
    relays = [_relay(shm, hb, r) for r in range(2)]
    logs = [_log(metrics, relays[r], r) for r in range(2)]
    for step in range(1, 5):
        for log in logs:
            log.log_step({"step": step, "loss": 2.0 / step})
        if step == 2:
            relays[0].lead(1.0)
    for log in reversed(logs):
        log.close()
    assert (metrics / "node-n1.jsonl").exists()
    records = load_metrics([metrics])
    assert sorted((r.rank, r.step) for r in records) == [(r, s) for r in (0, 1) for s in range(1, 5)]
    assert {r.stage_name for r in records} == {"text"}
    assert [r.step for r in load_history(metrics, ("text",)).records] == [1, 2, 3, 4]


def test_a_rank_whose_file_was_taken_for_a_dead_one_s_opens_a_new_one(tmp_path: Path) -> None:
    """A leader that cannot see a rank's process (another pid namespace) may remove its file once
    all of it is copied: the rank's next line goes to a new file, nothing is lost."""
    shm, hb, metrics = _dirs(tmp_path)
    relay = _relay(shm, hb, 0)
    log = _log(metrics, relay, 0)
    log.log_step({"step": 1})
    relay.lead(1.0)
    os.unlink(relay.folder_path / node_metrics.source_name(0, os.getpid()))
    log.log_step({"step": 2})
    relay.lead(2.0)
    log.close()
    assert _steps(metrics, 0) == [(0, 1), (0, 2)]


def test_the_loss_rank_writes_every_step_itself_and_a_lost_node_costs_only_other_ranks_lines(
        tmp_path: Path) -> None:
    """The loss-reporting rank (replica 0 of the last stage) keeps no file on the node: each of its
    lines goes straight to its own file, and as the node's leader it copies the other ranks' lines.
    The node lost mid-interval (its memory gone, nobody closed): the drill's history still has every
    step of the loss; the other rank lost only what no leader had copied yet."""
    import shutil

    from slurm_omni.drill.history import load_history

    shm, hb, metrics = _dirs(tmp_path)
    relays = [_relay(shm, hb, r) for r in range(2)]
    loss = MetricsLog(metrics, stage_name="text", stage=1, rank=0, dp_rank=0, dp_size=1, incarnation=0,
                      job_id="7", relay=relays[0], direct=True)
    other = MetricsLog(metrics, stage_name="vision", stage=0, rank=1, dp_rank=0, dp_size=1, incarnation=0,
                       job_id="7", relay=relays[1])
    assert sorted(p.name for p in relays[0].folder_path.glob("lines-*.jsonl")) == \
        [node_metrics.source_name(1, os.getpid())]          # the other rank's only
    for step in range(1, 4):
        loss.log_step({"step": step, "loss": 1.0 / step})
        other.log_step({"step": step})
        assert len((metrics / "metrics-text-0.jsonl").read_text().splitlines()) == step   # at once
    relays[0].lead(1.0)                                      # the loss rank leads: copies the other's 3 lines
    assert relays[0].leader
    assert [json.loads(x)["file"] for x in (metrics / "node-n1.jsonl").read_text().splitlines()] == \
        ["metrics-vision-0.jsonl"] * 3
    for step in range(4, 6):                                 # the node is lost before the next copy
        loss.log_step({"step": step, "loss": 1.0 / step})
        other.log_step({"step": step})
    shutil.rmtree(shm)
    assert [r.step for r in load_history(metrics, ("vision", "text")).records] == [1, 2, 3, 4, 5]
    assert [int(json.loads(t)["step"]) for _, t in read_folder(metrics)["metrics-vision-0.jsonl"]] == [1, 2, 3]


def test_layout_reports_loss_is_replica_0_of_the_last_stage() -> None:
    from slurm_omni.elastic.layout import Layout

    def layout(names: tuple[str, ...], stages: tuple[int, ...], dp: int, rank: int) -> Layout:
        return Layout(rank=rank, world_size=dp * (len(names) // len(stages)), local_rank=0, stage_names=names,
                      stages=stages, data_parallel_size=dp, data_parallel_rank=rank % dp, incarnation=0,
                      job_id="7", job_name="t", master_addr="127.0.0.1", master_port=1,
                      ckpt_dir=Path("c"), heartbeat_dir=Path("h"), metrics_dir=Path("m"))

    three = ("a", "b", "c")
    assert [layout(three, (s,), 2, s * 2 + d).reports_loss for s in range(3) for d in range(2)] == \
        [False, False, False, False, True, False]
    assert [layout(three, (0, 1, 2), 2, d).reports_loss for d in range(2)] == [True, False]   # colocated
    assert [layout(("only",), (0,), 3, d).reports_loss for d in range(3)] == [True, False, False]


@pytest.mark.parametrize(("value", "on"), [(None, True), ("", True), ("1", True), ("on", True), ("TRUE", True),
                                           ("0", False), ("off", False), ("No", False)])
def test_lines_per_node_are_the_default(value: str | None, on: bool) -> None:
    """On by default: the loss-reporting rank writes its own lines (a lost node costs only other
    ranks' lines of at most one interval); ``0`` turns it off (formats.metrics.per_node_setting)."""
    from slurm_omni.formats.metrics import per_node_setting

    assert per_node_setting({} if value is None else {"OMNI_METRICS_PER_NODE": value}) is on


def test_a_bad_per_node_setting_is_one_line_naming_what_is_allowed() -> None:
    from slurm_omni.errors import RuntimeLayoutError
    from slurm_omni.formats.metrics import per_node_setting

    with pytest.raises(RuntimeLayoutError, match=r"OMNI_METRICS_PER_NODE='maybe': allowed are 1, on, true, yes") as e:
        per_node_setting({"OMNI_METRICS_PER_NODE": "maybe"})
    assert "\n" not in str(e.value)
