"""A resubmission pinned to a replacement on another leaf switch starts at once on the embedded
cluster: its ``--switches`` is the count of leaves the plan spans, not the job file's ``1``, which
Slurm would honour by holding the job (Reason=Resources) for up to the switch wait."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
from pathlib import Path

import pytest
from manager_cluster_support import site_text
from omni_configs import job_toml
from support import wait_until

from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.formats.registry import RegisteredStage, RegistryRecord
from slurm_omni.manager.actions import Actions
from slurm_omni.manager.shape import Shape
from slurm_omni.policy.cluster_index import ClusterIndex
from slurm_omni.policy.placement import Action, plan_recovery
from slurm_omni.slurm.hostlist import expand

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

# the job file asks one leaf per stage and a long wait for it: what the resubmission must not inherit
JOB_KEYS = "[[stages]]\nname = \"vision\"\nnodes = 2\nswitches = 1\nswitch_wait = \"00:10:00\"\n" \
           "[[stages]]\nname = \"text\"\nnodes = 2\nswitches = 1\nswitch_wait = \"00:10:00\"\n"


def _components(env: dict[str, str], job_id: int) -> list[dict[str, str]]:
    """``scontrol show job -o`` of a het job: one field map per component, in het order."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    rows = [dict(w.split("=", 1) for w in line.split() if "=" in w) for line in out.splitlines() if line.strip()]
    return sorted(rows, key=lambda r: int(r.get("HetJobOffset", "0")))


def test_a_replacement_on_another_leaf_is_resubmitted_with_the_leaves_its_plan_spans(
        slurm_cluster, tmp_path: Path) -> None:
    backend = slurm_cluster.backend()

    def free_layout() -> tuple[list[str], list[str], str] | None:
        """Text on two free nodes of one leaf, vision on two more of one leaf (so its plan spans one),
        a free spare on another leaf than text's."""
        topology = backend.topology()
        index = ClusterIndex.build(topology, backend.nodes())
        idle = {n for n in index.nodes if index.is_free(n)}
        leaves = {name: sorted(n for n in sw.nodes if n in idle) for name, sw in topology.switches.items() if sw.nodes}
        for leaf, free in leaves.items():
            text = free[:2]
            for other, on in leaves.items():
                if other == leaf or not on or len(text) < 2:
                    continue
                spare = on[0]
                vision = next((pair for on_leaf in leaves.values()
                               if len(pair := [n for n in on_leaf if n not in text and n != spare][:2]) == 2), None)
                if vision is not None:
                    return vision, text, spare
        return None

    vision, text, spare = wait_until(free_layout, 60, "five free nodes on two leaf switches")
    (tmp_path / "site.toml").write_text(site_text(tmp_path, slurm_cluster.spool))
    site = load_site(tmp_path / "site.toml")
    job_file = tmp_path / "job.toml"
    job_file.write_text(job_toml("switches", data_parallel_size=2, time_limit="00:10:00").split("[[stages]]")[0]
                        + JOB_KEYS + '[training]\ncommand = ["/bin/sleep", "120"]\n[training.data]\n'
                        f'shard_dir = "{tmp_path}"\n')
    (tmp_path / "logs").mkdir()   # omni submit makes it; Slurm fails the launch without it
    stages = (RegisteredStage(0, "vision", "vision", 2, 1, "gpu:h100:4", 1),
              RegisteredStage(1, "text", "text", 2, 1, "gpu:h100:4", 1))
    reg = RegistryRecord(job_id=1, kind="het", name="switches", user="me", job_file=job_file,
                         job_sha256=hashlib.sha256(job_file.read_bytes()).hexdigest(),
                         ckpt_dir=tmp_path / "ckpt", data_parallel_size=2, max_requeues=0, stages=stages)
    shape = Shape(stages, 2)
    layout = shape.layout({0: vision, 1: text}, shape.units)
    # text[1] is lost; the site holds back one spare node, on the other leaf
    config = dataclasses.replace(shape.placement_config(site, load_job(job_file)), spare_nodes=(spare,))
    index = ClusterIndex.build(backend.topology(), backend.nodes())
    plan = plan_recovery(index, layout, [text[1]], now=0.0, fault_at=0.0, config=config)
    assert plan.action is Action.RESUBMIT and plan.nodelist(1) == (text[0], spare), plan
    assert plan.components[1].leaf_switches == 2
    job_id = Actions(backend, site, tmp_path / "state").resubmit(reg, shape, plan, shape.units, "omni.switches.1", 1)
    try:
        vision_row, text_row = _components(slurm_cluster.env, job_id)
        assert text_row["Switches"].startswith("2@") and vision_row["Switches"].startswith("1@"), (vision_row, text_row)

        def running() -> list[dict[str, str]] | None:
            rows = _components(slurm_cluster.env, job_id)
            return rows if all(r["JobState"] == "RUNNING" for r in rows) else None
        rows = wait_until(running, 60, f"job {job_id} to start (a switch wait shows PENDING, Reason=Resources)")
        assert [r["Reason"] for r in rows] == ["None", "None"], rows
        assert sorted(expand(rows[1]["NodeList"])) == sorted([text[0], spare])
    finally:
        subprocess.run(["scancel", str(job_id)], env=slurm_cluster.env, timeout=30, check=False)
