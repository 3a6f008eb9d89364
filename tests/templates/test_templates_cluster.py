"""On the embedded cluster: a rendered heterogeneous job runs both stages where it asked to run,
hostile #SBATCH values reach slurmctld unchanged, and ``omni submit`` registers what it submits."""

from __future__ import annotations

import json
import re
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from render_support import DATA, start_requeued_now
from support import wait_until

from slurm_omni.cli.submit import parse_sbatch_id, submit
from slurm_omni.config.job import JobFile, load_job
from slurm_omni.config.site import SiteConfig, load_site
from slurm_omni.render import DrillRequest, HetJobRequest
from slurm_omni.slurm.gres import parse_gres
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import Gres

pytestmark = pytest.mark.cluster

PROBE = ('printf "%s %s %s %s %s %s %s\\n" "$OMNI_STAGE_NAME" "$SLURMD_NODENAME" "$OMNI_STAGE_RANK" "$RANK" '
         '"$WORLD_SIZE" "$MASTER_ADDR" "${CUDA_VISIBLE_DEVICES:-none}" > "$0/rank-$RANK"')


def _site(tmp_path: Path, spool: Path) -> SiteConfig:
    site = load_site(DATA / "site.toml")
    manager = replace(site.manager, spool_dir=spool, registry_dir=tmp_path / "registry")
    return replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / "ckpt"), manager=manager)


def _job(tmp_path: Path, **job_changes: object) -> JobFile:
    (tmp_path / "logs").mkdir(exist_ok=True)        # sbatch does not create the --output folder
    job = load_job(DATA / "job.toml")
    return replace(job, job=replace(job.job, log_dir=tmp_path / "logs", **job_changes))


def _wait_gone(runner: CommandRunner, job_id: int, timeout_s: float = 90) -> None:
    wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(),
               timeout_s, f"job {job_id} to leave the queue", interval_s=1.0)


def _components(runner: CommandRunner, job_id: int) -> list[dict[str, str]]:
    out = runner.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


def test_het_job_runs_both_stages_on_matching_nodes(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    job = _job(tmp_path)
    job = replace(job, stages=[replace(s, nodes=2, tasks_per_node=1) for s in job.stages])
    request = HetJobRequest(job=job, site=_site(tmp_path, slurm_cluster.spool), job_file=tmp_path / "job.toml",
                            job_sha256="0" * 64, command=("bash", "-c", PROBE, str(out_dir)))
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    _wait_gone(runner, job_id)

    ranks = [line.split() for path in sorted(out_dir.iterdir()) for line in path.read_text().splitlines()]
    assert len(ranks) == 4, list((tmp_path / "logs").glob("*"))
    by_stage: dict[str, list[list[str]]] = {}
    for stage, node, stage_rank, rank, world, master, gpus in ranks:
        by_stage.setdefault(stage, []).append([node, stage_rank, rank])
        assert (world, master) == ("4", "127.0.0.1")
        assert gpus != "none"                                      # the gres plugin bound GPUs
    topology = slurm_cluster.backend().topology()
    nodes_by_name = {n.name: n for n in slurm_cluster.backend().nodes()}
    components = _components(runner, job_id)
    assert [c["Partition"] for c in components] == ["vision", "text"]
    for offset, stage in enumerate(("vision", "text")):
        nodes = sorted(n for n, _, _ in by_stage[stage])
        assert sorted(r for _, r, _ in by_stage[stage]) == ["0", "1"]
        assert len(set(nodes)) == 2                                 # --nodes=2 --ntasks-per-node=1
        assert len({topology.switch_path(n)[-1] for n in nodes}) == 1   # --switches=1: one leaf switch
        # scontrol writes TRES as gres:gpu:... on 22.05 and gres/gpu:... on 24.11 and 26.05
        assert parse_gres(components[offset]["TresPerNode"]) == (Gres("gpu", "h100", 4),)
        assert all(n.gres_count("gpu", "h100") >= 4 for n in nodes_by_name.values() if n.name in nodes)
    assert sorted(int(r) for _, _, r in by_stage["vision"]) == [0, 1]
    assert sorted(int(r) for _, _, r in by_stage["text"]) == [2, 3]
    log = next((tmp_path / "logs").glob(f"omni-tiny-{job_id}.out")).read_text()
    assert "step finished: training done" in log


def test_one_stage_job_runs_as_an_ordinary_job(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    """One stage of the user's name (most LLM jobs): an ordinary job whose step places every rank in
    that stage; it failed before with "couldn't expand SLURM_JOB_NODELIST_HET_GROUP_0=''"."""
    runner = CommandRunner(slurm_cluster.env)
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    job = _job(tmp_path)
    probe = ["bash", "-c", PROBE, str(out_dir)]
    job = replace(job, stages=[replace(job.stages[1], name="gpt", nodes=2, tasks_per_node=1,
                                       partition="text", gres="gpu:h100:4")],
                  training=replace(job.training, command=["/bin/true"]))    # one's own script: any stage names
    request = HetJobRequest(job=job, site=_site(tmp_path, slurm_cluster.spool), job_file=tmp_path / "job.toml",
                            job_sha256="0" * 64, command=tuple(probe))
    script = request.materialize()
    assert "#SBATCH hetjob" not in script and "--het-group" not in script
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=script).stdout)
    _wait_gone(runner, job_id)

    log = next((tmp_path / "logs").glob(f"omni-tiny-{job_id}.out")).read_text()
    ranks = sorted(line.split() for path in out_dir.iterdir() for line in path.read_text().splitlines())
    assert [(stage, stage_rank, rank, world) for stage, _, stage_rank, rank, world, _, _ in ranks] == [
        ("gpt", "0", "0", "2"), ("gpt", "1", "1", "2")], log
    assert len({node for _, node, *_ in ranks}) == 2
    assert "step finished: training done" in log


