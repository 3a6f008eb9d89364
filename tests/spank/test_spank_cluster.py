"""The plugin loaded by the embedded cluster's plugstack.conf: options, task environment, and the
fault record of a task killed with SIGKILL."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.slurm.runner import CommandRunner

pytestmark = pytest.mark.cluster

HET_SCRIPT = """#!/bin/bash
#SBATCH --partition=vision --nodes=1 --ntasks-per-node=2 --gres=gpu:h100:2 --time=2
#SBATCH --output={out}/job.out
#SBATCH hetjob
#SBATCH --partition=text --nodes=1 --ntasks-per-node=2 --gres=gpu:h100:2
srun --het-group=0,1 --omni-stage=vision,text --omni-ckpt={out}/ckpt bash -c '
    env | grep -E "^(OMNI_[A-Z_]+|RANK|WORLD_SIZE|LOCAL_RANK)=" | sort > {out}/env-$SLURM_PROCID
    if [ "$SLURM_PROCID" = 3 ]; then
        # die only after the others have exited cleanly, so that they leave no records
        while [ "$(ls {out} | grep -c "^env-")" -lt 4 ]; do sleep 0.1; done
        sleep 1
        kill -KILL $$
    fi'
"""


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_srun_help_lists_the_options(slurm_cluster, plugin: Path) -> None:
    out = CommandRunner(slurm_cluster.env).run(["srun", "--help"]).stdout
    assert "--omni-stage=NAME[:N][,...]" in out
    assert "--omni-ckpt=PATH" in out


@pytest.mark.parametrize(("argv", "line"), [
    (["sbatch", "--omni-stage=bad name", "--wrap=true"],
     "sbatch: error: omni: --omni-stage: stage name 'bad name' is not allowed (letters, digits, '_', '-', '.')"),
    (["srun", "--omni-ckpt=relative", "true"],
     "srun: error: omni: --omni-ckpt=relative: not allowed (expected an absolute path)"),
    (["sbatch", "--omni-stage=vision:0", "--wrap=true"],
     "sbatch: error: omni: --omni-stage: stage 'vision': task count '0' is not allowed (expected 1..1000000)"),
])
def test_bad_values_refused_at_submit(slurm_cluster, plugin: Path, argv: list[str], line: str) -> None:
    r = CommandRunner(slurm_cluster.env).run(argv, check=False)
    assert r.returncode != 0
    # Slurm adds its own "Invalid --omni-... argument" line after ours.
    assert r.stderr.splitlines()[0] == line


def test_ordinary_step_splits_ranks_into_stages(slurm_cluster, plugin: Path, tmp_path: Path) -> None:
    r = CommandRunner(slurm_cluster.env).run(
        ["srun", "--ntasks=3", "--nodes=1", "--omni-stage=vision:1,text:2", "bash", "-c",
         'echo "$SLURM_PROCID $OMNI_STAGE_NAME $OMNI_STAGE $OMNI_STAGE_RANK $OMNI_STAGE_SIZE"'], timeout_s=60)
    assert sorted(r.stdout.splitlines()) == ["0 vision 0 0 1", "1 text 1 0 2", "2 text 1 1 2"]


def test_sigkilled_task_leaves_a_fault_record(slurm_cluster, plugin: Path, tmp_path: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    script = tmp_path / "het.sh"
    script.write_text(HET_SCRIPT.format(out=tmp_path))
    before = time.time()
    leader = int(runner.run(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0])
    spool = slurm_cluster.spool / "root"                        # the job owner's folder (root's here)

    def records(job_id: int) -> list[Path]:
        # job ids restart with a fresh cluster state: ignore records older than this test
        return [p for p in spool.glob(f"fault-{job_id}.*.json")
                if json.loads(p.read_text())["time_unix"] >= before - 1]

    def record() -> Path | None:
        return next(iter(records(leader + 1)), None)

    path = wait_until(record, 60, f"a fault record of job {leader + 1} in {spool}", interval_s=0.5)
    fault = json.loads(path.read_text())
    assert fault["kind"] == "task_exit" and fault["version"] == 1
    assert (fault["job_id"], fault["het_job_id"], fault["het_offset"]) == (leader + 1, leader, 1)
    assert (fault["stage"], fault["stage_index"], fault["stage_rank"], fault["task_id"]) == ("text", 1, 1, 1)
    assert (fault["signal"], fault["exit_code"], fault["core_dumped"]) == (9, None, False)
    assert fault["node"] in slurm_cluster.nodes and fault["pid"] > 0
    assert before - 1 <= fault["time_unix"] <= time.time() + 1
    assert not list(spool.glob(".*.tmp"))
    wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(leader)], check=False).stdout.strip(), 60,
               f"job {leader} to end", interval_s=1.0)

    envs = {int(p.name.split("-")[1]): _env_file(p) for p in tmp_path.glob("env-*")}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        stage_index = 0 if rank < 2 else 1
        assert env["OMNI_STAGE_NAME"] == ("vision", "text")[stage_index]
        assert (env["OMNI_STAGE"], env["OMNI_STAGE_RANK"], env["OMNI_STAGE_SIZE"], env["OMNI_DP_RANK"]) == \
            (str(stage_index), str(rank % 2), "2", str(rank % 2))
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "4")
        assert env["OMNI_CKPT_DIR"] == str(tmp_path / "ckpt")
    # Only abnormal exits leave records: the three clean tasks did not.
    assert records(leader) == []
    assert records(leader + 1) == [path]
