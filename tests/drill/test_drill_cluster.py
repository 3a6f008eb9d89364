"""Drill triggers on the real embedded Slurm 22.05 cluster: node DOWN and RESUME on an allowed node
only, scontrol listpids of a het job's component on one node (several slurmd on this host), signals
to one rank, a slurmd crash and restart; refusals as one line and exit code 2."""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import pytest
from omni_configs import site_toml
from support import wait_until

from slurm_omni.cli.main import main
from slurm_omni.drill.inject import REASON, DrillRefused, Injector
from slurm_omni.drill.job import JobHandle, pick_task
from slurm_omni.slurm.types import NodeState

pytestmark = pytest.mark.cluster


def _site(tmp: Path, allowed: str) -> str:
    return site_toml(tmp, tables=f'[drills]\nallowed_nodes = "{allowed}"\n')


def idle_nodes(backend, count: int) -> list[str]:
    """Idle nodes, highest first (other tests tend to take the low ones)."""
    def probe() -> list[str] | None:
        idle = sorted((n.name for n in backend.nodes() if n.state is NodeState.IDLE and not n.flags),
                      key=lambda name: -int(name.removeprefix("node")))
        return idle[:count] if len(idle) >= count else None

    return wait_until(probe, 120, f"{count} idle nodes", interval_s=1.0)


def test_node_down_touches_only_the_allowed_node_and_resumes_it(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    node = idle_nodes(backend, 1)[0]
    injector = Injector(allowed=(node,), site="test site", backend=backend)
    with pytest.raises(DrillRefused):
        injector.node_down("node1" if node != "node1" else "node2")
    try:
        before = time.time()
        assert injector.node_down(node) >= before      # the fault time is taken before scontrol runs
        nodes = {n.name: n for n in backend.nodes()}
        assert nodes[node].state is NodeState.DOWN and nodes[node].reason == REASON
        assert [n for n in nodes.values() if n.reason == REASON] == [nodes[node]]
    finally:
        injector.resume(node)
    back = next(n for n in backend.nodes() if n.name == node)
    assert back.state.usable and not back.flags & {"DRAIN", "NOT_RESPONDING"} and back.reason != REASON


def test_refused_node_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site = tmp_path / "omni.toml"
    site.write_text(_site(tmp_path, "node[7-8]"))
    code = main(["drill", "node-down", "--job", "anything", "--site", str(site), "--node", "node1",
                 "--state-dir", str(tmp_path / "no-cluster")])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"omni: drill: couldn't touch node1: not in drills.allowed_nodes (node[7-8]) of {site}\n"
    site.write_text(_site(tmp_path, ""))
    assert main(["drill", "kill-rank", "--job", "anything", "--site", str(site)]) == 2
    assert "drills.allowed_nodes is empty" in capsys.readouterr().err


@pytest.mark.parametrize("remote", [False, True], ids=["this-host", "through-srun-overlap"])
def test_listpids_finds_each_rank_and_signals_reach_it(slurm_cluster, tmp_path: Path, remote: bool) -> None:
    """A two-component het job, two tasks per node: component 1's tasks are ranks 2 and 3; STOP
    freezes exactly the chosen one, CONT thaws it, KILL ends it. ``remote``: as on a real cluster,
    listpids and kill run on the node as an overlapping step of the job (srun --het-group)."""
    backend = slurm_cluster.backend()
    vision, text = idle_nodes(backend, 2)
    out = tmp_path / "pids"
    out.mkdir()
    script = tmp_path / "het.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --job-name=omni-drill-test --output={tmp_path}/het.out
        #SBATCH --partition=vision --nodes=1 --ntasks-per-node=2 --gres=gpu:h100:2 --nodelist={vision}
        #SBATCH hetjob
        #SBATCH --partition=text --nodes=1 --ntasks-per-node=2 --gres=gpu:h100:2 --nodelist={text}
        srun --het-group=0,1 bash -c 'echo $$ > {out}/rank-$SLURM_PROCID; exec sleep 120'
        """))
    leader = backend.submit(str(script))
    try:
        wait_until(lambda: len(list(out.iterdir())) == 4, 90, "four ranks to start", interval_s=0.5)
        job = next(j for j in backend.jobs() if j.job_id == leader)
        comp = next(c for c in job.components if c.het_offset == 1)
        injector = Injector(allowed=(text,), site="test site", backend=backend)
        if remote:
            injector._hosts[text] = "a-host-elsewhere"     # what scontrol show node would say
        tasks = injector.task_pids(comp, text, het=True)
        handle = JobHandle(name="omni-drill-test", job_id=leader, stage_tasks=(2, 2), ckpt_dir=tmp_path,
                           metrics_dir=tmp_path, heartbeat_dir=tmp_path, max_steps=1)
        ranks = {pick_task(tasks, comp, handle, r)[1].pid: r for r in (2, 3)}
        assert ranks == {int((out / f"rank-{r}").read_text()): r for r in (2, 3)}
        pid = next(p for p, r in ranks.items() if r == 3)
        other = next(p for p, r in ranks.items() if r == 2)
        with pytest.raises(DrillRefused):
            injector.task_pids(job.components[0], vision, het=True)
        injector.send(comp, text, [pid], signal.SIGSTOP, het=True)
        assert wait_until(lambda: _state(pid) == "T", 10, "rank 3 stopped")
        assert _state(other) != "T"
        injector.send(comp, text, [pid], signal.SIGCONT, het=True)
        assert wait_until(lambda: _state(pid) not in ("T", ""), 10, "rank 3 running again")
        injector.send(comp, text, [pid], signal.SIGKILL, het=True)
        wait_until(lambda: _state(pid) in ("", "Z"), 30, "rank 3 to die")
        # a remote listpids also lists its own probe, a later step of the job
        assert [t.pid for t in injector.task_pids(comp, text, het=True) if t.step == "0"] == [other]
    finally:
        backend.cancel(str(leader))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_slurmd_crash_and_restart(slurm_cluster) -> None:
    backend = slurm_cluster.backend()
    node = idle_nodes(backend, 1)[0]
    injector = Injector(allowed=(node,), site="test site", backend=backend, cluster=slurm_cluster.cluster)
    try:
        injector.slurmd_crash(node)
        assert slurm_cluster.cluster.running()[f"slurmd:{node}"] is None
    finally:
        injector.restart_slurmd(node)
    assert slurm_cluster.cluster.running()[f"slurmd:{node}"] is not None
    back = next(n for n in backend.nodes() if n.name == node)
    assert back.state.usable and "NOT_RESPONDING" not in back.flags
