"""In-allocation: fault records of a launch the step supervisor already replaced are not held
against the launch that replaced it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omni_configs import site_toml

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.manager.events import parse_fault_record
from slurm_omni.manager.sources import SpoolItem
from slurm_omni.manager.watch import Watch, live
from slurm_omni.policy.watch_lifecycle import Relaunched
from slurm_omni.policy.watch_lifecycle import initial as initial_life
from slurm_omni.slurm.cli_backend import CliBackend


def _manager(tmp_path: Path) -> Manager:
    (tmp_path / "site.toml").write_text(site_toml(tmp_path))
    # No tick runs: the backend is never asked anything.
    return Manager(ManagerConfig(site=load_site(tmp_path / "site.toml"), state_dir=tmp_path / "state"),
                   CliBackend(env={}))


def test_a_killed_launchs_late_task_exits_do_not_count_against_the_relaunch(tmp_path: Path) -> None:
    """In-allocation: the supervisor kills launch 0's step and relaunches; slurmstepd reports the killed
    ranks' exits seconds later, with the old step's id. Before, they were level-1 signals against the
    new launch, whose first heartbeats came late on a loaded machine: a second "down on node3"
    confirmation, and the manager took the job over and resubmitted a run that was training fine."""
    m = _manager(tmp_path)
    seen: list[Any] = []
    reg: Any = SimpleNamespace(ckpt_dir=tmp_path, tasks=())
    w = Watch(key="own-9", reg=reg, shape=None, placement=None, confirmer=SimpleNamespace(observe=seen.append, reset=lambda _: None),  # type: ignore[arg-type]
              heartbeat_dir=tmp_path, life=initial_life(0, 9, 1))

    def exit_of(step: int, node: str, task: int, at: float) -> SpoolItem:
        record = {"version": 1, "kind": "task_exit", "job_id": 9, "het_job_id": -1, "het_offset": -1, "step_id": step,
                  "node": node, "stage": "lm", "stage_index": 2, "stage_rank": 1, "task_id": task, "local_task_id": 1,
                  "pid": 77, "exit_code": None, "signal": 9, "core_dumped": False, "time": "t", "time_unix": at}
        name = f"fault-9.{step}-{node}-{task}-{int(at)}.json"
        return SpoolItem(tmp_path / name, parse_fault_record(json.dumps(record).encode(), name))

    try:
        m._observe_event(w, exit_of(6, "node3", 5, 100.0))      # launch 0 (step 6): the lost node's rank
        live(w, Relaunched(incarnation=1), 101.0)                 # the supervisor's report: launch 1
        m._observe_event(w, exit_of(6, "node1", 1, 101.0))      # launch 0's ranks, killed, reaped late
        m._observe_event(w, exit_of(6, "node2", 3, 102.0))
        m._observe_event(w, exit_of(7, "node4", 5, 130.0))      # launch 1 (step 7) failing: counted
    finally:
        m.close()
    assert [(o.node, o.time) for o in seen] == [("node3", 100.0), ("node4", 130.0)]
