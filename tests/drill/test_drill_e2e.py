"""One drill end to end on the embedded cluster: real training submitted with ``omni submit``, the
manager running, a node set DOWN mid-run; the manager confirms and recovers, the drill returns the
node to service, and the finished run equals a reference that never failed (bitwise, same ids)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from slurm_omni.config.site import load_site
from slurm_omni.drill import story
from slurm_omni.drill.inject import Injector
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.drill.run import DrillRunner, DrillSpec
from slurm_omni.drill.verify import wait_done

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
NAME = "omni-drill-e2e"


def test_node_down_during_training_recovers_and_stays_equivalent(slurm_cluster, tmp_path: Path) -> None:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
    slurm_cluster.cluster.up()      # re-renders plugstack.conf now that the plugin is built
    files = story.DemoFiles(tmp_path / "demo")
    # the manager's own recovery (resubmission), as before the demo site's default became allocation mode
    story.write_files(files, slurm_cluster.cluster, recovery="resubmit")
    files.job.write_text(files.job.read_text().replace('name = "omni-demo"', f'name = "{NAME}"')
                         .replace("max_steps = 80", "max_steps = 40"))
    story.synthesize(files)
    site = load_site(files.site)
    backend = slurm_cluster.backend()
    injector = Injector(allowed=site.drills.nodes, site=str(files.site), backend=backend)
    env = story.job_environment(slurm_cluster.cluster)
    manager = story.start_manager(files, env)
    submitted: list[int] = []
    try:
        submitted.append(story.submit(files, env))
        handle = story.handle(files, submitted[0])
        runner = DrillRunner(injector, backend, handle, timeline=files.manager_dir / "timeline.json")
        result = runner.run(DrillSpec(kind="node-down", after_steps=5, timeout_s=150))
        assert result.ok, result.to_json()
        assert result.times.source == "journal", "the manager's timeline holds the recovery"
        assert result.detection_s is not None and result.recovery_s is not None
        assert result.progress is not None and result.progress.steps_lost is not None
        node = next(n for n in backend.nodes() if n.name == result.node)
        assert node.state.usable and "DRAIN" not in node.flags
        reference = start_reference(files.job, files.reference)
        wait_done(runner, 180)
        eq = story.compare(files, handle.metrics_dir, finish_reference(reference, files.reference, 180))
        assert eq.ok, eq.problems
        assert eq.loss.mode == "bitwise" and eq.loss.steps_compared == 40
    finally:
        story.cleanup(backend, injector, submitted, manager, keys=[f"{NAME}-{j}" for j in submitted])
