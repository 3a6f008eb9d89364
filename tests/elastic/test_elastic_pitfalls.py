"""What a user's first script meets (issue 21), each in one plain process: a loader without
``state_dict()`` refused when handed over (exit 78, one line), a run whose data position nothing
saves says so, a script that draws its next batch before ``end_step`` resumes on the very batch it
would have trained on, a resume says where it came from, a disabled GradScaler's empty state, and a
flat script (no ``with``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_omni.elastic.codes import EXIT_BAD_INPUT


def _run(tmp_path: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_", "TORCHELASTIC_"))
             and k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env={**clean, **env},
                          capture_output=True, text=True, timeout=120, check=False)


def _beat(tmp_path: Path) -> dict[str, object]:
    return dict(json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text()))


PLAIN_LOADER = """
import torch
from torch import nn
from slurm_omni import elastic
loader = torch.utils.data.DataLoader(range(64), batch_size=4, shuffle=True, num_workers=2)
with elastic.init(max_steps=4) as run:
    run.checkpointer(modules={"model": nn.Linear(2, 2)}, state={"loader": loader})
    raise RuntimeError("never here")
"""


def test_a_loader_without_state_dict_is_refused_when_handed_over(tmp_path: Path) -> None:
    proc = _run(tmp_path, PLAIN_LOADER)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    [line] = [l for l in proc.stderr.splitlines() if "couldn't take" in l]
    assert "state['loader']" in line and "torch.utils.data.dataloader.DataLoader has no state_dict()" in line
    assert "StatefulDataLoader" in line and "never here" not in proc.stderr
    beat = _beat(tmp_path)
    assert beat["exit_code"] == EXIT_BAD_INPUT and beat["phase"] == "failed" and "couldn't take" in str(beat["error"])


PREFETCH = """
import sys
import torch
from torch import nn
from slurm_omni import elastic
torch.manual_seed(0)
model = nn.Linear(2, 2)
with elastic.init(max_steps=int(sys.argv[1])) as run:
    run.checkpointer(modules={"model": model})
    start = run.restore()

    def draw():                                  # random sampling from the process's torch stream
        with run.timer.data():
            return int(torch.randint(0, 10**9, (1,)))

    x = draw()                                   # the first batch, before the loop
    for step in range(start, run.max_steps):
        batch = x
        torch.rand(3)                            # the forward's dropout
        x = draw()                               # the next step's batch, before end_step (prefetch)
        print(f"step {step + 1} batch {batch}", flush=True)
        run.end_step(step + 1, checkpoint_every=2)
"""


def _batches(out: str) -> dict[int, int]:
    return {int(m[1]): int(m[2]) for m in re.finditer(r"step (\d+) batch (\d+)", out)}


def test_a_script_that_draws_ahead_resumes_on_its_own_next_batch(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    straight = _run(a, PREFETCH, "7")
    assert straight.returncode == 0, straight.stderr[-2000:]
    want = _batches(straight.stdout)
    assert sorted(want) == list(range(1, 8)) and len(set(want.values())) == 7
    assert "draws 1 batch(es) ahead of its steps" in straight.stderr
    assert "saves the data position" not in straight.stderr         # the random streams carry it
    first = _run(b, PREFETCH, "5", OMNI_INCARNATION="0")             # saves at steps 2, 4 and 5
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _run(b, PREFETCH, "7", OMNI_INCARNATION="1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _batches(first.stdout) == {s: want[s] for s in range(1, 6)}
    assert _batches(resumed.stdout) == {6: want[6], 7: want[7]}       # before the fix: 6 got step 7's batch
    [line] = [l for l in resumed.stderr.splitlines() if "resumed from step" in l]
    assert "resumed from step 5 (" in line and "step-5" in line and "incarnation 1" in line


NO_DATA = """
from torch import nn
from slurm_omni import elastic
with elastic.init(max_steps=3) as run:
    run.checkpointer(modules={"model": nn.Linear(2, 2)})
    for step in range(run.restore(), run.max_steps):
        run.end_step(step + 1)
"""


def test_a_run_whose_data_position_nothing_saves_says_so_once(tmp_path: Path) -> None:
    proc = _run(tmp_path, NO_DATA)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("nothing handed to the checkpointer saves the data position") == 1


SCALER = """
import sys
import torch
from torch import nn
from slurm_omni import elastic
model = nn.Linear(2, 2)
scaler = torch.amp.GradScaler("cpu", enabled=sys.argv[1] == "on")
with elastic.init(max_steps=int(sys.argv[2])) as run:
    run.checkpointer(modules={"model": model}, state={"scaler": scaler})
    for step in range(run.restore(), run.max_steps):
        run.end_step(step + 1)
"""


def test_a_disabled_grad_scalers_empty_state_resumes_into_an_enabled_one(tmp_path: Path) -> None:
    assert _run(tmp_path, SCALER, "off", "2", OMNI_INCARNATION="0").returncode == 0
    proc = _run(tmp_path, SCALER, "on", "4", OMNI_INCARNATION="1")
    assert proc.returncode == 0, proc.stderr[-2000:]      # torch's load_state_dict refuses {} when enabled


FLAT = """
import sys
import torch
from torch import nn
from slurm_omni import elastic
run = elastic.init(max_steps=4)
run.checkpointer(modules={"model": nn.Linear(2, 2)})
for step in range(run.restore(), int(sys.argv[1])):
    loss = torch.tensor(0.5)
    run.end_step(step + 1, loss=loss)          # a tensor: read when written
if sys.argv[2] == "close":
    run.close()
"""


@pytest.mark.parametrize("end", ["close", "exit-hook"])
def test_a_flat_script_ends_the_run_without_re_indenting(tmp_path: Path, end: str) -> None:
    proc = _run(tmp_path, FLAT, "4", end)
    assert proc.returncode == 0, proc.stderr[-2000:]
    beat = _beat(tmp_path)
    assert (beat["phase"], beat["step"], beat["exit_code"]) == ("done", 4, 0)
    lines = [json.loads(l) for l in (tmp_path / "omni-run" / "metrics" / "metrics-main-0.jsonl").open()]
    assert [l["loss"] for l in lines] == [0.5] * 4


def test_a_flat_script_short_of_max_steps_is_bad_input(tmp_path: Path) -> None:
    proc = _run(tmp_path, FLAT, "2", "exit-hook")
    assert proc.returncode == EXIT_BAD_INPUT and "finished at step 2 before max_steps=4" in proc.stderr
