"""Faults on purpose, through Slurm and signals, only on the nodes the site lets drills touch.

Node down: ``scontrol update nodename=X state=DOWN reason=omni-drill``; back with RESUME. A rank:
its pid from ``scontrol listpids <component job> <node>`` (22.05 takes the node name as a second
argument, which is what picks the right slurmd spool when several slurmd share a host), then a
signal: KILL to kill it, STOP and CONT to stall it. ``scontrol listpids`` and the signal must run
on the node itself: on this host directly, on another host through ``srun --overlap`` into the
job. A slurmd crash is a SIGKILL to the embedded cluster's slurmd; it comes back by restarting it.

This module does what it is told and decides nothing: which fault, when and where is the drill
runner's choice.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.errors import OmniError
from slurm_omni.slurm.cli_backend import CliBackend
from slurm_omni.slurm.hostlist import compress
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.slurm.types import HetComponent

log = logging.getLogger(__name__)

REASON = "omni-drill"
_PID_ROW = re.compile(r"^([0-9]+)\s+([0-9]+)\s+(\S+)\s+([0-9]+|-)\s+([0-9]+|-)\s*$")
_HOSTNAME = re.compile(r"\bNodeHostName=(\S+)")


class DrillRefused(OmniError):
    """The drill would touch a node outside ``drills.allowed_nodes``, or drills are off."""

    exit_code = 2


class DrillError(OmniError):
    """A drill could not inject its fault, follow the recovery or put the node back."""


@dataclass(frozen=True, slots=True)
class TaskPid:
    """One task of a step, as ``scontrol listpids`` lists it."""

    pid: int
    job_id: int
    step: str
    local_id: int
    global_id: int
    """Task id within the (component) job: add the earlier components' tasks for the global rank."""


def parse_listpids(text: str) -> list[TaskPid]:
    """Task rows of ``scontrol listpids`` (rows with ``-`` ids are helpers, not tasks; batch steps skipped)."""
    out = []
    for line in text.splitlines():
        m = _PID_ROW.match(line.strip())
        if m is None or m[4] == "-" or m[5] == "-" or m[3] in ("batch", "extern"):
            continue
        out.append(TaskPid(int(m[1]), int(m[2]), m[3], int(m[4]), int(m[5])))
    return out


def check_allowed(nodes: list[str] | tuple[str, ...], allowed: tuple[str, ...], site: str) -> None:
    if not allowed:
        raise DrillRefused(f"drill: couldn't run: drills.allowed_nodes is empty in {site} (drills are refused)")
    outside = [n for n in nodes if n not in allowed]
    if outside:
        raise DrillRefused(f"drill: couldn't touch {compress(outside)}: not in drills.allowed_nodes "
                           f"({compress(list(allowed))}) of {site}")


