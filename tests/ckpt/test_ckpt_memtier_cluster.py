"""On the embedded cluster: an in-allocation job with the memory tier; one rank crashes (its task
SIGKILLed), the supervisor relaunches the step in the same job, every rank restores from its node's
memory (its first metrics line says so: ``restore_source``), the loss equals a run that never failed, and nothing of the job is left in
/dev/shm once it ended (its standbys freed it). Several minutes on 2 shared cores (a 40-step job with a
relaunch, and the reference run beside it): behind ``OMNI_MEMTIER_CLUSTER=1``."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.memtier import DEFAULT_DIR, job_dir
from slurm_omni.config.site import load_site
from slurm_omni.drill import story
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.ownership import current_user
from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(os.environ.get("OMNI_MEMTIER_CLUSTER") != "1",
                                 reason="OMNI_MEMTIER_CLUSTER=1 runs the memory tier on the cluster (minutes)")]

NAME = "omni-memtier"


def _a_rank_task(job_id: int) -> int | None:
    """The pid of a standby client that runs a rank of the job (its task: killing it kills the rank)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            # the client (through the warm standby), or the trainer it became (no standby yet: it execs it)
            rank = cmdline[1:2] == [b"-S"] and cmdline[2].endswith(b"client.py") or \
                cmdline[1:3] == [b"-m", b"slurm_omni.cli.main"]
            if not rank or b"train" not in cmdline:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == str(job_id).encode() and b"SLURM_STEP_ID" in env:
            found.append(int(entry))
    return max(found) if found else None


def _logs(work: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in [*work.rglob("*.log"), *work.rglob("*.out")])


def test_a_crashed_rank_restores_every_rank_from_its_nodes_memory(slurm_cluster, tmp_path: Path) -> None:
    files = story.DemoFiles(tmp_path / "demo")
    story.write_files(files, slurm_cluster.cluster)
    site = files.site.read_text()
    for key, value in {"use_spank_plugin = true": "use_spank_plugin = false",
                       "default_spares = 1": "default_spares = 0",    # the demo site's stages share one partition
                       "[elasticity]\n": '[elasticity]\nrecovery = "in_allocation"\n'}.items():
        assert key in site
        site = site.replace(key, value)
    files.site.write_text(site)
    job = files.job.read_text()
    for key, value in {'name = "omni-demo"': f'name = "{NAME}"', "max_steps = 80": "max_steps = 40",
                       "every_steps = 10": "every_steps = 5\nmemory_tier = true"}.items():
        assert key in job
        job = job.replace(key, value)
    files.job.write_text(job)
    story.synthesize(files)
    env = story.job_environment(slurm_cluster.cluster)
    ckpt = tmp_path / "demo" / "ckpt" / current_user() / NAME
    runner = CommandRunner(slurm_cluster.env)
    job_id = 0
    try:
        job_id = story.submit(files, env)
        wait_until(lambda: any(e.step >= 5 for e in fmt.complete(ckpt)), 300, "a checkpoint at step 5")
        assert list(job_dir(DEFAULT_DIR, str(job_id)).glob("step-*.rank-*.h5")), \
            f"nothing kept in memory: {[line for line in _logs(files.work).splitlines() if 'memory' in line][:5]}"
        pid = wait_until(lambda: _a_rank_task(job_id), 60, "a rank's task")
        os.kill(pid, signal.SIGKILL)
        reference = start_reference(files.job, files.reference)
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False)
                   .stdout.strip(), 400, "the job to finish")
        ref_metrics = finish_reference(reference, files.reference, 300)
    finally:
        if job_id:
            runner.run(["scancel", str(job_id)], check=False)
    metrics = load_site(files.site).manager.metrics_for(current_user()) / NAME
    firsts = {}   # each rank's first line of each life: where it restored from
    for path in metrics.glob("metrics-*.jsonl"):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            firsts.setdefault((doc["incarnation"], doc["rank"]), doc)
    relaunched = {rank: doc.get("restore_source") for (life, rank), doc in firsts.items() if life > 0}
    assert sorted(relaunched) == [0, 1, 2, 3], firsts.keys()
    assert set(relaunched.values()) == {"memory"}, relaunched
    eq = story.compare(files, metrics, ref_metrics)
    assert eq.ok, eq.problems
    assert eq.loss.mode == "bitwise" and eq.loss.steps_compared == 40
    deadline = time.monotonic() + 30
    while job_dir(DEFAULT_DIR, str(job_id)).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not job_dir(DEFAULT_DIR, str(job_id)).exists(), "the job's memory tier outlived it"
