"""Scaling models: from the inputs (small drills, one-process benchmark, defaults) to per-event
costs of each policy on the large run.

Bytes at scale (TP x PP model shards replicated over DP replicas, optimizer sharded over DP):

- written per GPU per checkpoint: the unique state spread over all GPUs,
  ``params x (weight + optimizer bytes) / gpus`` (each replica writes 1/DP of the weights);
- read per node on restore: every GPU needs its whole TP x PP weight shard and its optimizer
  shard, ``gpus_per_node x params x (weight / (tp x pp) + optimizer / gpus)``;
- critical bytes per node: the weight part of that (the optimizer loads behind the first
  forward/backward, ``slurm_omni.checkpoint``'s critical-module-first restore).

Times at scale:

- blocking (snapshot) = bytes written per GPU / host copy bandwidth (GPUs copy in parallel);
- persist = bytes written per node / min(node write bandwidth, aggregate write / nodes);
- restore = bytes read per node / min(node read bandwidth, aggregate read / nodes), critical part
  at the critical read bandwidth when measured; plus the small run's fixed restore overhead;
- job start = start on the small cluster + init seconds per 1,000 GPUs x GPUs / 1,000;
- slurm-omni detection = measured detection + one heartbeat file read per rank per poll; a hang
  confirms by ConfirmConfig's rule at the large run's step time (a measured hang detection is
  used only when it is longer);
- a synchronous checkpoint (policies a, b) blocks for snapshot + persist.

Not modelled: placement quality (topology-aware replacement keeps throughput; a far replacement
would slow the others by an amount we have not measured), false alarms, failures during recovery
(an interruption that arrives while the job is down is absorbed; it is counted, not charged).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Literal

from bench.goodput.failures import KINDS, kind_shares
from bench.goodput.inputs import SimConfig
from slurm_omni.policy.confirm import ConfirmConfig
from slurm_omni.policy.pools import successor_lead_s
from slurm_omni.policy.snapshot_cadence import Cadence, plan_cadence

Spread = Literal["uniform", "exponential"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyCosts:
    """Per-event costs of one policy on the large run (seconds).

    Detection of an event of kind k = ``detect_base[k] + detect_spread[k] x g(draw)`` where g is
    the draw itself (uniform, e.g. the phase of a ping) or ``-ln(1 - draw)`` (exponential, mean 1)."""

    name: str
    detect_base: dict[str, float]
    detect_spread: dict[str, float] = field(default_factory=dict)
    spread: Spread = "uniform"
    resubmit_s: float
    pending_s: float = 0.0
    start_s: float
    restore_s: float
    first_step_s: float
    ckpt_interval_s: float
    ckpt_blocking_s: float
    ckpt_persist_s: float = 0.0
    """Background persist after the snapshot (async only); 0 for a synchronous save."""
    ckpt_async: bool = False
    shrink: bool = False
    grow_save_s: float = 0.0
    """A planned grow first saves synchronously (snapshot + persist)."""
    queue_median_s: float = 0.0
    """Each trip through the queue waits ``queue_s(draw)``: lognormal with this median..."""
    queue_sigma: float = 0.0
    """...and this log-standard deviation (inputs.QueueConfig)."""
    spares: int | None = None
    """In-allocation mode: spare nodes the allocation holds idle (None: the policy resubmits)."""
    relaunch_s: float = 0.0
    """In-allocation mode: confirmed -> first step after a relaunch inside the allocation."""
    min_replicas: int = 1
    """In-allocation mode: shrink inside the allocation down to this many replicas, then resubmit."""
    relaunch_restore_s: float = 0.0
    """In-allocation mode: the restore part of a relaunch (charged as restore, on top of relaunch_s)."""
    batch_host: bool = False
    """In-allocation mode: the supervisor runs in the batch script, so losing the first node ends
    the allocation (a resubmission); False: the control plane is outside and recovers it inside."""
    pools: bool = False
    """In-allocation mode: running shrunk, ask for a pool allocation of the missing nodes and grow
    back when it starts (sim module docstring)."""
    repair_s: float = math.inf
    """A failed node is back in service after this long: a pool's wait never exceeds it."""
    time_limit_s: float = 0.0
    """In-allocation mode: the allocation's time limit (0: none)."""
    successor_lead_s: float | None = None
    """With a time limit: request the successor allocation this long before it (None: resubmit at
    the limit and wait in the queue)."""
    files_interval_s: float | None = None
    """The memory tier: the file system's checkpoint interval (``ckpt_interval_s`` is then the memory
    snapshots'). A relaunch inside the allocation restores from memory; a new allocation (a
    resubmission) finds no memory of the job and loses the work since the last file system
    checkpoint. None: every checkpoint is on the file system."""

    def __post_init__(self) -> None:
        if self.ckpt_interval_s <= 0:
            raise ValueError(f"{self.name}: ckpt_interval_s = {self.ckpt_interval_s} must be positive")
        if self.time_limit_s > 0 and self.successor_lead_s is not None and self.successor_lead_s >= self.time_limit_s:
            raise ValueError(f"{self.name}: successor_lead_s = {self.successor_lead_s} must be shorter than "
                             f"time_limit_s = {self.time_limit_s}")

    def queue_s(self, draw: float) -> float:
        """The queue wait of one trip: ``median x exp(sigma x z)``, z the standard normal quantile of ``draw``."""
        if self.queue_median_s <= 0:
            return 0.0
        z = statistics.NormalDist().inv_cdf(min(max(draw, 1e-12), 1 - 1e-12))
        return self.queue_median_s * math.exp(self.queue_sigma * z)

    def pool_wait_s(self, draw: float) -> float:
        """A pool allocation's wait: the queue-wait model at the event's own ``pool_draw``, never
        longer than the failed node's return to service (``repair_s``)."""
        return min(self.queue_s(draw), self.repair_s)

    def detection_s(self, kind: str, draw: float) -> float:
        spread = self.detect_spread.get(kind, 0.0)
        g = draw if self.spread == "uniform" else -math.log1p(-min(draw, 1 - 1e-12))
        return self.detect_base[kind] + spread * g

    @property
    def restart_s(self) -> float:
        return self.resubmit_s + self.pending_s + self.start_s + self.restore_s + self.first_step_s