class Injector:
    def __init__(self, *, allowed: tuple[str, ...], site: str, backend: CliBackend,
                 cluster: LocalCluster | None = None) -> None:
        self.allowed = allowed
        self.site = site
        self.backend = backend
        self.runner: CommandRunner = backend.runner
        self.cluster = cluster
        self._hosts: dict[str, str] = {}
        self.downed: set[str] = set()
        """Nodes this injector set DOWN: the ones a cleanup puts back."""

    def check(self, *nodes: str) -> None:
        check_allowed(list(nodes), self.allowed, self.site)

    # -- nodes --------------------------------------------------------------------------------------
    def node_down(self, node: str) -> float:
        """Set ``node`` DOWN; returns the fault time."""
        self.check(node)
        at = time.time()
        self.backend.set_node_state(node, "DOWN", reason=REASON)
        self.downed.add(node)
        log.info("drill: %s set DOWN", node)
        return at

    def resume(self, node: str, *, wait_s: float = 60.0) -> None:
        """RESUME ``node`` (whatever drained or downed it during the drill) until Slurm can use it."""
        self.check(node)
        deadline = time.monotonic() + wait_s
        while True:
            state = next((n for n in self.backend.nodes() if n.name == node), None)
            if state is not None and state.state.usable and not {"DRAIN", "NOT_RESPONDING"} & state.flags:
                return
            if state is not None and not {"NOT_RESPONDING"} & state.flags:
                # RESUME is refused while the node does not answer (a slurmd still registering).
                result = self.runner.run(["scontrol", "update", f"nodename={node}", "state=RESUME"], check=False)
                if not result.ok and "Invalid node state" not in result.stderr:
                    log.info("drill: resume %s: %s", node, result.stderr.strip())
            if time.monotonic() > deadline:
                raise DrillError(f"drill: couldn't return {node} to service within {wait_s:.0f}s: "
                                 f"{state.slurm_state if state else 'missing'} (scontrol update "
                                 f"nodename={node} state=RESUME)")
            time.sleep(0.5)

    # -- ranks --------------------------------------------------------------------------------------
    def _host(self, node: str) -> str:
        if node not in self._hosts:
            out = self.runner.run(["scontrol", "show", "node", "-o", node]).stdout
            m = _HOSTNAME.search(out)
            self._hosts[node] = m[1] if m else node
        return self._hosts[node]

    def _local(self, node: str) -> bool:
        return self._host(node) in (socket.gethostname(), socket.getfqdn(), "localhost")

    def _on_node(self, component: HetComponent, node: str, argv: list[str], *, het: bool) -> str:
        """Run ``argv`` on ``node``: here when the node is this host, else as an overlapping step of the
        job (22.05 takes a het job's leader id and the component as --het-group, not the component id)."""
        if not self._local(node):
            job = ([f"--jobid={component.het_job_id}", f"--het-group={component.het_offset}"] if het
                   else [f"--jobid={component.job_id}"])
            argv = ["srun", *job, "--overlap", f"--nodelist={node}", "-N1", "-n1", "--quiet", *argv]
        return self.runner.run(argv, timeout_s=20).stdout

    def task_pids(self, component: HetComponent, node: str, *, het: bool) -> list[TaskPid]:
        """Tasks of ``component`` on ``node``, the job's first step first: the training step is the
        batch script's first srun (a remote listpids adds its own, later step)."""
        self.check(node)
        out = self._on_node(component, node, ["scontrol", "listpids", str(component.job_id), node], het=het)
        return sorted(parse_listpids(out), key=lambda t: (int(t.step) if t.step.isdigit() else 1 << 30,
                                                          t.local_id))

    def send(self, component: HetComponent, node: str, pids: list[int], sig: signal.Signals, *,
             het: bool) -> float:
        """Signal ``pids`` on ``node``; returns the time it was sent."""
        self.check(node)
        at = time.time()
        if self._local(node):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError as e:
                    raise DrillError(f"drill: couldn't send SIG{sig.name.removeprefix('SIG')} to pid {pid} "
                                     f"on {node}: no such process (the rank exited)") from e
        else:
            self._on_node(component, node, ["kill", "-s", sig.name.removeprefix("SIG"), *map(str, pids)], het=het)
        log.info("drill: sent %s to %s on %s", sig.name, pids, node)
        return at

    # -- daemons (the embedded cluster) -------------------------------------------------------------
    def _cluster(self) -> LocalCluster:
        if self.cluster is None:
            raise DrillError("drill: couldn't crash a slurmd: only the embedded cluster's daemons can be "
                             "killed (omni cluster up; pass --state-dir)")
        return self.cluster

    def slurmd_crash(self, node: str) -> float:
        self.check(node)
        at = time.time()
        cluster = self._cluster()
        pid = cluster.kill_daemon(f"slurmd:{node}", signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while cluster.running().get(f"slurmd:{node}") is not None and time.monotonic() < deadline:
            time.sleep(0.02)   # SIGKILL lands asynchronously
        log.info("drill: killed slurmd:%s (pid %d)", node, pid)
        return at

    def restart_slurmd(self, node: str, *, wait_s: float = 60.0) -> None:
        """Start the slurmd again (``up`` restarts only what is missing) and RESUME the node."""
        self.check(node)
        cluster = self._cluster()
        if cluster.running().get(f"slurmd:{node}") is None:
            try:
                cluster.up(wait_s=wait_s)
            except OmniError as e:
                raise DrillError(f"drill: couldn't restart slurmd:{node}: {e}") from e
        self.resume(node, wait_s=wait_s)


def read_state_dir(path: Path | None) -> LocalCluster | None:
    """The embedded cluster of ``path`` when it has one recorded."""
    if path is None:
        return None
    cluster = LocalCluster(path)
    try:
        return cluster if cluster.recorded_spec() is not None else None
    except OmniError:
        return None
