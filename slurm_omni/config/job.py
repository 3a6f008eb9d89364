"""The user's job file (``job.toml``): what to run, on how much, for how long.

```toml
[job]
name = "omni-tiny"
data_parallel_size = 2          # replicas at start; each stage holds one rank per replica
time_limit = "02:00:00"
workdir = "."                   # every rank starts here (default: this file's folder)

[[stages]]                      # heterogeneous component 0
name = "vision"
nodes = 1
[[stages]]                      # component 1
name = "text"
nodes = 1

[training]                      # slurm_omni.config.training.TrainingConfig
...
```

Partition and gres of a stage default to the site config's ``[stages.NAME]``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from slurm_omni.config.schema import load_dataclass, read_toml
from slurm_omni.config.site import check_slurm_name, parse_gres
from slurm_omni.config.training import BUILTIN_STAGES, TrainingConfig, load_training_table
from slurm_omni.errors import ConfigError

# Slurm's time formats (src/common/parse_time.c, time_str2secs): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"(?:(?P<d>[0-9]{1,9})-(?P<dh>[0-9]{1,9})(?::(?P<dm>[0-9]{1,9})(?::(?P<ds>[0-9]{1,9}))?)?"
                   r"|(?P<a>[0-9]{1,9})(?::(?P<b>[0-9]{1,9})(?::(?P<c>[0-9]{1,9}))?)?)")
_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_MAX_SLURM_SECONDS = 2**31 - 2   # time_str2secs returns an int; INFINITE and NO_VAL sit above


def _clock(total: int) -> str:
    days, rest = divmod(total, 86400)
    return (f"{days}-" if days else "") + f"{rest // 3600:02d}:{rest // 60 % 60:02d}:{rest % 60:02d}"


def parse_slurm_time(text: str) -> int:
    """Seconds in a Slurm time string (``--time``, ``--switches=N@T``), summed as Slurm's
    time_str2secs sums them; ConfigError otherwise. Slurm carries a field past its range into the
    next (``25:99:99`` becomes 1-02:40:39) without a word: that is refused here, as are hours of 24
    or more beside a day part."""
    m = _TIME.fullmatch(text)
    if m is None:
        raise ConfigError(f"time {text!r} is not allowed (expected a Slurm time: {_FORMATS}, ASCII digits)")
    fields: tuple[tuple[str, int, int], ...]
    if m["d"] is not None:
        days, hours, minutes, seconds = int(m["d"]), int(m["dh"]), int(m["dm"] or 0), int(m["ds"] or 0)
        fields = (("hours", hours, 24), ("minutes", minutes, 60), ("seconds", seconds, 60))
    else:
        parts = [int(p) for p in (m["a"], m["b"], m["c"]) if p is not None]
        days = 0
        if len(parts) == 3:
            hours, minutes, seconds = parts
            fields = (("minutes", minutes, 60), ("seconds", seconds, 60))
        else:   # MM or MM:SS: the minutes may be any number
            hours, minutes, seconds = 0, parts[0], parts[1] if len(parts) == 2 else 0
            fields = (("seconds", seconds, 60),)
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    for name, value, bound in fields:
        if value >= bound:
            raise ConfigError(f"time {text!r} is not allowed: {name} = {value} (expected below {bound}; "
                              f"Slurm would silently take it as {_clock(total)})")
    if total > _MAX_SLURM_SECONDS:
        raise ConfigError(f"time {text!r} is not allowed: {total} s is more than Slurm can hold "
                          f"({_MAX_SLURM_SECONDS} s)")
    return total


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSection:
    """The ``[job]`` table: scheduling of the whole heterogeneous job."""

    name: str
    """Slurm job name; also the job's folder under the site's checkpoint root."""
    data_parallel_size: int
    """Replicas at start (exported as OMNI_DP_SIZE); each stage holds one rank per replica."""
    time_limit: str = "01:00:00"
    """Slurm ``--time`` of every incarnation."""
    requeue_signal: Literal["USR1", "USR2"] = "USR1"
    """Signal Slurm sends the batch shell before the limit (USR2 where NCCL catches USR1)."""
    signal_before_s: int = 300
    """``--signal=B:SIG@T``: seconds before the limit; Slurm may send it up to 60 s early."""
    max_requeues: int = 5
    """The batch script requeues itself after a checkpointed exit while SLURM_RESTART_COUNT is below."""
    log_dir: Path = Path("logs")
    """Where ``%x-%j.out`` goes; relative paths are taken from the job file's folder."""
    workdir: Path = Path(".")
    """The folder every rank starts in (the batch script ``cd``s into it; the step supervisor's sruns
    get ``--chdir``), in every life of the job: a script's relative paths (``data/``) are found from
    it. Default: the job file's folder; relative paths are taken from it. Must exist (checked when
    the job file is loaded) and be seen by every node."""
    account: str = ""
    """Slurm account; empty: the user's default."""
    qos: str = ""
    """Slurm QOS; empty: the default."""
    recovery: Literal["", "resubmit", "in_allocation", "allocation"] = ""
    """How a failure is recovered: ``resubmit`` (a heterogeneous job; the manager cancels it and
    submits the next incarnation), ``in_allocation`` (one homogeneous ``--no-kill`` allocation of
    every stage's nodes plus its spares; the step supervisor on the batch host relaunches the step on
    the survivors and a spare, no trip through the queue), ``allocation`` (the same allocation
    without a batch script, ``salloc --no-shell``; the step supervisor runs beside the manager and
    launches with ``srun --jobid``, so no node is special: docs/allocation-mode.md; where the site
    does not allow it, ``in_allocation``); empty: the site's default (``elasticity.recovery``, else
    the fastest path the site allows: ``SiteElasticity.default_recovery``)."""

    def __post_init__(self) -> None:
        check_slurm_name("job.name", self.name)
        if self.data_parallel_size < 1:
            raise ConfigError(f"job.data_parallel_size = {self.data_parallel_size} is not allowed "
                              f"(expected >= 1)")
        limit = self.time_limit_s
        if not 60 <= self.signal_before_s < limit:
            raise ConfigError(f"job.signal_before_s = {self.signal_before_s} is not allowed (expected "
                              f"60 <= it < time_limit = {limit}s: Slurm signals up to 60 s early)")
        if not 0 <= self.max_requeues <= 1000:
            raise ConfigError(f"job.max_requeues = {self.max_requeues} is not allowed (expected 0..1000)")
        for key, value in (("job.account", self.account), ("job.qos", self.qos)):
            if value:
                check_slurm_name(key, value)

    @property
    def time_limit_s(self) -> int:
        return parse_slurm_time(self.time_limit)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRequest:
    """One ``[[stages]]`` entry: one heterogeneous component, in file order (het group 0, 1, ...)."""

    name: str
    """Stage name; the site config's ``[stages.NAME]`` gives partition and gres defaults."""
    nodes: int
    """Nodes of this component."""
    tasks_per_node: int = 0
    """Ranks per node; 0: data_parallel_size / nodes."""
    partition: str = ""
    """Override of the site's partition for this stage."""
    gres: str = ""
    """Override of the site's gres per node, ``NAME[:TYPE]:COUNT``."""
    switches: int = 1
    """``--switches=N@T``: at most this many leaf switches under the component."""
    switch_wait: str = "10:00"
    """``T`` of ``--switches``: how long to wait for that placement (Slurm time)."""
    cpus_per_task: int = 0
    """``--cpus-per-task``; 0: not given."""
    spares: int = -1
    """Spare nodes held in the allocation for this stage (``recovery = "in_allocation"``); -1: the
    site's ``elasticity.default_spares``. At most the site's ``elasticity.max_spares``."""

    def __post_init__(self) -> None:
        check_slurm_name("stages.name", self.name)
        if self.spares < -1:
            raise ConfigError(f"stages.spares = {self.spares} is not allowed (expected >= 0, or -1 for the "
                              f"site's elasticity.default_spares)")
        if self.nodes < 1:
            raise ConfigError(f"stages.nodes = {self.nodes} is not allowed (expected >= 1)")
        if self.tasks_per_node < 0 or self.cpus_per_task < 0:
            raise ConfigError(f"stages.tasks_per_node = {self.tasks_per_node}, cpus_per_task = "
                              f"{self.cpus_per_task} are not allowed (expected >= 0; 0 = derive)")
        if self.partition:
            check_slurm_name("stages.partition", self.partition)
        if self.gres:
            parse_gres(self.gres)
        if self.switches < 1:
            raise ConfigError(f"stages.switches = {self.switches} is not allowed (expected >= 1)")
        parse_slurm_time(self.switch_wait)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobFile:
    job: JobSection
    stages: list[StageRequest]
    training: TrainingConfig

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if not names:
            raise ConfigError("stages is empty (expected one [[stages]] per heterogeneous component)")
        if len(set(names)) != len(names):
            raise ConfigError(f"stages names {names} are not allowed (expected distinct names)")
        if not self.training.command and tuple(names) != BUILTIN_STAGES:
            raise ConfigError(f"stages {', '.join(names)} are not allowed for the built-in trainer (it runs "
                              f"[[stages]] {' then '.join(BUILTIN_STAGES)}: name them so, or give [training] "
                              "command = [...] to run your own script)")
        for stage in self.stages:
            self.tasks_per_node(stage)

    def tasks_per_node(self, stage: StageRequest) -> int:
        """Ranks per node of ``stage``; every stage holds exactly one rank per replica."""
        dp = self.job.data_parallel_size
        tpn = stage.tasks_per_node or dp // stage.nodes
        if tpn < 1 or tpn * stage.nodes != dp:
            raise ConfigError(
                f"stages {stage.name!r}: nodes = {stage.nodes} x tasks_per_node = "
                f"{stage.tasks_per_node or 'derived'} is not allowed (expected nodes x tasks_per_node "
                f"== job.data_parallel_size = {dp}: one rank per replica per stage)")
        return tpn


def load_job(path: Path) -> JobFile:
    """Load ``path``; relative paths in it are taken from its folder."""
    doc = read_toml(path)
    source = str(path)
    job = load_dataclass(JobFile, doc, source=source)
    base = path.resolve().parent
    training = load_training_table(doc["training"], source=source, base_dir=base)
    log_dir = job.job.log_dir if job.job.log_dir.is_absolute() else base / job.job.log_dir
    workdir = job.job.workdir if job.job.workdir.is_absolute() else base / job.job.workdir
    workdir = Path(os.path.normpath(workdir))
    if not workdir.is_dir():
        what = "is not a folder" if workdir.exists() else "does not exist"
        raise ConfigError(f"{source}: job.workdir = {str(job.job.workdir)!r} is not allowed: {workdir} {what} "
                          f"(expected a folder every node sees; relative to the job file's folder)")
    try:   # the runtime cuts the global batch this way at start: fail here, not in every rank
        training.parallel.micro_batches_for(job.job.data_parallel_size)
    except ConfigError as e:
        raise ConfigError(f"{source}: training.{e} (job.data_parallel_size = {job.job.data_parallel_size})") from None
    return replace(job, job=replace(job.job, log_dir=log_dir, workdir=workdir), training=training)