@dataclass(frozen=True, slots=True)
class Scaled:
    """The three policies' costs, plus the model's intermediate figures for the printout."""

    manual: PolicyCosts
    slurm: PolicyCosts
    omni: PolicyCosts
    figures: dict[str, float]

    @property
    def policies(self) -> tuple[PolicyCosts, PolicyCosts, PolicyCosts]:
        return self.manual, self.slurm, self.omni


def scale(cfg: SimConfig) -> Scaled:
    run, st = cfg.run, cfg.storage
    state_per_param = run.weight_bytes_per_param + run.optimizer_bytes_per_param
    write_per_gpu = run.params * state_per_param / run.gpus
    write_per_node = write_per_gpu * run.gpus_per_node
    model_shards = run.tensor_parallel * run.pipeline_parallel
    weights_per_node = run.gpus_per_node * run.params * run.weight_bytes_per_param / model_shards
    optim_per_node = run.gpus_per_node * run.params * run.optimizer_bytes_per_param / run.gpus
    read_bw = min(st.node_read_bw, st.aggregate_read_bw / run.nodes)
    write_bw = min(st.node_write_bw, st.aggregate_write_bw / run.nodes)
    critical_bw = min(st.critical_read_bw or st.node_read_bw, st.aggregate_read_bw / run.nodes)

    blocking = write_per_gpu / st.host_copy_bw
    persist = write_per_node / write_bw
    restore_full = (weights_per_node + optim_per_node) / read_bw
    restore_critical = weights_per_node / critical_bw
    base = cfg.start.start_small_s if cfg.start.start_at_scale_s is None else cfg.start.start_at_scale_s
    start = base + cfg.start.init_s_per_1k_gpus * run.gpus / 1000.0
    step = run.step_time_s
    sync_save = blocking + persist
    mtbf = run.wall_s / run.interruptions if run.interruptions else math.inf

    om = cfg.omni
    confirm = ConfirmConfig()
    # The hang rule scales with the step time: a drill's stall on a small, fast run confirms sooner
    # than the same rule would at the large run's step time, so the measured value is a floor only.
    hang = max(confirm.hang_factor * step, confirm.hang_floor_s, om.detect_hang_s or 0.0)
    scan = om.heartbeat_read_s * run.gpus
    interval = om.ckpt_interval_s
    if interval is None:
        young_daly = math.sqrt(2 * blocking * mtbf) if math.isfinite(mtbf) else math.inf
        storage_floor = write_per_node * run.nodes / (om.storage_share * st.aggregate_write_bw)
        interval = max(min(young_daly, 3600.0), persist, storage_floor)
    else:
        interval = max(interval, persist)  # at most one save in flight

    queue = {"queue_median_s": cfg.queue.median_s, "queue_sigma": cfg.queue.sigma}
    manual = PolicyCosts(
        **queue, name="(a) manual restart, hourly ckpt", detect_base=dict.fromkeys(KINDS, 0.0),
        detect_spread=dict.fromkeys(KINDS, cfg.manual.human_detect_s), spread="exponential",
        resubmit_s=cfg.manual.human_fix_s, start_s=start, restore_s=restore_full, first_step_s=step,
        ckpt_interval_s=cfg.manual.ckpt_interval_s, ckpt_blocking_s=sync_save)
    sl = cfg.slurm
    slurm = PolicyCosts(
        **queue, name="(b) Slurm requeue", spread="uniform",
        detect_base={"node_down": sl.slurmd_timeout_s, "task_crash": sl.nccl_timeout_s,
                     "hang": sl.hang_timeout_s},
        detect_spread={"node_down": sl.slurmd_timeout_s / 3},
        resubmit_s=0.0, pending_s=sl.requeue_pending_s, start_s=start, restore_s=restore_full,
        first_step_s=step, ckpt_interval_s=sl.ckpt_interval_s, ckpt_blocking_s=sync_save)
    omni = PolicyCosts(
        **queue, name="(c) slurm-omni resubmission",
        detect_base={"node_down": om.detect_node_down_s + scan, "task_crash": om.detect_task_crash_s + scan,
                     "hang": hang + scan},
        resubmit_s=om.resubmit_s, start_s=start, restore_s=om.restore_small_s + restore_critical,
        first_step_s=step, ckpt_interval_s=interval, ckpt_blocking_s=blocking, ckpt_persist_s=persist,
        ckpt_async=True, shrink=om.shrink, grow_save_s=sync_save)
    shares = kind_shares()
    figures = {
        "write_per_gpu_bytes": write_per_gpu, "write_per_node_bytes": write_per_node,
        "read_per_node_bytes": weights_per_node + optim_per_node, "critical_per_node_bytes": weights_per_node,
        "node_read_bw": read_bw, "node_write_bw": write_bw, "blocking_s": blocking, "persist_s": persist,
        "restore_full_s": restore_full, "restore_critical_s": restore_critical, "start_s": start,
        "omni_ckpt_interval_s": interval, "omni_hang_detect_s": hang, "heartbeat_scan_s": scan,
        "mtbf_s": mtbf, **{f"share_{k}": v for k, v in shares.items()},
        "relaunch_s": in_allocation(cfg, omni, 0).relaunch_s + in_allocation(cfg, omni, 0).relaunch_restore_s,
        "successor_lead_s": successor_lead(cfg, in_allocation(cfg, omni, 0).relaunch_s
                                           + in_allocation(cfg, omni, 0).relaunch_restore_s),
    }
    return Scaled(manual, slurm, omni, figures)


