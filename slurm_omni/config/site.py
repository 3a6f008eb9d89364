"""The admin's site config (``omni.toml``): where stages run, where state lives, the policies.

One file per cluster, read by ``omni submit``, the manager and the drills. Every path in it is
absolute: the manager, the batch script and the SPANK plugin run on different hosts and in
different working directories.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from slurm_omni.config.schema import load_dataclass, read_toml
from slurm_omni.errors import ConfigError, SlurmError
from slurm_omni.policy.confirm import ConfirmConfig
from slurm_omni.policy.failslow import FailSlowConfig
from slurm_omni.slurm import hostlist
from slurm_omni.slurm.types import Gres

DEFAULT_SITE_PATH = Path("/etc/slurm-omni/omni.toml")
SITE_ENV = "OMNI_SITE_CONFIG"

# Slurm accepts more in partition names, but these are the ones that need no quoting anywhere.
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_GRES = re.compile(r"(?P<name>[a-z][a-z0-9_]*)(?::(?P<type>[A-Za-z0-9_.-]+))?:(?P<count>[0-9]+)")


def parse_gres(text: str) -> Gres:
    """``gpu:h100:4`` or ``gpu:4`` -> Gres; anything else is a ConfigError naming the form."""
    m = _GRES.fullmatch(text)
    if m is None or int(m["count"]) < 1:
        raise ConfigError(f"gres {text!r} is not allowed (expected NAME[:TYPE]:COUNT with COUNT >= 1, "
                          f"e.g. 'gpu:h100:4')")
    return Gres(m["name"], m["type"], int(m["count"]))


def check_slurm_name(what: str, text: str) -> None:
    if not _SLURM_NAME.fullmatch(text):
        raise ConfigError(f"{what} {text!r} is not allowed (expected letters, digits, '_', '.', '-', "
                          f"at most 64, starting with a letter or digit)")


def check_hostlist(what: str, text: str) -> tuple[str, ...]:
    if not text:
        return ()
    try:
        return tuple(hostlist.expand(text))
    except SlurmError as e:
        raise ConfigError(f"{what} {text!r} is not a Slurm hostlist ({e})") from e


def _check_absolute(what: str, path: Path) -> None:
    if not path.is_absolute():
        raise ConfigError(f"{what} {str(path)!r} is not allowed (expected an absolute path: the manager, "
                          f"batch script and plugin run in different directories)")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSite:
    """Where one pipeline stage (one heterogeneous component) runs by default."""

    partition: str
    """Slurm partition of the stage's component."""
    gres: str
    """Generic resources per node, ``NAME[:TYPE]:COUNT``; tasks per node default to COUNT."""
    feature: str = ""
    """Node feature (slurm.conf ``Features=``) that marks nodes of this stage's kind. In one
    ``in_allocation`` job, stages of different kinds are asked for with ``--constraint`` counts,
    ``[vis*2&txt*3]``; empty: any node of the partition fits the stage."""

    def __post_init__(self) -> None:
        check_slurm_name("partition", self.partition)
        parse_gres(self.gres)
        if self.feature:
            check_slurm_name("stages.feature", self.feature)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSite:
    root: Path
    """Shared storage that every node mounts; each job writes under ``root/<user>/<job name>``
    (0700 folders of the user's, docs/deployment.md)."""
    memory_gib: float | None = None
    """The most a job keeps in the memory tier (``/dev/shm``) per node; None: what the tmpfs holds."""
    memory_dir: Path | None = None
    """The node-local tmpfs of the memory tier; None: ``/dev/shm``. A tmpfs mounted with
    ``huge=within_size`` gives the copies huge pages: restoring from it costs about a memcpy, from a
    tmpfs with 4 KiB pages about twice that (docs/checkpoint.md, "The memory tier")."""

    def __post_init__(self) -> None:
        _check_absolute("checkpoint.root", self.root)
        if self.memory_dir is not None:
            _check_absolute("checkpoint.memory_dir", self.memory_dir)
        if self.memory_gib is not None and not self.memory_gib >= 0:
            raise ConfigError(f"checkpoint: memory_gib = {self.memory_gib} (GiB per node, 0 or more)")

    def job_dir(self, user: str, name: str) -> Path:
        """A job's checkpoints and heartbeats: per user, so that nobody else can make them first."""
        return self.root / user / name