def test_hostile_output_path_reaches_slurm_unchanged(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    log_dir = tmp_path / "logs with space" / "it's \"quoted\" $(x) `y` #hash 100%"
    log_dir.mkdir(parents=True)
    job = _job(tmp_path)
    job = replace(job, job=replace(job.job, log_dir=log_dir))
    request = HetJobRequest(job=job, site=_site(tmp_path, slurm_cluster.spool), job_file=tmp_path / "j.toml",
                            job_sha256="0" * 64, command=("true",))
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    _wait_gone(runner, job_id)
    assert [p.name for p in log_dir.iterdir()] == [f"omni-tiny-{job_id}.out"]
    assert "training done" in (log_dir / f"omni-tiny-{job_id}.out").read_text()


def test_submit_registers_the_job(slurm_cluster, plugin_built, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    site = _site(tmp_path, slurm_cluster.spool)
    site_file = tmp_path / "omni.toml"
    site_file.write_text((DATA / "site.toml").read_text()
                         .replace("/shared/omni/checkpoints", str(tmp_path / "ckpt"))
                         .replace("/var/lib/slurm-omni/registry", str(site.manager.registry_dir)))
    job_file = tmp_path / "job.toml"
    job_file.write_text((DATA / "job.toml").read_text().replace("/shared/logs/omni-tiny", str(tmp_path / "logs")))
    result = CliRunner().invoke(submit, [str(job_file), "--site", str(site_file), "--hold"])
    assert result.exit_code == 0, result.output
    job_id = int(re.search(r"submitted job (\d+)", result.output)[1])   # type: ignore[index]
    CommandRunner(slurm_cluster.env).run(["scancel", str(job_id)], check=False)
    record_path = site.manager.registry_dir / f"{job_id}.json"
    assert stat.S_IMODE(record_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(record_path.parent.stat().st_mode) == 0o700
    record = json.loads(record_path.read_text())
    assert (record["job_id"], record["kind"], record["name"], record["job_file"]) == \
        (job_id, "het", "omni-tiny", str(job_file))
    assert [s["name"] for s in record["stages"]] == ["vision", "text"]
    assert Path(record["script"]).read_text().startswith("#!/bin/bash\n# Rendered by slurm-omni")


def test_drill_kills_the_target_rank(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    runner = CommandRunner(slurm_cluster.env)
    site = _site(tmp_path, slurm_cluster.spool)
    site = replace(site, drills=replace(site.drills, allowed_nodes="node[1-8]"))
    request = DrillRequest(job=_job(tmp_path), site=site, job_file=tmp_path / "j.toml", job_sha256="0" * 64,
                           rank=3, after_s=1, command=("sleep", "30"))
    started = time.time()
    leader = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    _wait_gone(runner, leader)
    log = (tmp_path / "logs" / f"omni-tiny-{leader}.out").read_text()
    assert "omni drill: rank 3 on node" in log and "step failed" in log
    faults = [json.loads(p.read_text()) for p in (slurm_cluster.spool / "root").glob(f"fault-{leader + 1}.*.json")]
    target = [f for f in faults if f["time_unix"] >= started - 1 and f["task_id"] == 1]
    assert target and target[0]["signal"] == 9 and target[0]["stage"] == "text"


def _submit_probe(slurm_cluster, tmp_path: Path, probe: str) -> tuple[CommandRunner, Path, int]:
    """Submits the tiny het job with ``bash -c PROBE RANKS_DIR`` as its step; returns the leader's id."""
    runner = CommandRunner(slurm_cluster.env)
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    request = HetJobRequest(job=_job(tmp_path), site=_site(tmp_path, slurm_cluster.spool),
                            job_file=tmp_path / "j.toml", job_sha256="0" * 64,
                            command=("bash", "-c", probe, str(out_dir)))
    leader = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    return runner, out_dir, leader


REQUEUE_PROBE = """
trap 'exit 75' USR1
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then echo "$OMNI_INCARNATION" > "$0/second-$RANK"; exit 0; fi
touch "$0/ready-$RANK"
sleep 60 & wait
"""


def test_usr1_checkpoints_requeues_and_finishes(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    """The batch shell forwards USR1 to the step, the step exits 'checkpointed', the script requeues
    the het job, and the next incarnation finishes."""
    runner, out_dir, leader = _submit_probe(slurm_cluster, tmp_path, REQUEUE_PROBE)
    wait_until(lambda: len(list(out_dir.glob("ready-*"))) == 4, 60, "all four ranks to start", interval_s=0.5)
    runner.run(["scancel", "--signal=USR1", "--batch", str(leader)])
    start_requeued_now(runner, leader, 1)
    _wait_gone(runner, leader, timeout_s=180)
    assert sorted(p.read_text() for p in out_dir.glob("second-*")) == ["1\n"] * 4
    log = (tmp_path / "logs" / f"omni-tiny-{leader}.out").read_text()
    assert "got SIGUSR1; forwarding it to the step" in log
    assert f"requeueing job {leader} (restart 1 of 3)" in log
    assert log.rstrip().endswith("omni: step finished: training done")


TERM_PROBE = """
trap 'exit 75' TERM USR1
touch "$0/ready-$RANK"
sleep 60 & wait
"""


def test_scancel_term_checkpoints_without_requeue(slurm_cluster, plugin_built, tmp_path: Path) -> None:
    """scancel's SIGTERM makes the ranks checkpoint and exit 75 as USR1 does, but only the requeue
    signal asks to run again: the cancelled job stays cancelled."""
    runner, out_dir, leader = _submit_probe(slurm_cluster, tmp_path, TERM_PROBE)
    log_path = tmp_path / "logs" / f"omni-tiny-{leader}.out"
    try:
        wait_until(lambda: len(list(out_dir.glob("ready-*"))) == 4, 60, "all four ranks to start", interval_s=0.5)
        runner.run(["scancel", str(leader)])
        wait_until(lambda: log_path.exists() and "not requeueing" in log_path.read_text(), 60,
                   "the batch script to decide", interval_s=0.5)

        def ended() -> dict[str, str] | None:
            leader_row = _components(runner, leader)[0]
            return leader_row if leader_row["JobState"] not in ("RUNNING", "COMPLETING") else None
        wait_until(ended, 60, f"job {leader} to end", interval_s=0.5)
        time.sleep(2)                               # a requeue would show by now
        row = _components(runner, leader)[0]
        assert (row["JobState"], row["Restarts"]) == ("CANCELLED", "0"), row
        log = log_path.read_text()
        assert "got SIGTERM; forwarding it to the step" in log
        assert "step checkpointed without SIGUSR1 to this shell; not requeueing" in log
        assert "requeueing job" not in log
    finally:
        runner.run(["scancel", str(leader)], check=False)


def test_a_command_that_is_not_there_stops_with_one_line_and_exit_78(slurm_cluster, plugin_built,
                                                                     tmp_path: Path) -> None:
    """Past omni submit's check (the program went missing after it): the batch script says which
    program on which node, runs no step and exits 78, so that neither it nor the manager restarts it."""
    runner = CommandRunner(slurm_cluster.env)
    job = _job(tmp_path, name="omni-missing")
    job = replace(job, training=replace(job.training, command=["/no/such/trainer", "--fast"]))
    request = HetJobRequest(job=job, site=_site(tmp_path, slurm_cluster.spool), job_file=tmp_path / "job.toml",
                            job_sha256="0" * 64)
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    _wait_gone(runner, job_id)
    out = (tmp_path / "logs" / f"omni-missing-{job_id}.out").read_text()
    assert "omni: job omni-missing: couldn't start the step: /no/such/trainer not found on " in out
    assert "srun" not in out and "requeue" not in out
    rows = _components(runner, job_id) if runner.run(["scontrol", "show", "job", str(job_id)],
                                                     check=False).returncode == 0 else []
    assert not rows or rows[0]["ExitCode"] == "78:0"


def test_a_workdir_gone_after_submit_stops_with_one_line_and_exit_78(slurm_cluster, plugin_built,
                                                                      tmp_path: Path) -> None:
    """[job] workdir was there at omni submit and is gone when the job starts: the batch script runs
    no step, says which folder on which node, leaves the line for the manager and exits 78."""
    runner = CommandRunner(slurm_cluster.env)
    gone = tmp_path / "run dir 'gone'"
    job = _job(tmp_path, name="omni-nowhere", workdir=gone)
    request = HetJobRequest(job=job, site=_site(tmp_path, slurm_cluster.spool), job_file=tmp_path / "job.toml",
                            job_sha256="0" * 64)
    job_id = parse_sbatch_id(runner.run(["sbatch", "--parsable"], input_text=request.materialize()).stdout)
    _wait_gone(runner, job_id)
    out = (tmp_path / "logs" / f"omni-nowhere-{job_id}.out").read_text()
    assert f"omni: job omni-nowhere: couldn't enter the working folder {gone} on " in out
    assert "(fix [job] workdir: a folder every node sees)" in out and "srun" not in out
    refusal = next((tmp_path / "ckpt").glob(f"*/omni-nowhere/heartbeat/refused-{job_id}-0.txt"))
    assert refusal.read_text().startswith(f"couldn't enter the working folder {gone} on ")
    rows = _components(runner, job_id) if runner.run(["scontrol", "show", "job", str(job_id)],
                                                     check=False).returncode == 0 else []
    assert not rows or rows[0]["ExitCode"] == "78:0"