def successor_lead(cfg: SimConfig, relaunch_s: float, queue_wait_s: float | None = None) -> float:
    """How long before the time limit the successor is requested: ``[alloc] successor_lead_s``, else
    the supervisor's own policy (``slurm_omni.policy.pools.successor_lead_s``: the site's expected
    queue wait times its margin, plus one relaunch, ``relaunch_s``) with the site's figure
    ``queue_wait_s``, by default the queue wait's median (what ``elasticity.successor_queue_wait_s``
    defaults to: 1 h)."""
    if cfg.alloc.successor_lead_s is not None:
        return cfg.alloc.successor_lead_s
    return successor_lead_s(cfg.queue.median_s if queue_wait_s is None else queue_wait_s, relaunch_s)


def memory_relaunch_restore(cfg: SimConfig) -> float:
    """An in-allocation relaunch's restore with the memory tier: the survivors read their critical
    modules from their own node's memory, the replacement node from its peer's memory where that rate
    was measured (``peer_read_bw``), else from the shared file system, alone (its client's full rate: no
    other node reads); training starts when the slower has, plus the small run's fixed restore overhead."""
    run, st = cfg.run, cfg.storage
    weights_per_node = run.gpus_per_node * run.params * run.weight_bytes_per_param / (
        run.tensor_parallel * run.pipeline_parallel)
    memory_bw = st.memory_read_bw or st.node_read_bw
    replacement_bw = st.peer_read_bw or min(st.critical_read_bw or st.node_read_bw, st.aggregate_read_bw)
    replacement = weights_per_node / replacement_bw
    return cfg.omni.restore_small_s + max(weights_per_node / memory_bw, replacement)


