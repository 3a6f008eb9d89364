"""The ``[training]`` part of a job file: model sizes, parallel layout, optimiser, data, checkpoints.

In a job.toml these sit under ``[training]`` (``[training.model]``, ``[training.parallel]``,
``[training.optim]``, ``[training.data]`` with ``[[training.data.sources]]``, ``[training.checkpoint]``).
``slurm_omni.config.job`` embeds :class:`TrainingConfig` as its ``training`` field; the runtime reads it
back with :func:`load_training_file`.

The data-parallel size is not part of the file: it comes from the environment (``OMNI_DP_SIZE``) so that
a requeued job can run with fewer replicas. The global batch is fixed here; the runtime turns it into
micro-batches per replica (``global_batch_size / (dp * micro_batch_size)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from slurm_omni.config.schema import load_dataclass, read_toml
from slurm_omni.errors import ConfigError, RuntimeLayoutError
from slurm_omni.formats.metrics import PER_NODE_ENV, per_node_setting

ModelPreset = Literal["tiny", "small", "base", "large"]

# Sizes per preset. "tiny" is ~0.2M parameters (CPU tests); "large" is ~1.5B (H200 sizes).
_SIZE_KEYS = ("image_size", "patch_size", "channels", "vision_width", "vision_depth", "vision_heads",
              "vocab_size", "text_width", "text_depth", "text_heads", "seq_len")
PRESETS: dict[str, dict[str, int]] = {
    name: dict(zip(_SIZE_KEYS, sizes, strict=True)) for name, sizes in {
        "tiny": (16, 8, 3, 32, 1, 2, 256, 32, 1, 2, 16),
        "small": (64, 8, 3, 256, 4, 4, 8192, 384, 6, 6, 128),
        "base": (224, 16, 3, 768, 12, 12, 32000, 1024, 16, 16, 512),
        "large": (336, 14, 3, 1024, 24, 16, 32000, 2048, 24, 16, 1024),
    }.items()
}

_UNSET = -1


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Sizes of the multimodal model. Any size left out takes the preset's value."""

    preset: ModelPreset = "tiny"
    """Named size; explicit keys below override single sizes of it."""
    image_size: int = _UNSET
    """Square image side in pixels; a multiple of ``patch_size``."""
    patch_size: int = _UNSET
    """Side of one vision patch in pixels."""
    channels: int = _UNSET
    """Image channels (3 for RGB)."""
    vision_width: int = _UNSET
    """Hidden size of the vision encoder."""
    vision_depth: int = _UNSET
    """Transformer blocks in the vision encoder."""
    vision_heads: int = _UNSET
    """Attention heads of the vision encoder; divides ``vision_width``."""
    vocab_size: int = _UNSET
    """Text vocabulary size (token ids are ``0 .. vocab_size-1``; 0 is padding)."""
    text_width: int = _UNSET
    """Hidden size of the text decoder (the projector maps vision_width to it)."""
    text_depth: int = _UNSET
    """Transformer blocks in the text decoder."""
    text_heads: int = _UNSET
    """Attention heads of the text decoder; divides ``text_width``."""
    seq_len: int = _UNSET
    """Text tokens per sample (image tokens come in front of them)."""
    mlp_ratio: int = 4
    """Width of the MLP in each block, as a multiple of the block's width."""

    def __post_init__(self) -> None:
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) == _UNSET:
                object.__setattr__(self, name, value)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"model: {f.name} = {value} is not allowed (must be > 0)")
        if self.image_size % self.patch_size:
            raise ConfigError(f"model: image_size = {self.image_size} is not a multiple of "
                              f"patch_size = {self.patch_size}")
        if self.vision_width % self.vision_heads:
            raise ConfigError(f"model: vision_heads = {self.vision_heads} does not divide "
                              f"vision_width = {self.vision_width}")
        if self.text_width % self.text_heads:
            raise ConfigError(f"model: text_heads = {self.text_heads} does not divide "
                              f"text_width = {self.text_width}")

    @property
    def num_patches(self) -> int:
        """Image tokens per sample."""
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How a global batch is cut. The data-parallel size comes from ``OMNI_DP_SIZE`` at run time."""

    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule between the vision stage and the text stage."""
    global_batch_size: int = 8
    """Samples per optimiser step over all replicas; kept when the number of replicas changes."""
    micro_batch_size: int = 2
    """Samples per pipeline micro-batch."""
    micro_batches: int = 0
    """Micro-batches per replica per step; 0 derives it from the global batch and the replica count
    (gradient accumulation is done by running more micro-batches through the pipeline)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto picks nccl when CUDA is present, gloo otherwise."""
    data_order: Literal["global", "per_replica"] = "global"
    """What a change of the replica count does to the data, the contract ``omni demo`` and ``omni
    drill`` compare a resized run by (slurm_omni.drill.equivalence). ``global``: the samples of every
    step come from one global order cut per replica, whatever their count (the built-in trainer,
    examples/own-script): after a resize every step trains on the reference's samples and the loss
    agrees within the documented tolerance. ``per_replica``: each replica draws its own batches
    (random offsets from a per-rank generator, a sampler split by replica count): a resize changes
    which samples a step trains on, so after it the loss is not compared; the sample ids are (each at
    most once while the reference repeats none, no step replaying an earlier one)."""

    def __post_init__(self) -> None:
        if self.global_batch_size <= 0 or self.micro_batch_size <= 0:
            raise ConfigError(f"parallel: global_batch_size = {self.global_batch_size} and "
                              f"micro_batch_size = {self.micro_batch_size} must be > 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(f"parallel: global_batch_size = {self.global_batch_size} is not a multiple "
                              f"of micro_batch_size = {self.micro_batch_size}")
        if self.micro_batches < 0:
            raise ConfigError(f"parallel: micro_batches = {self.micro_batches} must be >= 0")

    def micro_batches_for(self, data_parallel_size: int) -> int:
        """Micro-batches each replica runs per step so that the global batch stays the same."""
        per_replica, rest = divmod(self.global_batch_size, data_parallel_size * self.micro_batch_size)
        if rest or per_replica == 0:
            raise ConfigError(
                f"parallel: couldn't cut global_batch_size = {self.global_batch_size} for "
                f"{data_parallel_size} replicas of micro_batch_size = {self.micro_batch_size} "
                "(global batch must be a multiple of replicas x micro_batch_size)")
        if self.micro_batches and self.micro_batches != per_replica:
            raise ConfigError(
                f"parallel: micro_batches = {self.micro_batches} does not match global_batch_size = "
                f"{self.global_batch_size} with {data_parallel_size} replicas (set it to 0 to derive it)")
        return per_replica


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW with warm-up and decay; the schedule follows the global step, not the local one."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 5
    """Linear warm-up from 0 to ``lr`` over this many global steps."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from ``lr`` to ``min_lr`` between warm-up and ``max_steps``."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Global gradient-norm clip over both stages; 0 turns it off."""
    seed: int = 0
    """Seeds the parameter initialisation (identical on all replicas)."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim: lr = {self.lr}, min_lr = {self.min_lr} (need 0 <= min_lr <= lr, lr > 0)")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("optim: warmup_steps, grad_clip and weight_decay must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """One data source (a group of shards) and its share of the mix."""

    name: str
    """Source name as written in the shards' ``source`` attribute (e.g. "pairs", "text")."""
    weight: float = 1.0
    """Relative share of samples drawn from this source."""

    def __post_init__(self) -> None:
        if not self.name or self.weight <= 0:
            raise ConfigError(f"data: source {self.name!r} weight = {self.weight} (need a name and weight > 0)")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where the HDF5 shards are and how their sources are mixed (see docs/data-format.md)."""

    shard_dir: Path
    """Folder of ``*.h5`` shards; relative paths are taken from the job file's folder."""
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(name="pairs")])
    """Sources mixed by weight; each keeps its own position, saved with every checkpoint."""
    seed: int = 0
    """Seeds the mix and the per-source shuffles; the sample order is a function of it alone."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.sources]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"data: sources {names} must be non-empty and distinct")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCadence:
    """When the runtime checkpoints (always also on SIGUSR1/SIGTERM and at the last step)."""

    every_steps: int = 10
    """Asynchronous checkpoint every this many global steps; 0 only on signals and at the end."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are removed by the checkpoint engine."""
    memory_tier: bool = False
    """Also keep each rank's shard of the two newest checkpoints in node-local shared memory and restore
    from there where a rank's node holds it (docs/checkpoint.md, "The memory tier"); in-allocation jobs
    only (their standby frees it at the job's end). The site's ``[checkpoint] memory_gib`` caps it."""

    memory_every_steps: int = 0
    """With ``memory_tier``: a snapshot into memory every this many steps; 0 (default): the fewest steps
    that keep the snapshots' blocking under 1 % of training, from what the run measured
    (``policy/snapshot_cadence.py``, chosen after the life's second checkpoint)."""
    files_every: int = 0
    """With ``memory_tier``: every this-many-th memory snapshot also goes to the file system; 0
    (default): about every ``every_steps`` steps, as without the tier (fewer where the file system
    write would block training more than the budget), or every ``files_every_s`` seconds."""
    files_every_s: float = 0.0
    """With ``memory_tier``: the file system about every this many seconds instead (0: unset)."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.keep_last < 1:
            raise ConfigError(f"checkpoint: every_steps = {self.every_steps} (>= 0), "
                              f"keep_last = {self.keep_last} (>= 1)")
        for name, value in (("memory_every_steps", self.memory_every_steps), ("files_every", self.files_every),
                            ("files_every_s", self.files_every_s)):
            if isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ConfigError(f"checkpoint: {name} = {value} (0 or more; 0 lets the run choose)")
            if value and not self.memory_tier:
                raise ConfigError(f"checkpoint: {name} = {value} needs memory_tier = true (without it every "
                                  f"checkpoint goes to the file system, every_steps)")
        if self.files_every and self.files_every_s:
            raise ConfigError(f"checkpoint: files_every = {self.files_every} and files_every_s = "
                              f"{self.files_every_s:g}: set one of them")


BUILTIN_STAGES = ("vision", "text")
"""The built-in trainer's pipeline stages, in order: a job file without ``[training] command`` names
its ``[[stages]]`` so."""
COMMAND_FIELDS = ("python", "omni", "job_dir", "job_file", "job_name")
"""What ``{...}`` may name in ``[training] command`` and ``[training.env]`` values: the Python (and the
``omni`` argv, a whole word only) that rendered the script, or the site's ``python``; the job file's
folder and path; the job's name. ``{{`` and ``}}`` are literal braces."""
_FIELD = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""Set by slurm-omni for every rank; a job file cannot override them (nor OMNI_* and SLURM_*)."""
USER_OMNI_ENV = ("OMNI_STEP_DELAY_S", "OMNI_TRACE_SAMPLES", "OMNI_DEVICE", "OMNI_COLLECTIVE_TIMEOUT",
                 "OMNI_HEARTBEAT_NODE_DIR", PER_NODE_ENV)
"""The OMNI_* knobs of the training API (``slurm_omni/elastic/layout.py``) a job file may set."""


def substitute(text: str, values: dict[str, str], *, where: str) -> str:
    """``text`` with its ``{name}`` fields replaced from ``values``; a ConfigError names a bad field."""
    def one(m: re.Match[str]) -> str:
        token = m.group(0)
        if token in ("{{", "}}"):
            return token[0]
        name = m.group(1)
        if name is None or name not in values:
            raise ConfigError(f"{where} = {text!r}: {token!r} is not allowed (fields: "
                              f"{', '.join('{' + f + '}' for f in COMMAND_FIELDS)}; {{{{ and }}}} for braces)")
        return values[name]
    return _FIELD.sub(one, text)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """The ``[training]`` table of a job file."""

    max_steps: int = 100
    """Global optimiser steps to train; the job exits with EXIT_DONE after the last one."""
    command: list[str] = field(default_factory=list)
    """Your own training program as an argv list, e.g. ``["{python}", "{job_dir}/train.py"]``, started
    on every rank instead of the built-in trainer (``omni train``, the default when empty). Fields in
    braces: :data:`COMMAND_FIELDS`. The program adopts slurm-omni through ``slurm_omni.elastic``
    (docs/own-script.md). The built-in trainer's tables below are then not used, except ``max_steps``
    (OMNI_MAX_STEPS), ``parallel`` (the global batch the manager keeps when it resizes) and
    ``checkpoint``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every rank (values take the same fields as ``command``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig | None = None
    """Required by the built-in trainer; a ``command`` brings its own data."""
    checkpoint: CheckpointCadence = field(default_factory=CheckpointCadence)
    log_every: int = 1
    """Write a metrics line every this many steps."""
    matmul_precision: Literal["highest", "high", "medium"] = "high"
    """``torch.set_float32_matmul_precision`` on CUDA: "high" lets float32 matmuls use TF32 tensor
    cores (several times faster, same on every replica and every resume); ignored on CPU."""

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.log_every <= 0:
            raise ConfigError(f"training: max_steps = {self.max_steps}, log_every = {self.log_every} "
                              "(must be > 0)")
        if not self.command and self.data is None:
            raise ConfigError("training: missing [training.data] (the built-in trainer reads its shards from "
                              "it; or give training.command to run your own script)")
        if self.command and not self.command[0]:
            raise ConfigError("training.command = [\"\", ...] is not allowed (its first word is the program)")
        probe = dict.fromkeys(COMMAND_FIELDS, "x")
        for i, word in enumerate(self.command):
            substitute(word, probe, where=f"training.command[{i}]")
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name) or name in RESERVED_ENV or (
                    name.startswith(("OMNI_", "SLURM_")) and name not in USER_OMNI_ENV):
                raise ConfigError(f"training.env.{name} is not allowed (expected a variable name; RANK, "
                                  "WORLD_SIZE, LOCAL_RANK, MASTER_*, OMNI_* and SLURM_* are slurm-omni's, "
                                  f"but {', '.join(USER_OMNI_ENV)})")
            substitute(value, probe, where=f"training.env.{name}")
            if name == PER_NODE_ENV:   # refused at submit, not by every rank at its start
                try:
                    per_node_setting({name: value})
                except RuntimeLayoutError as e:
                    raise ConfigError(f"training.env.{e}") from None

    @property
    def shards(self) -> DataConfig:
        """The built-in trainer's data (present whenever ``command`` is empty)."""
        if self.data is None:
            raise ConfigError("training: missing [training.data] (the built-in trainer needs it)")
        return self.data


def load_training_table(table: object, *, source: str, base_dir: Path | None = None) -> TrainingConfig:
    """Build a TrainingConfig from an already parsed ``[training]`` table; a relative
    ``data.shard_dir`` is resolved against ``base_dir`` (the job file's folder)."""
    cfg = load_dataclass(TrainingConfig, table, source=source, prefix="training")
    if base_dir is not None and cfg.data is not None and not cfg.data.shard_dir.is_absolute():
        cfg = replace(cfg, data=replace(cfg.data, shard_dir=base_dir / cfg.data.shard_dir))
    return cfg


def load_training_file(path: Path) -> TrainingConfig:
    """Read the ``[training]`` table of a job.toml (other tables are left to the job-file loader)."""
    doc = read_toml(path)
    if "training" not in doc:
        raise ConfigError(f"{path}: missing table [training]")
    return load_training_table(doc["training"], source=str(path), base_dir=path.parent)
