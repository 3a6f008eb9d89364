"""Where this process sits in the job, read from its environment alone (never from host names).

The same call works under slurm-omni's batch scripts (``OMNI_*`` plus ``RANK``/``WORLD_SIZE`` from
the SPANK plugin or srun), under plain ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``; every rank runs every stage) and as one plain process (rank 0 of
1). No Slurm command is run: a container without ``scontrol`` works the same.

==========================  ======================================================================
RANK / SLURM_PROCID         global rank (default 0)
WORLD_SIZE                  ranks in the job (default 1)
LOCAL_RANK / SLURM_LOCALID  rank on this node: picks the CUDA device (default 0)
MASTER_ADDR, MASTER_PORT    the rendezvous (default 127.0.0.1 and a free port for one process)
OMNI_STAGES                 the pipeline's stage names in order ("vision,text"; the batch script
                            sets it from the job file's [[stages]])
OMNI_STAGE                  this rank's stage index (default RANK // OMNI_DP_SIZE)
OMNI_COLOCATE               "1": every rank runs every stage (default when no OMNI_DP_SIZE and no
                            OMNI_STAGE is set, as under torchrun)
OMNI_DP_SIZE, OMNI_DP_RANK  replicas per stage and this rank's replica
OMNI_INCARNATION            the life of the job (default TORCHELASTIC_RESTART_COUNT,
                            SLURM_RESTART_COUNT, 0): every restart a higher number
OMNI_JOB_ID, OMNI_JOB_NAME  labels (default SLURM_JOB_ID or "local"; the run folder's name)
OMNI_RUN_DIR                folder for the three below when they are not set (default "omni-run")
OMNI_CKPT_DIR               checkpoint root shared by all ranks (default RUN_DIR/ckpt)
OMNI_HEARTBEAT_DIR          heartbeat files (default RUN_DIR/heartbeat)
OMNI_METRICS_DIR            metrics JSON lines (default RUN_DIR/metrics)
OMNI_HEARTBEAT_INTERVAL     seconds between heartbeat rewrites (default 2)
OMNI_HEARTBEAT_NODE_DIR     a node-local folder (default ``/dev/shm``): under Slurm the node's
                            ranks beat there and one of them writes one file per node in the
                            heartbeat folder (``off`` or empty: a file per rank, the fallback;
                            ``elastic/heartbeat.py``)
==========================  ======================================================================

Read by :func:`slurm_omni.elastic.init` and :class:`~slurm_omni.elastic.Run` beside the layout:

==========================  ======================================================================
OMNI_MAX_STEPS              the job file's ``[training] max_steps``; wins over ``init(max_steps=)``
OMNI_DEVICE                 ``cpu`` or ``cuda`` (default cuda when torch sees a device)
OMNI_COLLECTIVE_TIMEOUT     seconds before a collective gives up (default 300)
OMNI_TRACE_SAMPLES          ``1``: ``run.trace`` appends each step's sample ids to the metrics folder
OMNI_STEP_DELAY_S           seconds to sleep after each step (drills and demos pace a run with it)
OMNI_TASK_STARTED_AT        Unix time the task started (the standby client): first metrics line
SLURMD_NODENAME             the node (srun sets it); heartbeats carry it for the manager
==========================  ======================================================================

Ranks are stage-major: stage ``s`` replica ``r`` is rank ``s * dp + r`` (srun numbers the tasks of a
heterogeneous job component by component).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from slurm_omni.errors import RuntimeLayoutError

Launcher = Literal["slurm-omni", "torchrun", "process"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """This rank's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    stage_names: tuple[str, ...]
    """Every stage of the pipeline, in pipeline order."""
    stages: tuple[int, ...]
    """Indices of the stages this rank runs: one, or all of them when colocated."""
    data_parallel_size: int
    """Replicas of each stage."""
    data_parallel_rank: int
    """This rank's replica (its rank within its stage)."""
    incarnation: int
    """The life of the job: 0 first, higher after every restart, requeue or resubmission."""
    job_id: str
    job_name: str
    ckpt_dir: Path
    heartbeat_dir: Path
    metrics_dir: Path
    master_addr: str
    master_port: int
    heartbeat_interval_s: float = 2.0
    launcher: Launcher = "process"

    def __post_init__(self) -> None:
        n, dp = len(self.stage_names), self.data_parallel_size
        if n < 1 or len(set(self.stage_names)) != n or any(not s or "/" in s or "+" in s for s in self.stage_names):
            raise RuntimeLayoutError(f"layout: couldn't use stages {list(self.stage_names)}: give distinct, "
                                     "non-empty names without '/' or '+' (OMNI_STAGES or stages=)")
        if dp < 1 or not 0 <= self.data_parallel_rank < dp:
            raise RuntimeLayoutError(f"layout: couldn't place rank {self.rank}: OMNI_DP_RANK="
                                     f"{self.data_parallel_rank} with OMNI_DP_SIZE={dp}")
        ranks = dp if self.colocated else n * dp
        if self.world_size != ranks:
            raise RuntimeLayoutError(
                f"layout: couldn't place ranks: WORLD_SIZE={self.world_size}, expected {ranks} "
                f"({'every rank runs all ' + str(n) + ' stages' if self.colocated else f'{n} stages'} x "
                f"OMNI_DP_SIZE={dp})")
        if not self.stages or any(not 0 <= s < n for s in self.stages):
            raise RuntimeLayoutError(f"layout: couldn't place rank {self.rank}: OMNI_STAGE={self.stages} "
                                     f"(0 .. {n - 1})")
        want = self.global_rank_of(self.stages[0], self.data_parallel_rank)
        if want != self.rank:
            raise RuntimeLayoutError(
                f"layout: couldn't place rank {self.rank}: stage {self.stages[0]} replica "
                f"{self.data_parallel_rank} must be rank {want} (ranks are stage-major)")

    # -- names ------------------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        """This rank runs more than one stage (every stage, on one device)."""
        return len(self.stages) > 1 or (len(self.stage_names) == 1)

    @property
    def stage(self) -> int:
        """This rank's stage index; the first when it runs several."""
        return self.stages[0]

    @property
    def stage_name(self) -> str:
        """``vision``, ``text``, or ``vision+text`` for a rank that runs both."""
        return "+".join(self.stage_names[s] for s in self.stages)

    @property
    def stage_rank(self) -> int:
        """Rank within the stage (the same number as the replica)."""
        return self.data_parallel_rank

    @property
    def replica(self) -> int:
        return self.data_parallel_rank

    @property
    def num_stages(self) -> int:
        return len(self.stage_names)

    @property
    def first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    @property
    def reports_loss(self) -> bool:
        """Replica 0 of the last stage: the rank whose metrics lines carry the job's loss, read for every
        step by the drills and reports (``drill.history.loss_file``)."""
        return self.last_stage and self.data_parallel_rank == 0

    def runs(self, stage: str) -> bool:
        """Does this rank run the stage named ``stage``?"""
        return stage in self.stage_names and self.stage_names.index(stage) in self.stages

    def global_rank_of(self, stage: int, replica: int) -> int:
        """The rank that runs ``stage`` for ``replica``."""
        return replica if self.colocated else stage * self.data_parallel_size + replica

    def peer(self, stage: str) -> int:
        """The rank running ``stage`` for this rank's replica (a pipeline neighbour)."""
        return self.global_rank_of(self.stage_names.index(stage), self.data_parallel_rank)

    def accumulation(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches each replica runs per step so that the global batch stays the same."""
        return accumulation_for(global_batch_size, micro_batch_size, self.data_parallel_size)

    @classmethod
    def from_env(cls, stages: Sequence[str] | None = None, env: Mapping[str, str] | None = None, *,
                 run_dir: Path | str | None = None) -> Layout:
        """The layout of this process. ``stages`` names the script's pipeline stages; when the batch
        script also names them (``OMNI_STAGES``, from the job file) the two must agree."""
        env = os.environ if env is None else env
        names = _stage_names(env, stages)
        rank = _int(env, "RANK", _int(env, "SLURM_PROCID", 0))
        world = _int(env, "WORLD_SIZE", 1)
        colocated = env.get("OMNI_COLOCATE", "") == "1" or len(names) == 1 or (
            not env.get("OMNI_DP_SIZE") and not env.get("OMNI_STAGE"))
        dp = _int(env, "OMNI_DP_SIZE", world if colocated else max(1, world // len(names)))
        if dp < 1:
            raise RuntimeLayoutError(f"layout: couldn't place ranks: OMNI_DP_SIZE={dp} (must be > 0)")
        stage_list = tuple(range(len(names))) if colocated else (_int(env, "OMNI_STAGE", rank // dp),)
        launcher: Launcher = ("slurm-omni" if env.get("OMNI_JOB_NAME") else
                              "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "process")
        base = Path(env.get("OMNI_RUN_DIR") or run_dir or "omni-run")
        ckpt = Path(env.get("OMNI_CKPT_DIR") or base / "ckpt")
        incarnation = _int(env, "OMNI_INCARNATION",
                           _int(env, "TORCHELASTIC_RESTART_COUNT", _int(env, "SLURM_RESTART_COUNT", 0)))
        addr = env.get("MASTER_ADDR", "")
        port = _int(env, "MASTER_PORT", 0)
        if world == 1 and (not addr or not port):
            addr, port = addr or "127.0.0.1", port or _free_port()
        if not addr or not port:
            raise RuntimeLayoutError("layout: couldn't find the rendezvous: MASTER_ADDR and MASTER_PORT must be "
                                     f"set for WORLD_SIZE={world} (torchrun and the batch script set them)")
        return cls(
            rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK", _int(env, "SLURM_LOCALID", 0)),
            stage_names=names, stages=stage_list, data_parallel_size=dp,
            data_parallel_rank=_int(env, "OMNI_DP_RANK", rank % dp), incarnation=incarnation,
            job_id=env.get("OMNI_JOB_ID") or env.get("SLURM_JOB_ID") or "local",
            job_name=env.get("OMNI_JOB_NAME") or ckpt.parent.name or "local",
            ckpt_dir=ckpt, heartbeat_dir=Path(env.get("OMNI_HEARTBEAT_DIR") or base / "heartbeat"),
            metrics_dir=Path(env.get("OMNI_METRICS_DIR") or base / "metrics"),
            master_addr=addr, master_port=port,
            heartbeat_interval_s=env_float(env, "OMNI_HEARTBEAT_INTERVAL", 2.0), launcher=launcher)


def accumulation_for(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """``global_batch_size / (data_parallel_size * micro_batch_size)``, refused when it does not divide."""
    per_replica, rest = divmod(global_batch_size, max(1, data_parallel_size) * max(1, micro_batch_size))
    if rest or per_replica == 0 or micro_batch_size < 1:
        raise RuntimeLayoutError(
            f"layout: couldn't keep the global batch: {global_batch_size} samples over {data_parallel_size} "
            f"replicas of micro-batches of {micro_batch_size} (the global batch must be a multiple of "
            "replicas x micro_batch_size)")
    return per_replica


def _stage_names(env: Mapping[str, str], stages: Sequence[str] | None) -> tuple[str, ...]:
    from_env = tuple(s for s in env.get("OMNI_STAGES", "").split(",") if s)
    given = tuple(stages) if stages else ()
    if from_env and given and from_env != given:
        raise RuntimeLayoutError(
            f"layout: couldn't match stages: the job file names {','.join(from_env)} (OMNI_STAGES), the "
            f"script {','.join(given)} (make [[stages]] names and the script's stages= the same)")
    return from_env or given or ("main",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise RuntimeLayoutError(f"layout: couldn't read {name}: {raw!r} is not an integer") from e


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    """``env[name]`` as a number, ``default`` when unset or empty; one RuntimeLayoutError otherwise."""
    raw = env.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError as e:
        raise RuntimeLayoutError(f"layout: couldn't read {name}: {raw!r} is not a number") from e