@dataclass(frozen=True, slots=True)
class MemoryTier:
    """The memory tier at scale (``memory_tier``): the cadence the runtime's policy chooses and what it costs."""

    cadence: Cadence
    interval_s: float
    """Training between two memory snapshots (k steps)."""
    blocking_s: float
    """A memory snapshot's blocking (the host copy), plus each file system write's wait (one persist at
    a time: the snapshot after it waits for the rest of it) spread over the m snapshots of a cycle."""
    persist_s: float
    """A memory snapshot -> durable: the shard written into the node's memory and sent to its ring peer."""
    files_interval_s: float
    restore_s: float
    """A relaunch's restore: survivors from their own memory, the replacement node from its peer's."""
    replacement_s: float


def memory_tier(cfg: SimConfig, omni: PolicyCosts) -> MemoryTier:
    """The memory tier's cadence and costs at scale: ``plan_cadence`` (the runtime's policy) on the
    snapshot's blocking, the step time and the file system write at scale, with the file system about as
    often as slurm-omni checkpoints without the tier (``omni.ckpt_interval_s``), unless ``[memory]`` sets
    them; the model knows the run's time between interruptions, so k is at least Young/Daly's (the
    runtime, which does not know it, takes the 1 % budget alone). Memory snapshots: blocking the host copy; durable once this node's shard is in its memory
    (memory read rate) and at its ring peer (``peer_bw``). A relaunch: the survivors read their critical
    modules from their own memory; the replacement node receives them from its peer's keeper straight
    into its tensors, as ``checkpoint/peer.py`` does (``storage.peer_read_bw`` where a checkpoint file
    measured it, else the slower of ``peer_bw`` and a memory read); training starts when the slower
    has, plus the small run's fixed restore overhead."""
    run, st, mem = cfg.run, cfg.storage, cfg.memory
    step = run.step_time_s
    write_per_gpu = run.params * (run.weight_bytes_per_param + run.optimizer_bytes_per_param) / run.gpus
    write_per_node = write_per_gpu * run.gpus_per_node
    files_persist = omni.ckpt_persist_s
    every_steps = max(1, math.ceil(omni.ckpt_interval_s / step - 1e-9))
    mtbf = run.wall_s / run.interruptions if run.interruptions else 0.0
    cadence = plan_cadence(snapshot_s=omni.ckpt_blocking_s, step_s=step, files_persist_s=files_persist,
                           every_steps=every_steps, memory_every=mem.memory_every, files_every=mem.files_every,
                           mtbf_s=mtbf)
    memory_bw = st.memory_read_bw or mem.read_bw
    persist = write_per_node / memory_bw + write_per_node / mem.peer_bw
    interval = max(cadence.memory_every * step, persist)   # at most one save in flight (sim.segment)
    # memory snapshots go on while a file system write is in flight (the engine's two lanes): only the
    # next file system step waits for it
    wait = max(0.0, files_persist - cadence.files_every_steps * step) if cadence.files_every else 0.0
    blocking = omni.ckpt_blocking_s + (wait / cadence.files_every if cadence.files_every else 0.0)
    weights_per_node = run.gpus_per_node * run.params * run.weight_bytes_per_param / (
        run.tensor_parallel * run.pipeline_parallel)
    # one pass: the keeper's stream is received straight into the tensors and checked as it lands
    # (checkpoint/peer.py), at the measured peer restore rate, else the slower of the link and a memory read
    replacement = weights_per_node / (st.peer_read_bw or min(mem.peer_bw, memory_bw))
    restore = cfg.omni.restore_small_s + max(weights_per_node / memory_bw, replacement)
    files_interval = cadence.files_every_steps * step if cadence.files_every else cfg.run.wall_s
    return MemoryTier(cadence, interval, blocking, persist, files_interval, restore, replacement)


