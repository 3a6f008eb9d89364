"""What the step supervisor asks Slurm about its own allocation: the nodes (state, features,
address), the switch tree, and the job's state. Each call is one bounded command through the runner."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime

from slurm_omni.slurm.hostlist import compress, expand
from slurm_omni.slurm.parse_text import (
    SINFO_NODE_LINES,
    nodes_from_records,
    nodes_from_sinfo,
    parse_records,
    parse_topology,
)
from slurm_omni.slurm.runner import CommandRunner, ScontrolSession
from slurm_omni.slurm.types import Node, Topology


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What ``scontrol show job`` says of an allocation the supervisor runs outside of."""

    state: str
    """JobState; empty when Slurm no longer knows the job."""
    nodes: tuple[str, ...]
    end_time: float | None
    """EndTime as a Unix time (the time limit), None when Slurm gives none."""
    user_id: int | None
    start_time: float | None = None
    """StartTime as a Unix time (for a running job: when it started; EndTime - StartTime is its limit)."""


SESSION_NODES = 16
"""The reads of at most this many nodes go through the view's ``session`` (the nodes srun reported
failed, read to confirm it: they must not wait behind a read of the whole job's nodes)."""


class AllocationView:
    def __init__(self, runner: CommandRunner, job_id: str, session: ScontrolSession | None = None) -> None:
        self.runner = runner
        self.job_id = job_id
        self.session = session
        """A kept ``scontrol`` for the short node reads (``runner.ScontrolSession``); None: a command each."""
        self._topology: Topology | None = None
        self._addrs: dict[str, str] = {}

    def topology(self) -> Topology:
        """``scontrol show topology`` once (it changes only on reconfiguration); empty without one."""
        if self._topology is None:
            result = self.runner.run(["scontrol", "show", "topology"], check=False)
            self._topology = parse_topology(result.stdout) if result.ok else Topology()
        return self._topology

    def node_info(self, names: Sequence[str], timeout_s: float = 10.0
                  ) -> tuple[list[Node], dict[str, frozenset[str]], dict[str, str]]:
        """``scontrol show node`` of ``names``: the nodes, their features, their addresses (NodeAddr:
        names need not resolve, several slurmd may share a host)."""
        if not names:
            return [], {}, {}
        listed = compress(names)
        text = self.session.show_node(listed, timeout_s) \
            if self.session is not None and len(names) <= SESSION_NODES else None
        if text is None:
            text = self.runner.run(["scontrol", "show", "node", listed], timeout_s=timeout_s).stdout
        records = parse_records(text, "NodeName")
        feats = {r["NodeName"]: frozenset(f for f in r.get("AvailableFeatures", "").split(",") if f and f != "(null)")
                 for r in records}
        addrs = {r["NodeName"]: r.get("NodeAddr", r["NodeName"]) for r in records}
        self._addrs.update(addrs)
        return nodes_from_records(records, self.topology()), feats, addrs

    def failed_among(self, names: Sequence[str], timeout_s: float = 10.0) -> list[Node]:
        """Those of ``names`` that are down, drained or draining, failing or not responding (``sinfo
        --states``): what a relaunch must leave out, as one short answer (slurmctld sends every node,
        sinfo prints these; the supervisor parses a few lines, not every node's record). Not a node
        set DOWN a moment ago whose CPUs sinfo still counts as its job's: sinfo prints it ``mixed``
        and ``--states=down`` leaves it out (:data:`SINFO_NODE_LINES`); the read of a node srun
        reported failed is ``scontrol show node``'s."""
        if not names:
            return []
        text = self.runner.run(["sinfo", "--noheader", "--Node", f"--nodes={compress(names)}",
                                "--states=down,drain,fail,no_respond", f"--Format={SINFO_NODE_LINES}"],
                               timeout_s=timeout_s).stdout
        return nodes_from_sinfo(text, self.topology())

    def address(self, name: str) -> str:
        """The node's NodeAddr: from an earlier :meth:`node_info` (addresses do not change while the
        job runs), else asked once."""
        if name not in self._addrs:
            self.node_info([name])
        return self._addrs.get(name, name)

    def job_state_and_nodes(self, names: Sequence[str], timeout_s: float = 10.0) -> tuple[str, list[Node]]:
        """:meth:`job_state` and :meth:`node_info` of ``names`` at once (two commands side by side:
        right after a failure slurmctld answers slowly, and the relaunch waits for both)."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            state = pool.submit(self.job_state, timeout_s)
            nodes = pool.submit(self.node_info, names, timeout_s)
            return state.result(), nodes.result()[0]

    def job_state(self, timeout_s: float = 10.0) -> str:
        """Slurm's state of the job (``squeue``), empty when it cannot tell."""
        out = self.runner.run(["squeue", "--noheader", f"--jobs={self.job_id}", "--format=%T"], check=False,
                              timeout_s=timeout_s)
        words = out.stdout.split()
        return words[0] if out.ok and words else ""

    def job_record(self) -> JobRecord:
        """``scontrol show job -o J``: its state, nodes now (a lost node is excised from a --no-kill
        job) and end time; an empty state when Slurm no longer knows it."""
        out = self.runner.run(["scontrol", "show", "job", "-o", self.job_id], check=False, timeout_s=10)
        records = parse_records(out.stdout, "JobId") if out.ok else []
        if not records:
            return JobRecord("", (), None, None)
        r = records[0]
        nodes = r.get("NodeList", "")
        uid = r.get("UserId", "").partition("(")[2].rstrip(")")
        return JobRecord(r.get("JobState", ""), tuple(expand(nodes)) if nodes and nodes != "(null)" else (),
                         _slurm_time(r.get("EndTime", "")), int(uid) if uid.isdigit() else None,
                         _slurm_time(r.get("StartTime", "")))

    def release(self) -> None:
        """End an allocation that has no batch script to end it (``scancel J``; training is done)."""
        self.runner.run(["scancel", self.job_id], check=False, timeout_s=30)


def _slurm_time(text: str) -> float | None:
    """``2026-12-02T01:02:03`` (slurmctld's local time) as a Unix time; None for Unknown/None."""
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def jobs_named(runner: CommandRunner, name: str) -> list[str]:
    """This user's jobs of that name that Slurm still lists (``squeue --me``): how a supervisor that
    died between starting a pool's salloc and journaling its job id finds it again."""
    out = runner.run(["squeue", "--noheader", "--me", f"--name={name}", "--format=%i"], check=False, timeout_s=10)
    return [w for w in out.stdout.split() if w.isdigit()] if out.ok else []
