"""examples/own-script as the tests run it: a copy of train.py and of job.toml with fewer steps (and
another name or node count), and the metrics of the reference run that never failed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own-script"
STEPS = 14
"""Checkpoints every 10 steps (train.py) and at the last: a fault past step 10 resumes from step 10."""


def own_job(folder: Path, *, name: str = "own-script", nodes: int = 1) -> Path:
    """``folder/job.toml`` (and ``folder/train.py``): the example with STEPS steps, named ``name``,
    ``nodes`` nodes per stage (2: one replica per node, so a lost node leaves the other replica)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(EXAMPLE / "train.py", folder / "train.py")
    text = (EXAMPLE / "job.toml").read_text()
    for old, new in ((r"max_steps = 80\b", f"max_steps = {STEPS}"), (r'name = "own-script"', f'name = "{name}"'),
                     (r"nodes = 1\b", f"nodes = {nodes}")):
        text, count = re.subn(old, new, text)
        assert count, f"{old} not in examples/own-script/job.toml"
    (folder / "job.toml").write_text(text)
    return folder / "job.toml"
