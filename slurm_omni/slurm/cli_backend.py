"""The command-line backend: sinfo/squeue --json, scontrol text, sbatch; all through the runner."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence

from slurm_omni.errors import SlurmError
from slurm_omni.slurm.backend import ClusterSnapshot
from slurm_omni.slurm.parse_json import Skipped, read_sinfo_json, read_squeue_json
from slurm_omni.slurm.parse_text import parse_topology
from slurm_omni.slurm.runner import CommandResult, CommandRunner
from slurm_omni.slurm.types import Job, Node, Topology

_SBATCH_ID = re.compile(r"^Submitted batch job ([0-9]+)", re.MULTILINE)
_JOB_REF = re.compile(r"^[0-9]+(\+[0-9]+|_[0-9]+)?$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\],]+$")
_MAX_SKIPS_REMEMBERED = 1024

log = logging.getLogger(__name__)


class CliBackend:
    name = "cli"

    def __init__(self, env: Mapping[str, str] | None = None, *, runner: CommandRunner | None = None,
                 timeout_s: float = 30.0, retries: int = 5, topology_ttl_s: float = 300.0) -> None:
        self.runner = runner or CommandRunner(env, timeout_s=timeout_s, retries=retries)
        self.topology_ttl_s = topology_ttl_s
        self._topology: Topology | None = None
        self._topology_at = 0.0
        self._skips_logged: set[str] = set()

    # -- reads ----------------------------------------------------------------------------------------
    def version(self) -> str:
        """The clients' Slurm release, e.g. ``24.11.5`` (``sinfo --version`` prints ``slurm 24.11.5``)."""
        words = self.runner.run(["sinfo", "--version"], retry_unreachable=False).stdout.split()
        if len(words) < 2:
            raise SlurmError(f"sinfo: couldn't read the version from {' '.join(words)!r}")
        return words[1]

    def topology(self, *, refresh: bool = False) -> Topology:
        """The switch tree, cached: it changes only on reconfiguration."""
        if refresh or self._topology is None or time.monotonic() - self._topology_at > self.topology_ttl_s:
            result = self.runner.run(["scontrol", "show", "topology"], check=False)
            if not result.ok and "not configured" not in (result.stderr + result.stdout).lower():
                raise SlurmError(f"scontrol: couldn't show topology: {result.stderr.strip()}")
            self._topology = parse_topology(result.stdout) if result.ok else Topology()
            self._topology_at = time.monotonic()
        return self._topology

    def nodes(self) -> list[Node]:
        out = self.runner.run(["sinfo", "--json"], unreachable_if=json_reports_error).stdout
        read = read_sinfo_json(out, self.topology())
        self._log_skipped("sinfo", read.skipped)
        return read.nodes

    def jobs(self, *, user: str | None = None) -> list[Job]:
        return self._jobs(user)[0]

    def _jobs(self, user: str | None) -> tuple[list[Job], frozenset[int]]:
        """The jobs, and the ids of those whose records could not be read (skipped, not gone)."""
        # squeue --json ignores filters in 22.05 (BACKGROUND.md): filter here. 24.11+ apply squeue's
        # default state filter to --json too, so a job that ended (CANCELLED, COMPLETED, FAILED...)
        # would vanish from the list instead of showing how it ended: --states=all lists them until
        # MinJobAge, as 22.05 does (tests/fixtures/slurm-*/squeue_cancelled*.json).
        out = self.runner.run(["squeue", "--json", "--states=all"], unreachable_if=json_reports_error).stdout
        read = read_squeue_json(out)
        self._log_skipped("squeue", read.skipped)
        return ([j for j in read.jobs if user is None or j.user == user],
                frozenset(i for s in read.skipped for i in s.job_ids))

    def snapshot(self, *, user: str | None = None) -> ClusterSnapshot:
        # The jobs first, then the nodes: a node failure that already changed a job (JobRequeue puts
        # it back to PENDING within the DOWN's RPC) is then in the nodes' read too. Read the other
        # way round, a DOWN landing between the two reads showed a requeued job beside a healthy node
        # (seen once on the 24.11 lane at load 8-10: the recovery's cause became "requeued", not "down").
        jobs, unreadable = self._jobs(user)
        nodes = self.nodes()
        return ClusterSnapshot(tuple(nodes), tuple(jobs), self.topology(), time.time(), unreadable_jobs=unreadable)

    def _log_skipped(self, command: str, skipped: list[Skipped]) -> None:
        """One warning per record and reason while it lasts (a poll every second must not repeat it)."""
        for item in skipped:
            line = item.line(command)[:400]
            if line in self._skips_logged:
                log.debug("%s", line)
                continue
            if len(self._skips_logged) >= _MAX_SKIPS_REMEMBERED:
                self._skips_logged.clear()
            self._skips_logged.add(line)
            log.warning("%s", line)

    # -- writes -------------------------------------------------------------------------------------
    def submit(self, script_path: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None) -> int:
        """``env``: the job's environment (sbatch hands its own to the job) instead of ours."""
        result = self.runner.run(["sbatch", *args, script_path], retry_unreachable=True, env=env)
        m = _SBATCH_ID.search(result.stdout)
        if m is None:
            raise SlurmError(f"sbatch: couldn't read the job id from {result.stdout.strip()!r}")
        return int(m.group(1))

    def cancel(self, job_id: str, *, signal: str | None = None, batch_only: bool = False) -> None:
        _check_ref(job_id)
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch_only:
            argv.append("--batch")
        self.runner.run([*argv, job_id])

    def requeue(self, job_ref: str, *, hold: bool = False) -> None:
        _check_ref(job_ref)
        # scontrol requeue can hang (BACKGROUND.md): a short timeout, and the caller retries.
        self.runner.run(["scontrol", "requeuehold" if hold else "requeue", job_ref], timeout_s=20)

    def set_node_state(self, node: str, state: str, reason: str = "") -> None:
        if not _NODE_NAME.match(node):
            raise SlurmError(f"scontrol: couldn't update node {node!r}: not a node name or hostlist")
        allowed = {"DOWN", "DRAIN", "RESUME", "UNDRAIN", "IDLE", "FAIL"}
        if state.upper() not in allowed:
            raise SlurmError(f"scontrol: couldn't set state {state!r} (allowed: {', '.join(sorted(allowed))})")
        argv = ["scontrol", "update", f"nodename={node}", f"state={state.upper()}"]
        if reason:
            argv.append(f"reason={reason}")
        self.runner.run(argv)


def json_reports_error(result: CommandResult) -> bool:
    """22.05's --json commands exit 0 and put "errors" in the document when slurmctld is unreachable."""
    head = result.stdout[:2000]
    return '"errors"' in head and '"error"' in head.split('"errors"', 1)[1][:400]


def _check_ref(ref: str) -> None:
    if not _JOB_REF.match(ref):
        raise SlurmError(f"slurm: couldn't use job reference {ref!r} (allowed: N, N+K, N_K)")
