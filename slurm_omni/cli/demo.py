"""``omni demo``: the main job on the embedded cluster.

Today: a two-component heterogeneous job, vision stage on one leaf switch and text stage on another,
printing where each component ran.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import click

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.cluster.spec import DEFAULT_STATE_DIR
from slurm_omni.errors import OmniError
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.types import JobState

HET_SAMPLE = """#!/bin/bash
#SBATCH --job-name=omni-demo-het
#SBATCH --output={output}
#SBATCH --partition=vision --nodes=1 --ntasks-per-node=2 --gres=gpu:h100:2 --nodelist={vision}
#SBATCH hetjob
#SBATCH --partition=text --nodes=2 --ntasks-per-node=1 --gres=gpu:h100:4 --nodelist={text}
# Slurm 22.05 names no component per task in a het step: tasks of component 0 come first.
srun --het-group=0,1 bash -c 'c=$(( SLURM_PROCID < SLURM_NTASKS_HET_GROUP_0 ? 0 : 1 )); \
echo "task=$SLURM_PROCID component=$c node=$SLURMD_NODENAME switch=$SLURM_TOPOLOGY_ADDR \
gpus=$CUDA_VISIBLE_DEVICES"' | sort
"""


@click.command()
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              default=lambda: os.environ.get("OMNI_CLUSTER_DIR", str(DEFAULT_STATE_DIR)))
@click.option("--timeout", "timeout_s", type=float, default=120.0, show_default=True)
def demo(state_dir: Path, timeout_s: float) -> None:
    """Run a heterogeneous job across two leaf switches and show where each component ran."""
    lc = LocalCluster(state_dir)
    lc.up()
    backend = CliBackend(env=lc.env)
    topo = backend.topology(refresh=True)
    healthy = {n.name for n in backend.nodes() if n.state.usable}
    leaves = [sorted(set(s.nodes) & healthy) for s in topo.switches.values() if s.nodes]
    leaves = [nodes for nodes in leaves if nodes]
    if len(leaves) < 2 or len(leaves[1]) < 2:
        raise OmniError("demo: couldn't find two leaf switches with healthy nodes (omni cluster status)")
    vision, text = leaves[0][:1], leaves[1][:2]
    work = lc.paths.root.parent / "demo"
    work.mkdir(parents=True, exist_ok=True)
    output = work / "het-sample.out"
    output.unlink(missing_ok=True)
    script = work / "het-sample.sbatch"
    script.write_text(HET_SAMPLE.format(output=shlex.quote(str(output)), vision=compress(vision),
                                        text=compress(text)))
    click.echo(f"submitting a heterogeneous job: vision on {compress(vision)} "
               f"({topo.switch_path(vision[0])[-1]}), text on {compress(text)} ({topo.switch_path(text[0])[-1]})")
    job_id = backend.submit(str(script))
    deadline = time.monotonic() + timeout_s
    seen: JobState | None = None
    while time.monotonic() < deadline:
        job = next((j for j in backend.jobs() if j.job_id == job_id), None)
        state = job.state if job else JobState.COMPLETED
        if state != seen:
            where = ", ".join(f"component {c.het_offset}: {compress(c.nodes) or '-'}"
                              for c in (job.components if job else ()))
            click.echo(f"  job {job_id}: {state.value} {where}")
            seen = state
        if state.finished:
            break
        time.sleep(0.5)
    else:
        backend.cancel(str(job_id))
        raise OmniError(f"demo: couldn't finish job {job_id} within {timeout_s:.0f}s (squeue; {output})")
    if seen is not JobState.COMPLETED or not output.exists():
        raise OmniError(f"demo: job {job_id} ended {seen.value if seen else '?'} (see {output})")
    click.echo("where each task ran:")
    for line in output.read_text().splitlines():
        click.echo(f"  {line}")
