"""Inputs of the goodput simulator: defaults, a TOML file that overrides them, measured files.

Defaults live in the dataclasses below (each field says where its number comes from). A TOML file
(``--config``) may override any of them, table by table (``[run]``, ``[storage]``, ``[start]``,
``[manual]``, ``[slurm]``, ``[omni]``, ``[queue]``, ``[alloc]``, ``[memory]``), loaded strictly. Measured files override on top:

``--drill-json FILE`` (written by ``omni drill``; all keys optional, seconds)::

    {"detection_s": 3.1,                 # fault -> confirmed, for every fault kind ...
     "detection_by_kind": {"node_down": 4.2, "task_crash": 2.9, "hang": 31.0},  # ... or per kind
     "resubmit_s": 0.9,                  # confirmed -> resubmitted
     "start_s": 6.5,                     # resubmitted -> running (pending + launch + init)
     "restore_s": 1.8,                   # running -> first step after restore
     "recovery_s": 9.2,                  # confirmed -> first step; used only without the three above
     "nodes": 4, "gpus": 0,              # size of the drilled job (recorded, not used)
     "source": "omni drill --matrix ...", "runs": [...]}   # free text and raw records (ignored)

``--ckpt-json FILE`` (written by the checkpoint benchmark; one process's save and restore)::

    {"bytes": 1073741824,                # state bytes the process snapshotted and wrote
     "blocking_s": 0.21,                 # time save() blocked training (the snapshot)
     "persist_s": 1.4,                   # save() -> durable (complete marker written)
     "restore_full_s": 1.1,              # restore() -> every module and the optimizer loaded
     "restore_critical_s": 0.3,          # restore() -> critical modules loaded
     "critical_bytes": 268435456,        # optional: bytes of the critical modules
     "memory_bytes": 1073807360,         # optional: bytes of the memory tier's copies restored ...
     "memory_restore_s": 0.35,           # ... restore() from the node's own memory tier, every unit
     "peer_bytes": 536936448,            # optional: bytes of a shard restored from a peer's memory ...
     "peer_restore_s": 0.31,             # ... restore() on a replacement node, the shard sent by its peer
     "source": "bench/ckpt_bench.py ..."}

``python bench/ckpt_bench.py --goodput-json OUT`` writes one (its medians; ``--memory``: the memory
tier's snapshot, its restore from the node's own memory and from a peer's; ``--only peer``: the peer's).

``--scale-json FILE`` (written by ``bench/scale_bench.py``: per size, path and fault, the recovery's
phases): detection (fault -> confirmed, per fault kind) and the job start (srun to every task
running, the rendezvous, the first step) fitted on a log-log line over the sizes measured (64 nodes
and up when two of them were) and extrapolated to the run's node count from the largest one; the
heartbeat scan is inside the measured detection. Each input says "measured, extrapolated from N
nodes" with the slope and the file.

``--timeline FILE``: the manager's recovery timeline (see ``slurm_omni.report.timeline``); the
medians of its recoveries fill detection, resubmit, start and restore like a drill file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_omni.config.schema import load_dataclass, read_toml
from slurm_omni.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """The large run (Llama 3 405B pre-training: 16,384 H100, TP 8, PP 16, DP 128)."""

    gpus: int = 16384
    gpus_per_node: int = 8
    tensor_parallel: int = 8
    pipeline_parallel: int = 16
    days: float = 54.0
    interruptions: float = 419.0
    """Expected unexpected interruptions over ``days`` (Llama 3: 419)."""
    params: float = 405e9
    weight_bytes_per_param: float = 2.0
    """bf16 weights."""
    optimizer_bytes_per_param: float = 12.0
    """fp32 master weights + Adam first and second moments, sharded over data parallelism."""
    step_time_s: float = 6.0
    """16M tokens per step at ~400 TFLOP/s per GPU: 6 x 405e9 x 16e6 / (16384 x 400e12) = 5.9 s."""
    spare_nodes: int = 16
    """Healthy nodes outside the job that a recovery may take."""
    repair_s: float = 86400.0
    """A replaced node returns to service (the cluster's spare pool, the partition) after this long.
    An assumption (a GPU or board swapped and the node burnt in again within a day); no public figure
    for the Llama 3 cluster. With pools it bounds a pool's wait (``models.PolicyCosts.pool_wait_s``)."""

    def __post_init__(self) -> None:
        model = self.tensor_parallel * self.pipeline_parallel
        if min(self.gpus, self.gpus_per_node, model) < 1 or self.gpus % model or model % self.gpus_per_node:
            raise ConfigError(f"gpus = {self.gpus}, tp x pp = {model}, gpus_per_node = {self.gpus_per_node}: "
                              "need gpus divisible by tp x pp, and tp x pp by gpus_per_node")
        if self.days <= 0 or self.interruptions < 0 or self.step_time_s <= 0 or self.repair_s < 0:
            raise ConfigError("days and step_time_s must be positive, interruptions and repair_s >= 0")
        if self.spare_nodes < 0:
            raise ConfigError(f"spare_nodes = {self.spare_nodes} must be >= 0")

    @property
    def wall_s(self) -> float:
        return self.days * 86400.0

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.gpus // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def nodes_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel // self.gpus_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class StorageConfig:
    """Shared storage and host copies (bytes per second)."""

    aggregate_write_bw: float = 2e12
    """Llama 3's Tectonic: 2 TB/s sustained (7 TB/s peak)."""
    aggregate_read_bw: float = 2e12
    node_write_bw: float = 2e9
    """One node's client write rate; replaced by the checkpoint benchmark's bytes / persist_s."""
    node_read_bw: float = 5e9
    """One node's client read rate; replaced by the benchmark's bytes / restore_full_s."""
    host_copy_bw: float = 25e9
    """GPU -> pinned host copy per GPU (PCIe Gen5 x16 in practice); replaced by the benchmark's
    bytes / blocking_s."""
    critical_read_bw: float | None = None
    """Read rate of the critical modules when the benchmark measured it (critical_bytes /
    restore_critical_s); None: node_read_bw."""
    memory_read_bw: float | None = None
    """Restore rate from a node's own memory tier (``[training.checkpoint] memory_tier``, issue 22):
    the checkpoint benchmark's memory_bytes / memory_restore_s. None: no memory tier (every rank of a
    relaunch reads the shared file system). With it, an in-allocation relaunch's survivors read their
    state from memory and only the replacement node reads the file system (alone: its own client's
    rate, not a share of the aggregate)."""
    peer_read_bw: float | None = None
    """Restore rate of a replacement node from its peer's memory (issue 22: the shard sent by the keeper
    that holds its replica, received straight into the tensors): the checkpoint benchmark's peer_bytes /
    peer_restore_s. With the memory tier, the replacement node then reads its state from its peer at this
    rate instead of the file system. None: not measured (the replacement reads the file system)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v <= 0:
                raise ConfigError(f"{f.name} = {v} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class StartConfig:
    """Job start (resubmitted -> running) on the large cluster."""

    start_small_s: float = 15.0
    """Start on the small drill cluster (pending + srun launch + imports); replaced by the drill's
    start_s."""
    start_at_scale_s: float | None = None
    """The start (srun to every task running, rendezvous, first step) at the run's node count, from
    ``--scale-json``'s fitted growth; it replaces ``start_small_s`` (the communicator set-up below
    still comes on top: the scale lane's ranks have none). None: not measured."""
    init_s_per_1k_gpus: float = 4.0
    """Added per 1,000 GPUs: process-group and NCCL communicator set-up, imports from a shared file
    system at 16k processes (about a minute at 16k GPUs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ManualConfig:
    """(a) A person restarts from the hourly checkpoint."""

    human_detect_s: float = 1800.0
    """Mean time until someone notices (exponential: a page at night takes long)."""
    human_fix_s: float = 1200.0
    """Read logs, find and exclude the bad node, edit the host list, resubmit."""
    ckpt_interval_s: float = 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmConfig:
    """(b) Slurm 22.05's own requeue (JobRequeue=1, --requeue, RequeueExit for aborted jobs).

    Generous to Slurm: a node health check (HealthCheckProgram) is assumed to drain a node with a
    bad GPU before the requeued job could land on it again; full synchronous restore."""

    slurmd_timeout_s: float = 300.0
    """SlurmdTimeout default: a dead host is DOWN 300 s after its last answer, plus the phase of
    the ping that notices (pings every SlurmdTimeout/3)."""
    nccl_timeout_s: float = 600.0
    """A crashed task leaves its peers blocked in a collective until NCCL's watchdog aborts them
    (torch's default process-group timeout, 10 min); then the job exits and RequeueExit requeues."""
    hang_timeout_s: float = 1800.0
    """A hang is noticed only by a long timeout (the 30 min NCCL timeout many launchers still set)."""
    requeue_pending_s: float = 60.0
    """Requeue -> scheduled: epilogs on every node, then the next backfill pass (bf_interval 30 s)."""
    ckpt_interval_s: float = 1800.0


@dataclass(frozen=True, kw_only=True, slots=True)
class OmniConfig:
    """(c) slurm-omni: two-level confirmation, replacement or shrink, async checkpoints."""

    detect_node_down_s: float = 5.0
    """Fault -> confirmed; ConfirmConfig's windows with 2 s heartbeats (stale after 2.5 beats)."""
    detect_task_crash_s: float = 5.0
    detect_hang_s: float | None = None
    """A measured hang confirmation; at scale the larger of this and ConfirmConfig's hang rule at
    the run's step time, max(hang_factor x step, floor) (the rule scales with the step time)."""
    resubmit_s: float = 2.0
    """Confirmed -> resubmitted: plan (<50 ms at 10k nodes, bench/plan_bench.py) + scontrol."""
    restore_small_s: float = 2.0
    """Running -> first step on the drill cluster; kept as a fixed overhead at scale."""
    heartbeat_read_s: float = 2e-4
    """The manager reads one heartbeat file per rank per poll; added to detection at scale."""
    ckpt_interval_s: float | None = None
    """None: max(Young/Daly sqrt(2 x blocking x MTBF), persist time, storage-share floor)."""
    storage_share: float = 0.05
    """Average share of the aggregate write bandwidth checkpoints may take (they hurt other jobs)."""
    shrink: bool = True
    """Drop a data-parallel replica when no spare is free (else wait, like the others)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueConfig:
    """The queue wait a job pays when it leaves its allocation: every resubmission (a, c, and the
    in-allocation mode's fallback) and Slurm's requeue (b) go back into the queue.

    The wait is lognormal: ``median_s x exp(sigma x z)`` with z standard normal (the event's own
    ``queue_draw``). Queue waits of large jobs are long-tailed; the lognormal is the usual fit. The
    defaults are an assumption, not a measurement: "for a 2,000-node job, often hours" (issue 13), a
    median of one hour, and sigma 1 puts the 90th percentile at 3.6 x the median. ``median_s = 0``:
    no queue (the model before issue 13)."""

    median_s: float = 3600.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0:
            raise ConfigError(f"queue: median_s = {self.median_s}, sigma = {self.sigma} must not be negative")


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocConfig:
    """(d) slurm-omni in the allocation: the job holds idle spare nodes (paid for, node-seconds) and
    its step supervisor relaunches on survivors plus a spare, inside the same Slurm job: no queue.
    Out of spares it shrinks (the elastic resume keeps the global batch) down to
    ``min_dp_fraction`` of its data-parallel size; below that it is resubmitted, pays the queue
    wait, and starts again full size with its spares."""

    spares_per_100: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
    """Spares per 100 job nodes to compare (the printout's rows)."""
    relaunch_small_s: float = 3.0
    """Confirmed -> the relaunched step running on the drill cluster (warm standbys: imports done);
    issue 13's goal for fault -> first step, measured by bench/recovery_bench.py. At scale the
    communicator set-up (``start.init_s_per_1k_gpus``), the restore and the first step come on top."""
    min_dp_fraction: float = 0.9
    """Shrink inside the allocation while at least this fraction of the replicas is left."""
    time_limit_h: float = 24.0
    """The allocation's time limit in the comparison printed under "at a time limit" (the other
    rows have none: the Llama 3 run was on its owner's cluster). An assumption: a maximum wall time
    common at shared centres, not measured; set it to your site's."""
    successor_lead_s: float | None = None
    """With pools, the successor allocation is requested this long before the time limit; None: the
    supervisor's own policy (``slurm_omni.policy.pools.successor_lead_s``: 1.5 times the site's
    expected queue wait plus one relaunch), the expected wait the queue's median (the time-limit
    section also prints its 90th and 99th percentile)."""

    def __post_init__(self) -> None:
        if self.time_limit_h < 0 or (self.successor_lead_s is not None and self.successor_lead_s < 0):
            raise ConfigError(f"alloc: time_limit_h = {self.time_limit_h} and successor_lead_s = "
                              f"{self.successor_lead_s} must not be negative")
        if not self.spares_per_100 or any(s < 0 for s in self.spares_per_100):
            raise ConfigError(f"alloc: spares_per_100 = {list(self.spares_per_100)}: need values >= 0")
        if self.relaunch_small_s < 0 or not 0 < self.min_dp_fraction <= 1:
            raise ConfigError(f"alloc: relaunch_small_s = {self.relaunch_small_s} must be >= 0 and "
                              f"min_dp_fraction = {self.min_dp_fraction} in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    """The memory tier (issue 22; ``[training.checkpoint] memory_tier``): every rank's snapshot kept in its
    node's memory and a ring peer's, every ``memory_every`` steps, and on the file system every
    ``files_every``-th of them; a relaunch inside the allocation restores the survivors from their own
    memory and the replacement node from its peer's. The two cadences are chosen as the runtime chooses
    them (``slurm_omni.policy.snapshot_cadence.plan_cadence``, from the snapshot's blocking, the step and
    the file system write at scale) unless set here."""

    read_bw: float = 2.8e9
    """Restore rate per node from a copy in the node's memory: measured 2.8 GB/s, 1 GiB restored from a
    tmpfs with huge pages (``python bench/ckpt_bench.py --memory --memory-dir <tmpfs huge=within_size>``,
    docs/checkpoint.md "The memory tier", 2-core machine). ``--ckpt-json`` with ``memory_restore_s``
    replaces it (``storage.memory_read_bw``)."""
    peer_bw: float = 12.5e9
    """One node's copy to or from its ring peer (the keepers' TCP): an assumption, a 100 Gb/s front-end
    NIC per node (the collectives' NICs are not used). A replacement node's restore uses
    ``storage.peer_read_bw`` instead where ``--ckpt-json`` measured it (``peer_restore_s``)."""
    memory_every: int = 0
    """A snapshot into memory every this many steps; 0: the runtime's policy (blocking under 1 %)."""
    files_every: int = 0
    """Every this-many-th memory snapshot also to the file system; 0: the runtime's policy (about as
    often as slurm-omni checkpoints without the tier, fewer where a write would block)."""

    def __post_init__(self) -> None:
        if not self.read_bw > 0 or not self.peer_bw > 0:
            raise ConfigError(f"memory: read_bw = {self.read_bw}, peer_bw = {self.peer_bw} (bytes/s, positive)")
        if self.memory_every < 0 or self.files_every < 0:
            raise ConfigError(f"memory: memory_every = {self.memory_every}, files_every = {self.files_every} "
                              f"(0: the runtime's policy, or more)")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    run: RunConfig = field(default_factory=RunConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    start: StartConfig = field(default_factory=StartConfig)
    manual: ManualConfig = field(default_factory=ManualConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    omni: OmniConfig = field(default_factory=OmniConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    alloc: AllocConfig = field(default_factory=AllocConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where one input came from: ``source`` is "default", "config FILE" or "measured FILE"."""

    name: str
    value: float
    source: str


def load_config(path: Path | None) -> tuple[SimConfig, list[Provenance]]:
    if path is None:
        return SimConfig(), []
    cfg = load_dataclass(SimConfig, read_toml(path), source=str(path))
    table = read_toml(path)
    prov = [Provenance(f"{section}.{key}", float(value), f"config {path}")
            for section, keys in table.items() for key, value in keys.items()
            if isinstance(value, (int, float))]
    return cfg, prov


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"goodput: couldn't read {what} {path}: no such file") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"goodput: couldn't parse {what} {path}: {e.msg} at line {e.lineno}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"goodput: couldn't use {what} {path}: expected a JSON object")
    return data


def _seconds(data: dict[str, Any], key: str, path: Path) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"goodput: couldn't use {path}: {key} = {value!r} (expected seconds >= 0)")
    return float(value)


DRILL_KEYS = {"detection_s", "detection_by_kind", "resubmit_s", "start_s", "restore_s", "recovery_s",
              "nodes", "gpus", "source", "runs"}
CKPT_KEYS = {"bytes", "blocking_s", "persist_s", "restore_full_s", "restore_critical_s", "critical_bytes",
             "memory_bytes", "memory_restore_s", "peer_bytes", "peer_restore_s", "source"}


def apply_drill(cfg: SimConfig, path: Path) -> tuple[SimConfig, list[Provenance]]:
    data = _read_json(path, "drill file")
    unknown = sorted(set(data) - DRILL_KEYS)
    if unknown:
        raise ConfigError(f"goodput: couldn't use drill file {path}: unknown key {unknown[0]!r} "
                          f"(allowed: {', '.join(sorted(DRILL_KEYS))})")
    by_kind = data.get("detection_by_kind") or {}
    if not isinstance(by_kind, dict) or set(by_kind) - {"node_down", "task_crash", "hang"}:
        raise ConfigError(f"goodput: couldn't use drill file {path}: detection_by_kind must map "
                          "node_down, task_crash, hang to seconds")
    detection = _seconds(data, "detection_s", path)
    values: dict[str, float | None] = {
        "detect_node_down_s": _seconds(by_kind, "node_down", path) if "node_down" in by_kind else detection,
        "detect_task_crash_s": _seconds(by_kind, "task_crash", path) if "task_crash" in by_kind else detection,
        "detect_hang_s": _seconds(by_kind, "hang", path),
        "resubmit_s": _seconds(data, "resubmit_s", path),
        "restore_small_s": _seconds(data, "restore_s", path),
    }
    start = _seconds(data, "start_s", path)
    recovery = _seconds(data, "recovery_s", path)
    if recovery is not None and values["resubmit_s"] is None and start is None and values["restore_small_s"] is None:
        # Only the total is known: keep all of it as a fixed overhead, scale terms come on top.
        values.update(resubmit_s=recovery, restore_small_s=0.0)
        start = 0.0
    return _override(cfg, values, start, f"measured {path}")


def apply_timeline(cfg: SimConfig, path: Path) -> tuple[SimConfig, list[Provenance]]:
    from slurm_omni.report.timeline import load_timeline

    recoveries = load_timeline(path).recoveries
    if not recoveries:
        raise ConfigError(f"goodput: couldn't use timeline {path}: it holds no recovery")

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    detection = median([r.detection_s for r in recoveries])
    values = {
        "detect_node_down_s": detection, "detect_task_crash_s": detection,
        "resubmit_s": median([r.resubmit_s for r in recoveries]),
        "restore_small_s": median([r.restore_s for r in recoveries]),
    }
    return _override(cfg, values, median([r.start_s for r in recoveries]), f"measured {path}")


SCALE_FAULTS = {"node": "node_down", "crash": "task_crash", "hang": "hang"}
"""The scale bench's fault -> the simulator's interruption kind."""


@dataclass(frozen=True, slots=True)
class Fit:
    """A log-log line through measured (nodes, seconds), extrapolated from the largest size."""

    sizes: tuple[int, ...]
    values: tuple[float, ...]
    slope: float
    """Least squares over ``sizes``; a negative slope (noise) counts as flat."""

    def at(self, nodes: int) -> float:
        return self.values[-1] * (nodes / self.sizes[-1]) ** max(self.slope, 0.0)

    def source(self, path: Path) -> str:
        return (f"measured, extrapolated from {self.sizes[-1]} nodes (log-log slope {self.slope:+.2f} over "
                f"{', '.join(map(str, self.sizes))} nodes; {path})")


def fit_growth(points: dict[int, float]) -> Fit | None:
    """The fit over the sizes of 64 nodes and up when two were measured, else over all; None with
    fewer than two sizes."""
    usable = {n: v for n, v in points.items() if v > 0}
    large = {n: v for n, v in usable.items() if n >= 64}
    chosen = large if len(large) >= 2 else usable
    if len(chosen) < 2:
        return None
    sizes = tuple(sorted(chosen))
    xs = [math.log(n) for n in sizes]
    ys = [math.log(chosen[n]) for n in sizes]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return Fit(sizes, tuple(chosen[n] for n in sizes), slope)


def _scale_points(sizes: list[Any], fault: str, phases: tuple[str, ...], path: Path) -> dict[int, float]:
    """Nodes -> the sum of ``phases`` of ``fault``'s recovery, the in-allocation path where it was
    measured, else the allocation path."""
    out: dict[int, float] = {}
    for size in sizes:
        if not isinstance(size, dict) or not isinstance(size.get("nodes"), int) or not isinstance(size.get("runs"), list):
            raise ConfigError(f"goodput: couldn't use scale file {path}: every size needs nodes and runs")
        for want in ("inalloc", "alloc"):
            runs = [r for r in size["runs"] if isinstance(r, dict) and r.get("path") == want
                    and r.get("fault") == fault and not r.get("na")]
            got = [r.get("phases", {}).get(p) for r in runs for p in phases]
            if runs and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in got):
                out[size["nodes"]] = float(sum(got))
                break
    return out


def apply_scale(cfg: SimConfig, path: Path) -> tuple[SimConfig, list[Provenance]]:
    """Detection per kind and the job start at the run's node count from the scale bench's sizes."""
    data = _read_json(path, "scale file")
    sizes = data.get("sizes")
    if not isinstance(sizes, list):
        raise ConfigError(f"goodput: couldn't use scale file {path}: no sizes (written by bench/scale_bench.py?)")
    nodes = cfg.run.nodes
    omni: dict[str, float] = {}
    prov: list[Provenance] = []
    for fault, kind in SCALE_FAULTS.items():
        fit = fit_growth(_scale_points(sizes, fault, ("detect", "confirm"), path))
        if fit is not None:
            omni[f"detect_{kind}_s"] = fit.at(nodes)
            prov.append(Provenance(f"omni.detect_{kind}_s", omni[f"detect_{kind}_s"], fit.source(path)))
    start: list[Fit] = [f for fault in SCALE_FAULTS
                        if (f := fit_growth(_scale_points(sizes, fault, ("launch", "rendezvous", "first_step"),
                                                          path))) is not None]
    if not omni and not start:
        raise ConfigError(f"goodput: couldn't use scale file {path}: it holds no two sizes with the same fault "
                          "recovered (a fit needs two)")
    if omni:   # the supervisor's heartbeat polls are inside the measured detection
        omni["heartbeat_read_s"] = 0.0
        prov.append(Provenance("omni.heartbeat_read_s", 0.0,
                               f"measured: inside the detection above ({path})"))
    cfg = dataclasses.replace(cfg, omni=dataclasses.replace(cfg.omni, **omni))  # type: ignore[arg-type]
    if start:   # the slowest fault's relaunch: a start is every task of the job, whatever ended the last
        fit = max(start, key=lambda f: f.at(nodes))
        cfg = dataclasses.replace(cfg, start=dataclasses.replace(cfg.start, start_at_scale_s=fit.at(nodes)))
        prov.append(Provenance("start.start_at_scale_s", fit.at(nodes), fit.source(path)))
    return cfg, prov


def _override(cfg: SimConfig, omni: dict[str, float | None], start: float | None,
              source: str) -> tuple[SimConfig, list[Provenance]]:
    known = {k: v for k, v in omni.items() if v is not None}
    prov = [Provenance(f"omni.{k}", v, source) for k, v in known.items()]
    omni_cfg: OmniConfig = dataclasses.replace(cfg.omni, **known)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, omni=omni_cfg)
    if start is not None:
        cfg = dataclasses.replace(cfg, start=dataclasses.replace(cfg.start, start_small_s=start))
        prov.append(Provenance("start.start_small_s", start, source))
    return cfg, prov


def apply_ckpt(cfg: SimConfig, path: Path) -> tuple[SimConfig, list[Provenance]]:
    data = _read_json(path, "checkpoint benchmark file")
    unknown = sorted(set(data) - CKPT_KEYS)
    if unknown:
        raise ConfigError(f"goodput: couldn't use checkpoint file {path}: unknown key {unknown[0]!r} "
                          f"(allowed: {', '.join(sorted(CKPT_KEYS))})")
    size = data.get("bytes")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
        raise ConfigError(f"goodput: couldn't use checkpoint file {path}: bytes = {size!r} (expected > 0)")
    source = f"measured {path}"
    bws: dict[str, float] = {}
    for key, bw in (("blocking_s", "host_copy_bw"), ("persist_s", "node_write_bw"),
                    ("restore_full_s", "node_read_bw")):
        seconds = _seconds(data, key, path)
        if seconds:
            bws[bw] = size / seconds
    full, critical = _seconds(data, "restore_full_s", path), _seconds(data, "restore_critical_s", path)
    if full is not None and critical is not None and critical > full:
        raise ConfigError(f"goodput: couldn't use checkpoint file {path}: restore_critical_s = {critical} "
                          f"exceeds restore_full_s = {full}")
    critical_bytes = data.get("critical_bytes")
    if critical and isinstance(critical_bytes, (int, float)) and critical_bytes > 0:
        bws["critical_read_bw"] = critical_bytes / critical
    memory = _seconds(data, "memory_restore_s", path)
    memory_bytes = data.get("memory_bytes", size)
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float)) or memory_bytes <= 0:
        raise ConfigError(f"goodput: couldn't use checkpoint file {path}: memory_bytes = {memory_bytes!r} "
                          f"(expected > 0)")
    if memory:
        bws["memory_read_bw"] = memory_bytes / memory
    peer = _seconds(data, "peer_restore_s", path)
    peer_bytes = data.get("peer_bytes", size)
    if isinstance(peer_bytes, bool) or not isinstance(peer_bytes, (int, float)) or peer_bytes <= 0:
        raise ConfigError(f"goodput: couldn't use checkpoint file {path}: peer_bytes = {peer_bytes!r} "
                          f"(expected > 0)")
    if peer:
        bws["peer_read_bw"] = peer_bytes / peer
    prov = [Provenance(f"storage.{k}", v, source) for k, v in bws.items()]
    return dataclasses.replace(cfg, storage=dataclasses.replace(cfg.storage, **bws)), prov
