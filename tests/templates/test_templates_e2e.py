"""End to end on the embedded cluster: ``omni submit`` of a tiny job file trains both stages with
the real ``omni train`` (plugin environment, heartbeats, checkpoints) and finishes 'done'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from omni_configs import job_toml, site_toml
from render_support import REPO
from support import wait_until

from slurm_omni.cli.submit import submit
from slurm_omni.manager.events import read_heartbeats
from slurm_omni.ownership import current_user
from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = job_toml("e2e-tiny", job_keys="signal_before_s = 60\n", training="""\
[training]
max_steps = 4
[training.parallel]
global_batch_size = 4
micro_batch_size = 2
[training.data]
shard_dir = "shards"
[training.checkpoint]
every_steps = 2
""")


def test_submit_trains_both_stages_to_done(slurm_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    bin_dir = Path(sys.executable).parent
    subprocess.run([str(bin_dir / "omni"), "data", "synth", "--out", str(tmp_path / "shards"), "--pairs", "32",
                    "--text", "16"], check=True, capture_output=True, timeout=300)
    (tmp_path / "site.toml").write_text(site_toml(tmp_path, spool_dir=slurm_cluster.spool))
    (tmp_path / "job.toml").write_text(JOB)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")     # the job finds `omni` through it
    result = CliRunner().invoke(submit, [str(tmp_path / "job.toml"), "--site", str(tmp_path / "site.toml")])
    assert result.exit_code == 0, result.output
    job_id = json.loads(next((tmp_path / "registry").glob("*.json")).read_text())["job_id"]
    runner = CommandRunner(slurm_cluster.env)
    wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(), 240,
               f"job {job_id} to finish", interval_s=2.0)
    log = (tmp_path / "logs" / f"e2e-tiny-{job_id}.out").read_text()
    assert log.rstrip().endswith("omni: step finished: training done"), log[-2000:]
    ckpt = tmp_path / "ckpt" / current_user() / "e2e-tiny"
    assert {p.name for p in ckpt.glob("step-*")} == {"step-2", "step-4"}
    # the one reader (a rank's own file or its node's, per node by default): both ranks' last beats
    assert sorted((b.rank, b.phase) for b in read_heartbeats(ckpt / "heartbeat")) == [(0, "done"), (1, "done")]
    assert {p.name for p in (tmp_path / "metrics" / "e2e-tiny").glob("*.prom")} == \
        {"omni-vision-0.prom", "omni-text-0.prom"}
