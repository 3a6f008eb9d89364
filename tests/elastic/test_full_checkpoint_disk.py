"""A full checkpoint file system, for real: a 2 MiB tmpfs mounted (in a private mount namespace:
``unshare -m``, as root) on the checkpoint root only, filled by a file after the first checkpoint.

Two ranks (gloo) with StatefulDataLoader workers must each stop with one line and exit 78 (no restart
helps until space is freed), workers included: before the fix both ranks logged the error three
times and never exited (multiprocessing's exit hook joined the workers, which ignored its SIGTERM;
rank 0's commit waited for rank 1's shard). The newest complete checkpoint stays intact: once the
file is gone the next life resumes from it and finishes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_omni.elastic.codes import EXIT_BAD_INPUT

SCRIPT = """
import os
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from slurm_omni import elastic

torch.manual_seed(0)
model = nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
data = torch.utils.data.TensorDataset(torch.randn(4096, 64))
loader = StatefulDataLoader(data, batch_size=8, shuffle=True, num_workers=2)
with elastic.init(max_steps=8) as run:
    run.checkpointer(modules={"model": model}, optimizers={"adamw": opt}, state={"loader": loader})
    start = run.restore()
    print(f"rank {run.layout.rank} starts at step {start}", flush=True)
    batches = iter(loader)
    for step in range(start, run.max_steps):
        with run.timer.data():
            (x,) = next(batches)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 3 and os.environ.get("FILL"):
            run.checkpoints.wait()              # step 2 is durable on this rank
            if run.layout.rank == 0:            # then the disk fills up
                with open(os.environ["FILL"], "wb") as f:
                    try:
                        while True:
                            f.write(bytes(65536))
                    except OSError:
                        pass
        run.end_step(step + 1, checkpoint_every=2, loss=0.5)
"""

LAUNCH = """
set -u
mount -t tmpfs -o size=2m,mode=0700 tmpfs "$FS" || exit 97
life() {
  for r in 0 1; do
    RANK=$r "$PY" train.py > "out-$1-$r.txt" 2>&1 &
    eval "pid$r=\\$!"
  done
  wait "$pid0"; echo $? > "rc-$1-0"
  wait "$pid1"; echo $? > "rc-$1-1"
}
FILL="$FS/filler" life 0
rm -f "$FS/filler"
OMNI_INCARNATION=1 life 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a tmpfs: root and unshare")
@pytest.mark.timeout(400)
def test_a_full_checkpoint_file_system_stops_every_rank_with_one_line_and_keeps_the_newest_checkpoint(
        tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "launch.sh").write_text(textwrap.dedent(LAUNCH))
    fs = tmp_path / "fs"
    fs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "SLURM_", "TORCHELASTIC_"))}
    env.update(PY=sys.executable, FS=str(fs), OMNI_CKPT_DIR=str(fs / "ckpt"), OMNI_INCARNATION="0",
               WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               OMNI_HEARTBEAT_INTERVAL="0.5")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", str(tmp_path / "launch.sh")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360, check=False)
    if proc.returncode == 97:
        pytest.skip(f"couldn't mount a tmpfs: {proc.stderr.strip()}")

    def out(life: int, rank: int) -> str:
        return (tmp_path / f"out-{life}-{rank}.txt").read_text()

    codes = [int((tmp_path / f"rc-0-{r}").read_text()) for r in range(2)]
    logs = "\n".join(out(0, r) for r in range(2))
    assert codes == [EXIT_BAD_INPUT] * 2, logs[-3000:]
    # each rank stops with one line: its own save's error, or, when another rank's failure was agreed
    # on first (run.should_stop, before this rank's own save failed), the line naming that rank's
    saying = 0
    for r in range(2):
        text = out(0, r)
        lines = [l for l in text.splitlines() if "couldn't persist" in l or "couldn't commit" in l]
        if not lines:
            assert "another rank's checkpoint save failed" in text, text[-3000:]
            continue
        assert len(lines) == 1 and "No space left on device" in lines[0], text[-3000:]
        assert "step-2, the newest complete checkpoint, is intact" in lines[0]
        saying += 1
    assert saying >= 1, logs[-3000:]
    # the next life, once space is freed: resumes from step 2 (checksums verified) and finishes
    codes = [int((tmp_path / f"rc-1-{r}").read_text()) for r in range(2)]
    assert codes == [0, 0], "\n".join(out(1, r) for r in range(2))[-3000:]
    assert all(f"rank {r} starts at step 2" in out(1, r) for r in range(2))
    beat = json.loads((tmp_path / "omni-run" / "heartbeat" / "rank-0.json").read_text())
    assert (beat["phase"], beat["step"], beat["incarnation"]) == ("done", 8, 1)
