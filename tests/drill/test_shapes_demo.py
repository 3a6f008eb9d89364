"""``omni demo --job-file`` on the examples whose shapes the built-in demo does not have: one stage
named by the user (examples/gpt: a decoder-only LLM with randomly sampled batches) and three stages
of the user's naming (examples/speech-image-lm), and examples/own-script; each on the three recovery
paths (the demo site's default, allocation mode: an allocation with no batch script; in_allocation:
the supervisor in the batch script; resubmission), the node to set DOWN chosen by the demo (never a
spare), each ending with its compare line.

The default suite runs one of them: examples/gpt on the demo's default path, allocation mode (one
stage, the spare beside it, about 1.5 min). ``OMNI_SHAPES=1`` runs all nine (README.md, "Test lanes")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
LANE = os.environ.get("OMNI_SHAPES") == "1"
DEFAULT = ("gpt", "allocation")
STAGES = {"own-script": "vision | text stages", "gpt": "gpt stage", "speech-image-lm": "speech | image | lm stages"}


@pytest.mark.parametrize("recovery", ["resubmit", "in_allocation", "allocation"])
@pytest.mark.parametrize("example", list(STAGES))
def test_demo_of_an_example_recovers_and_compares(slurm_cluster, example: str, recovery: str) -> None:
    if (example, recovery) != DEFAULT and not LANE:
        pytest.skip("OMNI_SHAPES=1 runs every example on every recovery path")
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    slurm_cluster.cluster.up()      # re-renders plugstack.conf now that the plugin is built
    argv = [sys.executable, "-m", "slurm_omni.cli.main", "demo", "--state-dir", str(slurm_cluster.state_dir),
            "--job-file", str(REPO / "examples" / example / "job.toml"), "--recovery", recovery, "--timeout", "360"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=850, check=False,
                          env={**os.environ, **slurm_cluster.env})
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-2000:]
    submit = next(line for line in out.splitlines() if "/11 submit:" in line)
    assert f"({STAGES[example]}, 2 replicas" in submit
    assert ("one allocation of" in submit) == (recovery != "resubmit")
    assert ("no batch script" in submit) == (recovery == "allocation")
    drill = next(line for line in out.splitlines() if "/11 drill:" in line)
    # the timeline's path of a recovery inside the allocation, with a batch script or without
    assert f"path {'resubmitted' if recovery == 'resubmit' else 'in_allocation'}:" in drill, drill
    compare = next(line for line in out.splitlines() if "/11 compare:" in line)
    # a spare took the lost node's place, or the resubmission got as many: every step at the reference's size
    assert "compare: equivalent: contract bitwise" in compare and "loss bitwise over " in compare, compare
    report = next(line for line in out.splitlines() if "omni report: job " in line)
    assert f"({STAGES[example]})" in report, report
