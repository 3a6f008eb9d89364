"""The public API alone, in one process: layout from each launcher's environment, the heartbeat the
manager reads, the step timer, the small-state codec, the checkpointer and the run's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from slurm_omni.elastic import statecodec
from slurm_omni.elastic.checkpointer import Checkpointer, CheckpointMismatch
from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED
from slurm_omni.elastic.heartbeat import Heartbeat
from slurm_omni.elastic.layout import Layout
from slurm_omni.elastic.timing import SCHEDSTAT, StepTimer
from slurm_omni.errors import RuntimeLayoutError
from slurm_omni.manager import events

OMNI_ENV = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "OMNI_STAGES": "vision,text", "OMNI_DP_SIZE": "2", "OMNI_STAGE": "1", "OMNI_INCARNATION": "5",
            "OMNI_JOB_NAME": "j", "OMNI_CKPT_DIR": "/c", "OMNI_HEARTBEAT_DIR": "/h", "OMNI_METRICS_DIR": "/m",
            "SLURM_JOB_ID": "42"}


def test_layout_under_the_batch_script_is_stage_major() -> None:
    l = Layout.from_env(("vision", "text"), OMNI_ENV)
    assert (l.stage_name, l.stage, l.data_parallel_rank, l.data_parallel_size) == ("text", 1, 1, 2)
    assert (l.incarnation, l.job_id, l.launcher, l.ckpt_dir) == (5, "42", "slurm-omni", Path("/c"))
    assert l.peer("vision") == 1 and l.last_stage and not l.first_stage and not l.colocated
    assert l.accumulation(8, 2) == 2


def test_layout_under_torchrun_runs_every_stage() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2"}
    l = Layout.from_env(("vision", "text"), env, run_dir="/r")
    assert (l.stage_name, l.data_parallel_size, l.data_parallel_rank, l.launcher) == ("vision+text", 2, 1, "torchrun")
    assert (l.incarnation, l.ckpt_dir, l.heartbeat_dir) == (2, Path("/r/ckpt"), Path("/r/heartbeat"))
    assert l.peer("text") == 1 and l.first_stage and l.last_stage


def test_layout_of_one_plain_process_needs_nothing() -> None:
    l = Layout.from_env(None, {})
    assert (l.rank, l.world_size, l.stage_name, l.master_addr) == (0, 1, "main", "127.0.0.1") and l.master_port > 0


@pytest.mark.parametrize("change,needle", [
    ({"OMNI_STAGES": "a,b"}, "make [[stages]] names"), ({"WORLD_SIZE": "3"}, "WORLD_SIZE=3"),
    ({"RANK": "x"}, "not an integer"), ({"OMNI_STAGE": "0"}, "stage-major")])
def test_bad_layout_is_one_line(change: dict[str, str], needle: str) -> None:
    with pytest.raises(RuntimeLayoutError, match=None) as e:
        Layout.from_env(("vision", "text"), {**OMNI_ENV, **change})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_heartbeat_with_script_metrics_is_what_the_manager_reads(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path, rank=1, stage=1, dp_rank=0, incarnation=2, job_id="42", interval_s=0.05)
    hb.start()
    hb.update(step=7, step_time_s=0.5, compute_s=0.25, data_s=0.01, phase="training",
              metrics={"loss": torch.tensor(2.5), "samples": 8, "nan": float("nan"), "flag": True})
    hb.stop("failed", error="elastic: something\nwent wrong")
    [rec] = events.read_heartbeats(tmp_path)
    assert (rec.step, rec.compute_s, rec.data_s, rec.phase, rec.incarnation) == (7, 0.25, 0.01, "failed", 2)
    assert rec.metrics == {"loss": 2.5, "samples": 8} and rec.error == "elastic: something went wrong"


def test_heartbeat_own_times_are_means_of_the_last_steps(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path, rank=0, stage=0, dp_rank=0, incarnation=0, job_id="42", window=2)
    for step, (compute, data) in enumerate([(0.9, 0.3), (0.2, 0.1), (0.4, 0.3)], start=1):
        hb.update(step=step, step_time_s=1.0, compute_s=compute, data_s=data)
    hb.stop("done")
    [rec] = events.read_heartbeats(tmp_path)
    assert (rec.compute_s, rec.data_s) == (pytest.approx(0.3), pytest.approx(0.2))   # the last two steps


def test_old_heartbeats_without_the_new_fields_still_parse(tmp_path: Path) -> None:
    beat = {"rank": 0, "stage": 0, "dp_rank": 0, "pid": 1, "incarnation": 0, "job_id": "1", "step": 1,
            "phase": "training", "time": 1.0, "step_time_s": 0.1, "last_checkpoint_step": None, "beats": 1}
    rec = events.parse_heartbeat(json.dumps(beat).encode())
    assert rec.compute_s is None and rec.metrics == {} and rec.error == ""
    with pytest.raises(events.EventRejected, match="compute_s"):
        events.parse_heartbeat(json.dumps({**beat, "compute_s": True}).encode())


def test_timer_counts_module_work_not_the_wait_between() -> None:
    now = [0.0]

    def clock() -> float:   # every reading costs 1 ms; only the "wait" below moves it by more
        now[0] += 0.001
        return now[0]

    timer = StepTimer(clock)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    timer.watch(model)
    timer.watch(model[0])            # nested: counted once
    x = torch.randn(32, 64)
    model(x).sum().backward()
    now[0] += 0.2                    # "waiting for a peer"
    with timer.data():
        now[0] += 0.01
    with timer.compute():
        pass
    compute_s, data_s = timer.take()
    assert 0 < compute_s < 0.02 and data_s == pytest.approx(0.011)
    assert timer.take() == (0.0, 0.0)


@pytest.mark.skipif(not Path(SCHEDSTAT).exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs /proc/thread-self/schedstat and CPU affinity")
def test_timer_tells_the_wait_for_a_cpu_from_the_work() -> None:
    """A busy loop on the same core: the region's wall time is its CPU time plus its wait for the
    CPU, and cpu_wait_s is that wait (the kernel's run-queue delay)."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    rival = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        os.sched_setaffinity(0, {cpu})
        time.sleep(0.3)
        timer = StepTimer()
        c0 = time.thread_time()
        with timer.compute():
            while time.thread_time() - c0 < 0.2:
                pass
        used = time.thread_time() - c0
        t = timer.take_times()
    finally:
        os.sched_setaffinity(0, before)
        rival.kill()
        rival.wait()
    assert t.cpu_wait_s > 0.05                        # the rival held the core about half the time
    assert 0.8 * used <= t.compute_s - t.cpu_wait_s <= 1.25 * used
    assert timer.take_times() == (0.0, 0.0, 0.0)


def test_small_state_round_trips_through_json() -> None:
    gen = torch.Generator().manual_seed(3)
    state = {"gen": gen.get_state(), "pos": (1, [2, 3]), 7: np.arange(3), "b": b"\x00\x01", "f": 1.5,
             "nested": {"__odd": None}}
    back = statecodec.decode(json.loads(json.dumps(statecodec.encode(state, "s"))))
    assert torch.equal(back["gen"], gen.get_state()) and back["pos"] == (1, [2, 3])
    assert back[7].tolist() == [0, 1, 2] and back["b"] == b"\x00\x01" and back["nested"] == {"__odd": None}


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _one(tmp_path: Path, script: str = "train.py", incarnation: int = 0) -> Layout:
    return Layout.from_env(None, {"OMNI_INCARNATION": str(incarnation)}, run_dir=tmp_path)


def test_checkpointer_restores_modules_optimizer_schedule_and_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = Counter()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    counter.n = 11
    ckpt = Checkpointer(_one(tmp_path), modules={"model": model}, optimizers={"adamw": opt},
                        state={"sched": sched, "counter": counter}, script="train.py", extra=lambda: {"k": 1})
    assert ckpt.restore() is None
    ckpt.save(1, sync=True)
    ckpt.close()
    model2 = nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    counter2 = Counter()
    ckpt2 = Checkpointer(_one(tmp_path, incarnation=1), modules={"model": model2}, optimizers={"adamw": opt2},
                         state={"sched": sched2, "counter": counter2}, script="train.py")
    resume = ckpt2.restore()
    assert resume is not None and resume.step == 1 and not resume.layout_changed and resume.extra == {"k": 1}
    assert torch.equal(model.weight, model2.weight) and counter2.n == 11
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    ckpt2.close()


def test_a_restore_parses_the_newest_manifest_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Is it sound, is it this script's, the restore itself: three reads of the newest manifest, one
    parse (format.read_manifest's memo; 2.5-4 ms each for 400 tensors)."""
    from slurm_omni.checkpoint import format as fmt

    ckpt = Checkpointer(_one(tmp_path), modules={"model": nn.Linear(4, 2)}, script="train.py")
    ckpt.save(1, sync=True)
    ckpt.close()
    parsed: list[str] = []
    real = fmt.Manifest.from_bytes

    def counted(raw: bytes, *, where: str) -> fmt.Manifest:
        parsed.append(where)
        return real(raw, where=where)

    monkeypatch.setattr(fmt.Manifest, "from_bytes", counted)
    ckpt2 = Checkpointer(_one(tmp_path, incarnation=1), modules={"model": nn.Linear(4, 2)}, script="train.py")
    resume = ckpt2.restore()
    ckpt2.close()
    assert resume is not None and resume.step == 1 and parsed == ["step-1"]


def test_checkpoint_of_another_script_or_model_is_refused(tmp_path: Path) -> None:
    ckpt = Checkpointer(_one(tmp_path), modules={"model": nn.Linear(4, 2)}, script="a.py")
    ckpt.save(1, sync=True)
    ckpt.close()
    for kwargs, needle in (({"modules": {"other": nn.Linear(4, 2)}, "script": "a.py"}, "holds model"),
                           ({"modules": {"model": nn.Linear(4, 2)}, "script": "b.py"}, "written by 'a.py'"),
                           ({"modules": {"model": nn.Linear(5, 2)}, "script": "a.py"}, "load_state_dict refused")):
        other = Checkpointer(_one(tmp_path, incarnation=1), **kwargs)  # type: ignore[arg-type]
        with pytest.raises(CheckpointMismatch) as e:
            other.restore()
        other.close()
        assert needle in str(e.value) and "own checkpoint folder" in str(e.value) and "\n" not in str(e.value)
        assert e.value.exit_code == EXIT_BAD_INPUT


SCRIPT = """
import os, signal, sys
from torch import nn
from slurm_omni import elastic
model = nn.Linear(2, 2)
with elastic.init(max_steps=int(sys.argv[1])) as run:
    run.checkpointer(modules={"model": model})
    start = run.restore()
    for step in range(start, int(sys.argv[2])):
        if step == 2 and os.environ.get("KILL_ME"):
            os.kill(os.getpid(), signal.SIGUSR1)
        run.end_step(step + 1, checkpoint_every=0, loss=0.5)
"""


def _script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "loop.py"
    path.write_text(textwrap.dedent(SCRIPT))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_", "RANK", "WORLD_SIZE"))}
    return subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def test_run_saves_and_exits_75_on_usr1_then_resumes_to_the_end(tmp_path: Path) -> None:
    first = _script(tmp_path, "5", "5", KILL_ME="1", OMNI_INCARNATION="0")
    assert first.returncode == EXIT_CHECKPOINTED, first.stderr[-2000:]
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert (beat["phase"], beat["step"], beat["last_checkpoint_step"]) == ("stopping", 3, 3)
    second = _script(tmp_path, "5", "5", OMNI_INCARNATION="1")
    assert second.returncode == 0, second.stderr[-2000:]
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert (beat["phase"], beat["step"], beat["last_checkpoint_step"], beat["incarnation"]) == ("done", 5, 5, 1)
    steps = [json.loads(l)["step"] for l in (tmp_path / "omni-run" / "metrics" / "metrics-main-0.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5]


def test_a_loop_that_ends_before_max_steps_is_bad_input(tmp_path: Path) -> None:
    proc = _script(tmp_path, "10", "4")
    assert proc.returncode == EXIT_BAD_INPUT
    assert "finished at step 4 before max_steps=10" in proc.stderr
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert beat["phase"] == "failed" and "max_steps=10" in beat["error"]


def test_a_checkpoint_the_script_cannot_load_is_bad_input(tmp_path: Path) -> None:
    assert _script(tmp_path, "3", "3").returncode == 0
    path = tmp_path / "loop.py"
    path.write_text(path.read_text().replace("nn.Linear(2, 2)", "nn.Linear(3, 2)"))
    proc = subprocess.run([sys.executable, str(path), "6", "6"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False, env={k: v for k, v in os.environ.items()
                                                         if not k.startswith(("OMNI_", "SLURM_"))})
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert beat["phase"] == "failed" and beat["exit_code"] == EXIT_BAD_INPUT
    assert "model.load_state_dict refused step-3" in beat["error"] and "own checkpoint folder" in beat["error"]


PIPELINE_SCRIPT = """
import sys, torch
from torch import nn
from torch.distributed.pipelining import ScheduleGPipe
from slurm_omni import elastic
with elastic.init(stages=("vision", "text"), max_steps=2) as run:   # one process: both stages here
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.zeros(2, 8)
    stage = elastic.TimedStage(module, 0, 1, run.device, input_args=(x,), output_args=(x,),
                               group=run.groups.pipeline, timer=run.timer)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.pow(2).mean())
    schedule.step(torch.randn(4, 8), target=torch.zeros(4, 8), losses=[])
    run.step_done(1, log_metrics=False, samples=4)        # heartbeat only
    run.log_metrics(1, lr=0.1, data_parallel_size=1)
    run.step_done(2, loss=0.5)
    print("saved: leaving", flush=False)                   # fast exit flushes it
    run.exit(elastic.EXIT_CHECKPOINTED, fast=True)
"""


def test_timed_stage_log_metrics_and_fast_exit(tmp_path: Path) -> None:
    """TimedStage's chunks are compute; log_metrics writes a line when asked, the life's startup times
    on its first line only, stage -1 on a rank running both stages; exit(fast=True) ends the process
    with the code after the last heartbeat, stdout flushed."""
    path = tmp_path / "pipe.py"
    path.write_text(textwrap.dedent(PIPELINE_SCRIPT))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_", "RANK", "WORLD_SIZE"))}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False, env={**clean, "OMNI_TASK_STARTED_AT": "1764460000.5"})
    assert proc.returncode == EXIT_CHECKPOINTED and "saved: leaving" in proc.stdout, proc.stderr[-2000:]
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert (beat["phase"], beat["step"], beat["exit_code"]) == ("stopping", 2, EXIT_CHECKPOINTED)
    first, second = [json.loads(line) for line in (tmp_path / "omni-run" / "metrics" /
                                                   "metrics-vision+text-0.jsonl").open()]
    assert (first["step"], first["lr"], first["stage"], second["step"], second["stage"]) == (1, 0.1, -1, 2, -1)
    assert first["compute_seconds"] > 0 and first["step_time_seconds"] >= first["compute_seconds"]
    assert first["task_started_at"] == 1764460000.5 and first["groups_ready_at"] > first["task_started_at"]
    assert not {"task_started_at", "groups_ready_at", "restored_at"} & set(second)
    assert second["loss"] == 0.5 and second["compute_seconds"] == 0.0