def in_allocation(cfg: SimConfig, omni: PolicyCosts, per_100: float, *, pools: bool = False,
                  time_limit: bool = False, memory: bool | None = None) -> PolicyCosts:
    """(d) slurm-omni's in-allocation mode with ``per_100`` spares per 100 job nodes: detection and
    checkpoints as (c); a relaunch costs the small cluster's relaunch, the communicator set-up at
    scale, the critical-first restore and a step; out of spares and below the minimum data-parallel
    size, (c)'s resubmission with its queue wait. Its supervisor runs in the batch script: losing
    the first node ends the allocation.

    ``pools``: (e) the control plane outside the allocations (issue 20): the first node's loss is
    recovered inside, running shrunk it asks for a pool allocation and grows back, and at a time
    limit a successor allocation requested ``successor_lead`` ahead takes over.
    ``time_limit``: the allocation ends after ``[alloc] time_limit_h`` (else it never ends).
    ``memory``: the memory tier (``memory_tier``: its cadence, lost work and restore); None: only where a
    checkpoint file measured its restore (``storage.memory_read_bw``), and then its restore only."""
    run = cfg.run
    spares = round(per_100 * run.nodes / 100)
    init = cfg.start.init_s_per_1k_gpus * run.gpus / 1000.0
    relaunch = cfg.alloc.relaunch_small_s + init + omni.first_step_s
    name = (f"(e) pools, {per_100:g} spares/100 nodes" if pools
            else f"(d) in allocation, {per_100:g} spares/100 nodes")
    old_model = memory is None and bool(cfg.storage.memory_read_bw)   # the restore from memory only
    restore = memory_relaunch_restore(cfg) if old_model else omni.restore_s
    if old_model:
        name += ", memory tier"
    if memory:
        tier = memory_tier(cfg, omni)
        omni = dataclasses.replace(omni, ckpt_interval_s=tier.interval_s, ckpt_blocking_s=tier.blocking_s,
                                   ckpt_persist_s=tier.persist_s, files_interval_s=tier.files_interval_s)
        restore = tier.restore_s
        name = name.replace(", ", " + memory tier, ", 1)
    return dataclasses.replace(omni, name=name, spares=spares, relaunch_s=relaunch,
                               relaunch_restore_s=restore, batch_host=not pools, pools=pools,
                               repair_s=run.repair_s, time_limit_s=cfg.alloc.time_limit_h * 3600 if time_limit else 0.0,
                               successor_lead_s=successor_lead(cfg, relaunch + restore) if pools and time_limit
                               else None,
                               min_replicas=max(1, math.ceil(cfg.alloc.min_dp_fraction * run.data_parallel)))