@dataclass(frozen=True, kw_only=True, slots=True)
class DetectionSite:
    """Failure confirmation: level-2 heartbeats and the sliding progress window."""

    heartbeat_interval_s: float = 1.0
    """How often every rank reports its last completed step (also the confirmer's initial
    heartbeat interval until it has measured one)."""
    confirmation_window_s: float = 30.0
    """Level 2 alone (stale heartbeats, no progress) confirms a hang after this long (the
    confirmer's ``hang_floor_s``); with a level-1 signal the two levels confirm together at once."""
    progress_window_s: float = 300.0
    """No step completed for this long means stuck, not slow (the confirmer's ``stuck_floor_s``)."""
    first_heartbeat_s: float = 600.0
    """A job none of whose lives ever wrote a heartbeat this long after Slurm showed it running is
    bad input (its command never calls ``slurm_omni.elastic.init``): cancelled, never restarted."""
    confirm: ConfirmConfig = field(default_factory=ConfirmConfig)
    """``[detection.confirm]``: every other window of the confirmation rule
    (slurm_omni.policy.confirm.ConfirmConfig); the defaults confirm a node loss within 5 s."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0:
            raise ConfigError(f"detection.heartbeat_interval_s = {self.heartbeat_interval_s} is not "
                              f"allowed (expected > 0)")
        if self.confirmation_window_s < self.heartbeat_interval_s:
            raise ConfigError(f"detection.confirmation_window_s = {self.confirmation_window_s} is not "
                              f"allowed (expected >= heartbeat_interval_s = {self.heartbeat_interval_s})")
        if self.first_heartbeat_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(f"detection.first_heartbeat_s = {self.first_heartbeat_s} is not allowed "
                              f"(expected >= 2 x heartbeat_interval_s = {2 * self.heartbeat_interval_s})")
        if self.progress_window_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(f"detection.progress_window_s = {self.progress_window_s} is not allowed "
                              f"(expected >= 2 x heartbeat_interval_s = {2 * self.heartbeat_interval_s})")


SparePolicy = Literal["same_switch", "any_switch", "none"]
RecoveryPath = Literal["resubmit", "in_allocation", "allocation"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticitySite:
    min_data_parallel_size: int = 1
    """Below this many data-parallel replicas the job waits for nodes instead of shrinking."""
    spare_policy: SparePolicy = "any_switch"
    """Where replacements come from: the failed node's leaf switch only, any switch (the same
    leaf switch first, then the lowest common switch), or nowhere."""
    spare_nodes: str = ""
    """Hostlist of nodes held back as spares (empty: any idle node of the partition)."""
    spare_wait_s: float = 0.0
    """Wait this long after a fault for spares before shrinking (0: shrink at once)."""
    drain_failed: bool = False
    """Drain nodes the manager found failed, with a reason starting ``omni:``."""
    quarantine_s: float = 3600.0
    """A node that failed is not chosen again (for a replacement or a grow) for this long."""
    recovery: Literal["", "resubmit", "in_allocation", "allocation"] = ""
    """Default of the job file's ``[job] recovery``: ``resubmit`` (heterogeneous job, the manager
    resubmits) or ``in_allocation`` (one ``--no-kill`` allocation with spares; the step supervisor
    relaunches inside it) or ``allocation`` (that allocation without a batch script; the supervisor
    runs beside the manager: ``allow_allocation`` must be true). Empty: the fastest path this site
    allows (``default_recovery``)."""
    allow_allocation: bool = False
    """Jobs may ask for ``recovery = "allocation"``: this site lets users run ``salloc --no-shell``,
    ``srun --jobid`` and a long-running process of their own (the step supervisor) on the node where
    they submit and run the manager (docs/allocation-mode.md). False: such a job runs
    ``in_allocation`` (a supervisor in the batch script), with one logged line saying so."""
    pools: bool = True
    """Allocation mode: a job running shrunk (its spares used up) asks Slurm for a pool allocation of
    the nodes it misses (``salloc --no-shell``, the job's partition, gres and constraint) and grows
    back when it starts (docs/allocation-mode.md). False: it runs shrunk to its end."""
    successor_queue_wait_s: float = 3600.0
    """Allocation mode with pools: the queue wait this site's allocations expect. Ahead of the time
    limit (this wait times 1.5 plus one relaunch: ``policy.pools.successor_lead_s``) the supervisor
    asks for a successor allocation of the job's whole shape; when it starts, the ranks save and the
    next launch runs there (docs/allocation-mode.md). 0: no successor, the time limit stops the step
    and the manager resubmits."""
    default_spares: int = 0
    """Spare nodes per stage when a job file's stage gives no ``spares``."""
    max_spares: int = 4
    """The most spare nodes one stage may hold (idle nodes cost the site)."""
    max_relaunches: int = 20
    """In-allocation relaunches per allocation before the supervisor hands over to the manager."""

    @property
    def default_recovery(self) -> RecoveryPath:
        """What a job file that names no ``[job] recovery`` gets: ``recovery`` when the site sets it,
        else the fastest path the site allows: ``allocation`` where ``allow_allocation`` (no node is
        special), else ``in_allocation`` where the site holds spares in allocations
        (``default_spares`` > 0: a lost node is replaced inside the job), else ``resubmit`` (with no
        spare held, an in-allocation job could only shrink on its first loss; a resubmission places a
        replacement). A job that does not fit one allocation is resubmitted whatever the path."""
        if self.recovery:
            return self.recovery
        if self.allow_allocation:
            return "allocation"
        return "in_allocation" if self.default_spares > 0 else "resubmit"

    def __post_init__(self) -> None:
        if not 0 <= self.default_spares <= self.max_spares:
            raise ConfigError(f"elasticity.default_spares = {self.default_spares} is not allowed (expected "
                              f"0 <= it <= elasticity.max_spares = {self.max_spares})")
        if not 1 <= self.max_relaunches <= 99:
            raise ConfigError(f"elasticity.max_relaunches = {self.max_relaunches} is not allowed (expected "
                              f"1..99: each relaunch numbers its life OMNI_INCARNATION + launch, 100 per "
                              f"Slurm restart)")
        if self.min_data_parallel_size < 1:
            raise ConfigError(f"elasticity.min_data_parallel_size = {self.min_data_parallel_size} is "
                              f"not allowed (expected >= 1)")
        check_hostlist("elasticity.spare_nodes", self.spare_nodes)
        if self.recovery == "allocation" and not self.allow_allocation:
            raise ConfigError('elasticity.recovery = "allocation" is not allowed without '
                              'elasticity.allow_allocation = true (the site must let users run salloc, srun '
                              '--jobid and the step supervisor on their login node: docs/allocation-mode.md)')
        if self.spare_wait_s < 0 or self.quarantine_s < 0:
            raise ConfigError(f"elasticity.spare_wait_s = {self.spare_wait_s}, quarantine_s = {self.quarantine_s} "
                              f"are not allowed (expected >= 0)")


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillSite:
    allowed_nodes: str = ""
    """Hostlist of nodes a drill may kill processes on or drain; empty: drills are refused."""

    def __post_init__(self) -> None:
        check_hostlist("drills.allowed_nodes", self.allowed_nodes)

    @property
    def nodes(self) -> tuple[str, ...]:
        return check_hostlist("drills.allowed_nodes", self.allowed_nodes)


@dataclass(frozen=True, kw_only=True, slots=True)
class ManagerSite:
    spool_dir: Path
    """Where the SPANK plugin drops fault records (plugstack ``spool=``); the manager reads them."""
    registry_dir: Path
    """Where ``omni submit`` registers jobs for the manager (one JSON file per job). It must be the
    user's own (0700): a site with many users writes ``{user}`` in it, e.g.
    ``/var/lib/slurm-omni/registry/{user}``, which each user's tools fill in with their name."""
    metrics_dir: Path
    """node_exporter textfile directory for ``*.prom`` files; each job's folder is
    ``<metrics_dir>/<job name>``. A site with many users writes ``{user}`` in it, e.g.
    ``/var/lib/node_exporter/textfile/{user}``, so that two users' jobs of the same name never share
    a folder (filled in as for ``registry_dir``)."""

    def __post_init__(self) -> None:
        _check_absolute("manager.spool_dir", self.spool_dir)
        _check_absolute("manager.registry_dir", self.registry_dir)
        _check_absolute("manager.metrics_dir", self.metrics_dir)

    def registry_for(self, user: str) -> Path:
        """``registry_dir`` of ``user`` (``{user}`` filled in)."""
        return Path(str(self.registry_dir).replace("{user}", user))

    def metrics_for(self, user: str) -> Path:
        """``metrics_dir`` of ``user`` (``{user}`` filled in)."""
        return Path(str(self.metrics_dir).replace("{user}", user))


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteConfig:
    cluster: str = "omni"
    """Name of the Slurm cluster (ClusterName in slurm.conf)."""
    stages: dict[str, StageSite]
    """Stage name -> where it runs by default, e.g. ``vision`` and ``text``."""
    checkpoint: CheckpointSite
    detection: DetectionSite = field(default_factory=DetectionSite)
    elasticity: ElasticitySite = field(default_factory=ElasticitySite)
    drills: DrillSite = field(default_factory=DrillSite)
    failslow: FailSlowConfig = field(default_factory=FailSlowConfig)
    """``[failslow]``: the fail-slow detector's thresholds and its migrations
    (slurm_omni.policy.failslow.FailSlowConfig; defaults measured in docs/failslow.md)."""
    manager: ManagerSite
    use_spank_plugin: bool = True
    """spank/omni_spank.so is in plugstack.conf: the step gets ``--omni-stage``/``--omni-ckpt``."""
    python: Path | None = None
    """The Python with slurm-omni installed that batch scripts run on the compute nodes (``PYTHON -m
    slurm_omni.cli.main`` for ``omni``, ``{python}`` in a job's command). Unset: the Python that renders
    the script (``sys.executable``), by absolute path: PATH need not hold ``omni``."""

    def __post_init__(self) -> None:
        check_slurm_name("cluster", self.cluster)
        if not self.stages:
            raise ConfigError("stages is empty (expected at least one [stages.NAME] table)")
        for name in self.stages:
            check_slurm_name("stage name", name)
        if self.python is not None and not self.python.is_absolute():
            raise ConfigError(f"python = {str(self.python)!r} is not allowed (expected an absolute path: batch "
                              "scripts run on other nodes, from another folder)")


def site_path(explicit: Path | None = None) -> Path:
    """The site config to use: the explicit one, else $OMNI_SITE_CONFIG, else /etc/slurm-omni."""
    if explicit is not None:
        return explicit
    env = os.environ.get(SITE_ENV)
    return Path(env) if env else DEFAULT_SITE_PATH


def load_site(path: Path) -> SiteConfig:
    if not path.exists():
        raise ConfigError(f"site: couldn't read {path}: no such file (pass --site or set ${SITE_ENV}; "
                          f"site-config/omni.toml is an annotated example)")
    return load_dataclass(SiteConfig, read_toml(path), source=str(path))
