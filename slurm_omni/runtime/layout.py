"""Which part of the job this process is, read from the environment only (never from host names).

The sbatch template (srun over the heterogeneous job) and the SPANK plugin set these; the local
launcher (``slurm_omni.runtime.launch``) sets the same set for tests and demos.

torchrun-style variables:

==================  =========================================================================
RANK                global rank, 0 .. WORLD_SIZE-1 (srun: SLURM_PROCID)
WORLD_SIZE          number of ranks in both components (srun: SLURM_NTASKS)
LOCAL_RANK          rank on this node; picks the CUDA device (srun: SLURM_LOCALID)
MASTER_ADDR         address of rank 0's node, for the rendezvous store
MASTER_PORT         TCP port of the rendezvous store
==================  =========================================================================

OMNI_* variables:

======================  ===============================================================================
OMNI_STAGE              pipeline stage of this rank: 0 = vision encoder + projector (het component 0),
                        1 = text decoder (het component 1). Default: RANK // OMNI_DP_SIZE.
OMNI_COLOCATE           "1": every rank runs both stages (a one-rank pipeline; partitions packed onto
                        fewer devices, and the way to run on a single GPU, since NCCL refuses two ranks
                        on one device). Then WORLD_SIZE = OMNI_DP_SIZE and OMNI_STAGE is ignored.
OMNI_DP_SIZE            data-parallel replicas (ranks per stage). Default: WORLD_SIZE // 2
                        (WORLD_SIZE when colocated).
OMNI_DP_RANK            replica index of this rank within its stage. Default: RANK % OMNI_DP_SIZE.
OMNI_MICRO_BATCHES      micro-batches per replica per step; when set it must agree with the global
                        batch (used by the manager to check its plan). Default: derived.
OMNI_CKPT_DIR           checkpoint root shared by all ranks (required).
OMNI_HEARTBEAT_DIR      folder of heartbeat files, one per rank (required).
OMNI_METRICS_DIR        folder of metrics JSON lines and Prometheus textfiles (required).
OMNI_HEARTBEAT_INTERVAL seconds between heartbeat rewrites (default 2).
OMNI_INCARNATION        how many times the job was (re)started; default SLURM_RESTART_COUNT or 0.
OMNI_JOB_ID             job id for metric labels; default SLURM_JOB_ID or "local".
OMNI_DATA_DELAY_S       drill knob, SECONDS[@STEP]: each step's data loading (from global step STEP on) takes
                        this much longer, as a slow shared data source would make it.
SLURMD_NODENAME         the node this rank runs on (srun sets it); heartbeats carry it for the manager.
OMNI_TRACE_SAMPLES      "1": each rank appends the sample ids of every step to its metrics folder.
OMNI_STEP_DELAY_S       seconds to sleep after each step (drills and tests pace a run with it).
OMNI_DEVICE             "cpu" or "cuda"; default cuda when available.
OMNI_FAULT_MISALIGN_AT_STEP  drill hook: at this global step the text stage reads its micro-batches
                        shifted by one sample, which the sample-id check must stop (exit code 3).
======================  ===============================================================================

Rank order is stage-major: ranks 0 .. dp-1 are the vision stage, dp .. 2dp-1 the text stage, which is
how srun numbers the tasks of a two-component heterogeneous job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_omni.elastic.layout import env_float
from slurm_omni.errors import RuntimeLayoutError

NUM_STAGES = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """This rank's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    stage: int
    """0 = vision, 1 = text, -1 = both (colocated)."""
    data_parallel_size: int
    data_parallel_rank: int
    micro_batches: int
    """0 when not given (derived from the global batch)."""
    ckpt_dir: Path
    heartbeat_dir: Path
    metrics_dir: Path
    heartbeat_interval_s: float = 2.0
    incarnation: int = 0
    job_id: str = "local"
    trace_samples: bool = False
    step_delay_s: float = 0.0
    device: str = "cpu"
    fault_misalign_at_step: int = 0
    """Drill hook (0 = off): the text stage reads shifted samples at this global step."""
    data_delay_s: float = 0.0
    """Drill knob (0 = off): added to every step's data loading, as a slow shared data source would..."""
    data_delay_from_step: int = 0
    """...from this global step on."""
    node: str = ""
    """The Slurm node this rank runs on (SLURMD_NODENAME); empty outside Slurm."""

    def __post_init__(self) -> None:
        if self.stage == -1:
            if self.world_size != self.data_parallel_size or self.rank != self.data_parallel_rank:
                raise RuntimeLayoutError(
                    f"layout: couldn't place colocated rank {self.rank}: WORLD_SIZE={self.world_size} must be "
                    f"OMNI_DP_SIZE={self.data_parallel_size} and OMNI_DP_RANK={self.data_parallel_rank} the rank")
            return
        if self.world_size != NUM_STAGES * self.data_parallel_size:
            raise RuntimeLayoutError(
                f"layout: couldn't place ranks: WORLD_SIZE={self.world_size} is not "
                f"{NUM_STAGES} stages x OMNI_DP_SIZE={self.data_parallel_size}")
        if not 0 <= self.stage < NUM_STAGES or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise RuntimeLayoutError(
                f"layout: couldn't place rank {self.rank}: OMNI_STAGE={self.stage} "
                f"OMNI_DP_RANK={self.data_parallel_rank} (stage 0/1, dp rank < {self.data_parallel_size})")
        if self.global_rank_of(self.stage, self.data_parallel_rank) != self.rank:
            raise RuntimeLayoutError(
                f"layout: couldn't place rank {self.rank}: stage {self.stage} replica "
                f"{self.data_parallel_rank} must be rank {self.global_rank_of(self.stage, self.data_parallel_rank)} "
                "(ranks are stage-major: component 0's tasks first)")

    def global_rank_of(self, stage: int, dp_rank: int) -> int:
        return dp_rank if self.colocated else stage * self.data_parallel_size + dp_rank

    @property
    def colocated(self) -> bool:
        return self.stage == -1

    @property
    def stages(self) -> tuple[int, ...]:
        """The pipeline stages this rank runs."""
        return tuple(range(NUM_STAGES)) if self.colocated else (self.stage,)

    @property
    def stage_name(self) -> str:
        return "+".join(("vision", "text")[s] for s in self.stages)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Layout:
        env = os.environ if env is None else env
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE")
        colocated = env.get("OMNI_COLOCATE", "") == "1"
        dp = _int(env, "OMNI_DP_SIZE", world if colocated else world // NUM_STAGES)
        if dp <= 0:
            raise RuntimeLayoutError(f"layout: couldn't place ranks: OMNI_DP_SIZE={dp} (must be > 0)")
        device = env.get("OMNI_DEVICE", "")
        if not device:
            import torch  # deferred: layout checks should not pay for torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(
            rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
            master_addr=_str(env, "MASTER_ADDR"), master_port=_int(env, "MASTER_PORT"),
            stage=-1 if colocated else _int(env, "OMNI_STAGE", rank // dp), data_parallel_size=dp,
            data_parallel_rank=_int(env, "OMNI_DP_RANK", rank % dp),
            micro_batches=_int(env, "OMNI_MICRO_BATCHES", 0),
            ckpt_dir=Path(_str(env, "OMNI_CKPT_DIR")), heartbeat_dir=Path(_str(env, "OMNI_HEARTBEAT_DIR")),
            metrics_dir=Path(_str(env, "OMNI_METRICS_DIR")),
            heartbeat_interval_s=env_float(env, "OMNI_HEARTBEAT_INTERVAL", 2.0),
            incarnation=_int(env, "OMNI_INCARNATION", _int(env, "SLURM_RESTART_COUNT", 0)),
            job_id=env.get("OMNI_JOB_ID") or env.get("SLURM_JOB_ID") or "local",
            trace_samples=env.get("OMNI_TRACE_SAMPLES", "") == "1",
            step_delay_s=env_float(env, "OMNI_STEP_DELAY_S", 0.0),
            device=device, fault_misalign_at_step=_int(env, "OMNI_FAULT_MISALIGN_AT_STEP", 0),
            data_delay_s=_delay(env)[0], data_delay_from_step=_delay(env)[1], node=env.get("SLURMD_NODENAME", ""),
        )


def _str(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise RuntimeLayoutError(f"layout: couldn't read {name}: not set (the sbatch template or launcher sets it)")
    return value


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name, "")
    if not raw:
        if default is None:
            raise RuntimeLayoutError(f"layout: couldn't read {name}: not set")
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise RuntimeLayoutError(f"layout: couldn't read {name}: {raw!r} is not an integer") from e


def _delay(env: Mapping[str, str]) -> tuple[float, int]:
    text = env.get("OMNI_DATA_DELAY_S", "")
    seconds, _, step = text.partition("@")
    try:
        out = (float(seconds) if seconds else 0.0, int(step) if step else 0)
    except ValueError:
        out = (-1.0, -1)
    if out[0] < 0 or out[1] < 0:
        raise RuntimeLayoutError(f"layout: couldn't read OMNI_DATA_DELAY_S={text!r} (expected SECONDS[@STEP], "
                                 "both >= 0)")
    return out
