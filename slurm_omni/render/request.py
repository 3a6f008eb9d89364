"""Requests that materialize batch scripts. Building is separate from running: nothing here runs
a command; ``materialize()`` returns the script as a string and ``omni render`` just prints it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from slurm_omni import __version__
from slurm_omni.config import quoting
from slurm_omni.config.job import JobFile
from slurm_omni.config.site import SiteConfig, parse_gres
from slurm_omni.config.training import substitute
from slurm_omni.elastic.codes import EXIT_BAD_INPUT, EXIT_CHECKPOINTED, EXIT_DONE, EXIT_FAILED
from slurm_omni.errors import ConfigError
from slurm_omni.ownership import current_user
from slurm_omni.policy.in_allocation import REQUEUE_INCARNATION_STRIDE
from slurm_omni.render import engine

log = logging.getLogger(__name__)

HET_TEMPLATE = "het.sbatch.j2"
IN_ALLOCATION_TEMPLATE = "inalloc.sbatch.j2"
ARRAY_TEMPLATE = "array.sbatch.j2"
DRILL_TEMPLATE = "drill.sbatch.j2"
IN_ALLOCATION_DRILL_TEMPLATE = "inalloc-drill.sbatch.j2"


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage as it will be asked of Slurm: site defaults filled in, tasks derived."""

    het_group: int
    name: str
    partition: str
    nodes: int
    tasks_per_node: int
    gres: str
    switches: int
    switch_wait: str
    cpus_per_task: int
    spares: int = 0
    """Spare nodes of this stage in an in-allocation job (0 in a heterogeneous job's plan too)."""
    feature: str = ""
    """The site's node feature for this stage's kind (``--constraint`` counts); empty: none."""

    @property
    def ntasks(self) -> int:
        return self.nodes * self.tasks_per_node


def plan_stages(job: JobFile, site: SiteConfig) -> tuple[StagePlan, ...]:
    """Resolve the job's stages against the site: partition and gres defaults, one GPU per rank."""
    dp = job.job.data_parallel_size
    if dp < site.elasticity.min_data_parallel_size:
        raise ConfigError(f"job: data_parallel_size = {dp} is not allowed (site minimum is "
                          f"elasticity.min_data_parallel_size = {site.elasticity.min_data_parallel_size})")
    plans = []
    for group, stage in enumerate(job.stages):
        default = site.stages.get(stage.name)
        if default is None and not (stage.partition and stage.gres):
            raise ConfigError(f"job: stage {stage.name!r} is not in the site config (allowed: "
                              f"{', '.join(site.stages)}; or give partition and gres in [[stages]])")
        partition = stage.partition or (default.partition if default else "")
        gres = stage.gres or (default.gres if default else "")
        tpn = job.tasks_per_node(stage)
        parsed = parse_gres(gres)
        if parsed.name == "gpu" and tpn > parsed.count:
            raise ConfigError(f"job: stage {stage.name!r} has {tpn} tasks per node but gres {gres!r} "
                              f"gives {parsed.count} GPUs (one GPU per rank)")
        spares = site.elasticity.default_spares if stage.spares < 0 else stage.spares
        if spares > site.elasticity.max_spares:
            raise ConfigError(f"job: stage {stage.name!r} spares = {spares} is not allowed (the site allows at "
                              f"most elasticity.max_spares = {site.elasticity.max_spares} per stage)")
        plans.append(StagePlan(group, stage.name, partition, stage.nodes, tpn, gres, stage.switches,
                               stage.switch_wait, stage.cpus_per_task, spares,
                               default.feature if default else ""))
    return tuple(plans)


@dataclass(frozen=True, slots=True)
class AllocationShape:
    """One homogeneous ``--no-kill`` allocation holding every stage's nodes and spares."""

    partition: str
    nodes: int
    tasks_per_node: int
    gres: str
    switches: int
    switch_wait: str
    constraint: str
    """``[feat*N&feat*M]`` when the stages are told apart by node features; empty otherwise."""
    cpus_per_task: int
    min_nodes: int = 0
    """The stages' nodes without spares: a resubmission asks ``--nodes=min_nodes-nodes`` (Slurm
    gives what it has up to the maximum), since the nodes the job lost are excluded."""


def allocation_shape(plans: Sequence[StagePlan]) -> tuple[AllocationShape | None, str]:
    """The in-allocation request for ``plans``, or None and why the stages need a heterogeneous job.

    One allocation has one partition and one gres request per node. Stages of the same kind (the same
    partition and gres) share it as they are; stages of different kinds are told apart by the site's
    node features and asked for with ``--constraint`` counts (Slurm's "multiple counts",
    ``[vis*2&txt*3]``), which needs a feature on every stage. Different partitions, or different
    gres without features, fall back to the heterogeneous job (recovery by resubmission)."""
    partitions = {p.partition for p in plans}
    if len(partitions) > 1:
        return None, (f"stages use partitions {sorted(partitions)}: one allocation has one partition "
                      f"(give the stages one partition and tell their node kinds apart by "
                      f"stages.NAME.feature)")
    features = [p.feature for p in plans]
    gres = {p.gres for p in plans}
    if any(features) and not all(features):
        return None, "only some stages name a node feature: --constraint counts need one on every stage"
    if len(gres) > 1 and not all(features):
        return None, (f"stages need gres {sorted(gres)}: one allocation asks one gres per node unless "
                      f"node features tell the kinds apart")
    constraint = ""
    if all(features):
        counts: dict[str, int] = {}
        for p in plans:
            counts[p.feature] = counts.get(p.feature, 0) + p.nodes + p.spares
        constraint = "[" + "&".join(f"{f}*{n}" for f, n in counts.items()) + "]"
    # each stage was allowed its own leaf switches: together they may span their sum.
    # with features the gres asked per node is the smallest that every kind has
    gres_req = min(gres, key=lambda g: parse_gres(g).count)
    return AllocationShape(
        partition=partitions.pop(), nodes=sum(p.nodes + p.spares for p in plans),
        tasks_per_node=max(p.tasks_per_node for p in plans), gres=gres_req,
        switches=sum(p.switches for p in plans), switch_wait=plans[0].switch_wait, constraint=constraint,
        cpus_per_task=max(p.cpus_per_task for p in plans), min_nodes=sum(p.nodes for p in plans)), ""


def supervisor_stages_arg(plans: Sequence[StagePlan]) -> str:
    """``omni supervise --stages``: ``NAME:NODES:TASKS_PER_NODE:SPARES[:FEATURE]`` per stage."""
    return ",".join(f"{p.name}:{p.nodes}:{p.tasks_per_node}:{p.spares}" + (f":{p.feature}" if p.feature else "")
                    for p in plans)


def exit_code_table() -> dict[str, int]:
    """The runtime's exit codes; the batch script exits with the same numbers."""
    return {"done": EXIT_DONE, "requeue": EXIT_CHECKPOINTED,
            "failed": EXIT_FAILED, "bad_input": EXIT_BAD_INPUT}


def spank_stage_arg(plans: Sequence[StagePlan]) -> str:
    """``--omni-stage`` value: ``NAME:NTASKS`` per het group, in group order."""
    return ",".join(f"{p.name}:{p.ntasks}" for p in plans)


def python_for(site: SiteConfig | None) -> str:
    """The Python batch scripts run: the site's ``python``, else the one rendering this script."""
    return str(site.python) if site is not None and site.python is not None else os.path.abspath(sys.executable)


def omni_argv(site: SiteConfig | None) -> tuple[str, ...]:
    """``omni`` on the compute nodes, by absolute path: no reliance on PATH or an activated venv."""
    return (python_for(site), "-m", "slurm_omni.cli.main")


def command_fields(job: JobFile, site: SiteConfig | None, job_file: Path) -> dict[str, str]:
    return {"python": python_for(site), "omni": " ".join(omni_argv(site)), "job_dir": str(job_file.parent),
            "job_file": str(job_file), "job_name": job.job.name}


def training_command(job: JobFile, site: SiteConfig | None, job_file: Path) -> tuple[str, ...]:
    """The argv every rank runs: the job file's ``[training] command`` with its fields filled in (a
    word ``{omni}`` becomes omni's argv), else the built-in trainer."""
    if not job.training.command:
        return (*omni_argv(site), "train", "--config", str(job_file))
    fields = command_fields(job, site, job_file)
    out: list[str] = []
    for i, word in enumerate(job.training.command):
        if word == "{omni}":
            out += omni_argv(site)
        else:
            out.append(substitute(word, fields, where=f"training.command[{i}]"))
    return tuple(out)


def check_command(argv: Sequence[str], job_name: str, workdir: Path | None = None) -> None:
    """The program must be there (here, where the batch script also looks first), and so must a script
    file it is given (a relative one in ``workdir``, where the ranks start): one ConfigError line
    naming the job and what to fix."""
    program = argv[0]
    found = (os.access(program, os.X_OK) and os.path.isfile(program)) if os.sep in program else shutil.which(program)
    if not found:
        raise ConfigError(f"job {job_name}: couldn't find [training] command's program {program!r} (give an "
                          "absolute path, or {python} for the Python with slurm-omni)")
    for word in argv[1:]:
        if not word.endswith(".py") or word.startswith("-"):
            continue
        if os.path.isabs(word) and not os.path.isfile(word):
            raise ConfigError(f"job {job_name}: couldn't find {word} named in [training] command (write "
                              "{job_dir}/SCRIPT.py for a script beside the job file)")
        if workdir is not None and not os.path.isabs(word) and not (workdir / word).is_file():
            raise ConfigError(f"job {job_name}: couldn't find {word} named in [training] command in the job's "
                              f"working folder {workdir} (the ranks start there: [job] workdir, default the job "
                              "file's folder)")


def command_env(job: JobFile, site: SiteConfig | None, job_file: Path) -> dict[str, str]:
    """The job file's ``[training.env]`` with its fields filled in."""
    fields = command_fields(job, site, job_file)
    return {k: substitute(v, fields, where=f"training.env.{k}") for k, v in job.training.env.items()}


def _job_env(job: JobFile, site: SiteConfig, job_file: Path, plans: Sequence[StagePlan],
             owner: str) -> dict[str, str]:
    """OMNI_* variables that do not depend on the allocation, then the job file's ``[training.env]``;
    the template adds the rest."""
    user = command_env(job, site, job_file)
    ckpt = site.checkpoint.job_dir(owner, job.job.name)
    return {
        "OMNI_JOB_NAME": job.job.name,
        "OMNI_JOB_FILE": str(job_file),
        # the batch script cd's here and the supervisor gives its sruns --chdir: every rank starts in it
        "OMNI_WORKDIR": str(job.job.workdir),
        "OMNI_CKPT_DIR": str(ckpt),
        # where slurm_omni.manager.registry looks for them: shared storage every rank and the manager see
        "OMNI_HEARTBEAT_DIR": str(ckpt / "heartbeat"),
        "OMNI_DP_SIZE": str(job.job.data_parallel_size),
        "OMNI_STAGES": ",".join(p.name for p in plans),
        "OMNI_STAGE_TASKS": ",".join(str(p.ntasks) for p in plans),
        "OMNI_SPOOL_DIR": str(site.manager.spool_dir),
        # one folder per job: the runtime replaces its own omni-<stage>-*.prom files at start
        "OMNI_METRICS_DIR": str(site.manager.metrics_for(owner) / job.job.name),
        "OMNI_HEARTBEAT_INTERVAL": f"{site.detection.heartbeat_interval_s:g}",
        "OMNI_MAX_STEPS": str(job.training.max_steps),
        **_memory_env(job, site),
        **user,
    }


def _memory_env(job: JobFile, site: SiteConfig) -> dict[str, str]:
    """The memory tier's switch and cap (checkpoint/memtier.py), only where the job turns it on."""
    if not job.training.checkpoint.memory_tier:
        return {}
    cap, where = site.checkpoint.memory_gib, site.checkpoint.memory_dir
    c = job.training.checkpoint
    cadence = {"OMNI_MEMORY_EVERY_STEPS": str(c.memory_every_steps), "OMNI_FILES_EVERY": str(c.files_every),
               "OMNI_FILES_EVERY_S": f"{c.files_every_s:g}"}
    return {"OMNI_MEMORY_TIER": "1", **({"OMNI_MEMORY_GIB": f"{cap:g}"} if cap is not None else {}),
            **({"OMNI_MEMORY_DIR": str(where)} if where is not None else {}),
            **{k: v for k, v in cadence.items() if v != "0"}}


def _quoted_env(env: dict[str, str]) -> list[tuple[quoting.Quoted, quoting.Quoted]]:
    return [(quoting.Quoted(k), quoting.shell(v)) for k, v in env.items()]


@dataclass(frozen=True, kw_only=True, slots=True)
class HetJobRequest:
    """A heterogeneous job: one component per stage, group 0 runs the batch script."""

    job: JobFile
    site: SiteConfig
    job_file: Path
    """Where the batch script finds the job file (absolute: requeued jobs start elsewhere)."""
    job_sha256: str
    """Digest of the job file's bytes, recorded in the script's header."""
    command: tuple[str, ...] = ()
    """The step's argv; empty: ``omni train --config JOB_FILE``."""
    template: str = HET_TEMPLATE
    extra: dict[str, Any] = field(default_factory=dict)
    """More template variables (the drill template's)."""
    incarnation_base: int = 0
    """OMNI_INCARNATION of this submission's first life (Slurm's requeues add their restart count):
    0 for ``omni submit``, one past the last life of the job for a resubmission by the manager."""
    user: str = field(default_factory=current_user)
    """Whose job it is: its checkpoint folder is ``<root>/<user>/<name>``."""

    def __post_init__(self) -> None:
        if self.incarnation_base < 0:
            raise ConfigError(f"render: incarnation_base = {self.incarnation_base} (0 or more)")

    @property
    def recovery(self) -> str:
        """The recovery path asked for: the job file's ``[job] recovery``, else the site's default;
        ``allocation`` where the site does not allow it is ``in_allocation`` (its fallback)."""
        asked = self.job.job.recovery or self.site.elasticity.default_recovery
        return "in_allocation" if asked == "allocation" and not self.site.elasticity.allow_allocation else asked

    def in_allocation(self) -> tuple[AllocationShape | None, str]:
        """The allocation when this job runs in-allocation (with or without a batch script); None and
        why it is a heterogeneous job. A job in allocation mode renders the in-allocation script too:
        it is what the manager resubmits when the allocation itself is lost."""
        if self.recovery not in ("in_allocation", "allocation"):
            return None, "recovery = resubmit"
        return allocation_shape(plan_stages(self.job, self.site))

    def context(self) -> dict[str, Any]:
        plans = plan_stages(self.job, self.site)
        command = self.command or training_command(self.job, self.site, self.job_file)
        j = self.job.job
        shape, why_not = self.in_allocation()
        template = self.template
        if shape is not None and self.template == HET_TEMPLATE:
            template = IN_ALLOCATION_TEMPLATE
        elif shape is not None and self.template == DRILL_TEMPLATE:
            template = IN_ALLOCATION_DRILL_TEMPLATE
        elif self.recovery in ("in_allocation", "allocation"):
            log.warning("render: %s runs as a heterogeneous job (recovery by resubmission): %s", j.name, why_not)
        return {
            "template": template,
            "supervised": template in (IN_ALLOCATION_TEMPLATE, IN_ALLOCATION_DRILL_TEMPLATE),
            "allocation": shape,
            "recovery_note": why_not if self.recovery in ("in_allocation", "allocation") and shape is None else "",
            "supervisor_stages": supervisor_stages_arg(plans),
            "min_dp": self.site.elasticity.min_data_parallel_size,
            "units_divide": _units_divide(self.job, plans),
            "spare_policy": self.site.elasticity.spare_policy,
            "max_relaunches": self.site.elasticity.max_relaunches,
            "heartbeat_interval": f"{self.site.detection.heartbeat_interval_s:g}",
            "confirmation_window": f"{self.site.detection.confirmation_window_s:g}",
            "hang_factor": f"{self.site.detection.confirm.hang_factor:g}",
            "version": __version__,
            "job_file": self.job_file,
            "job_sha256": self.job_sha256,
            "job": j,
            "output": _output(j.log_dir, "%x-%j.out"),
            "log_dir": j.log_dir,
            "stages": plans,
            "het_groups": ",".join(str(p.het_group) for p in plans),
            "spank": self.site.use_spank_plugin,
            "spank_stage": spank_stage_arg(plans),
            "ckpt_dir": self.site.checkpoint.job_dir(self.user, j.name),
            "env": _quoted_env(_job_env(self.job, self.site, self.job_file, plans, self.user)),
            "exit": exit_code_table(),
            "command": command,
            "incarnation_base": self.incarnation_base,
            "incarnation_stride": REQUEUE_INCARNATION_STRIDE,
            "omni": omni_argv(self.site),
            **self.extra,
        }

    def materialize(self) -> str:
        context = self.context()
        return engine.render(context["template"], context)


# Runs in every task of a drill step: the target rank arms a timer that signals the task itself,
# then every rank execs the real command (same pid, so the timer hits the trainer).
DRILL_WRAPPER = """\
allowed=$1 target=$2 after=$3 sig=$4
shift 4
me=${RANK:-${SLURM_PROCID:-}}
# in an in-allocation job only the first launch: a relaunch of the step must not get the fault again
if [[ $me == "$target" && ${OMNI_LAUNCH:-0} == 0 ]]; then
    if [[ ",$allowed," == *",${SLURMD_NODENAME:-},"* ]]; then
        echo "omni drill: rank $me on $SLURMD_NODENAME gets SIG$sig in ${after}s" >&2
        ( sleep "$after"; kill -s "$sig" "$$" ) &
    else
        echo "omni drill: rank $me runs on ${SLURMD_NODENAME:-?}, outside drills.allowed_nodes: no fault" >&2
    fi
fi
exec "$@"
"""

DrillSignal = Literal["KILL", "TERM", "SEGV", "ABRT", "BUS"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillRequest:
    """A training job with one fault injected on purpose: ``rank`` gets ``signal`` ``after_s``
    seconds after it starts, if it runs on a node the site lets drills touch."""

    job: JobFile
    site: SiteConfig
    job_file: Path
    job_sha256: str
    rank: int
    after_s: int
    signal: DrillSignal = "KILL"
    command: tuple[str, ...] = ()
    """The step's argv under the drill wrapper; empty: ``omni train --config JOB_FILE``."""
    user: str = field(default_factory=current_user)

    def het_request(self) -> HetJobRequest:
        allowed = self.site.drills.nodes
        if not allowed:
            raise ConfigError("drill: couldn't render: drills.allowed_nodes is empty in the site config "
                              "(drills are refused)")
        ranks = sum(p.ntasks for p in plan_stages(self.job, self.site))
        if not 0 <= self.rank < ranks or self.after_s < 0:
            raise ConfigError(f"drill: rank = {self.rank}, after_s = {self.after_s} are not allowed "
                              f"(expected 0 <= rank < {ranks}, after_s >= 0)")
        inner = self.command or training_command(self.job, self.site, self.job_file)
        command = ("bash", "-c", DRILL_WRAPPER, "omni-drill", ",".join(allowed), str(self.rank),
                   str(self.after_s), self.signal, *inner)
        drill = {"rank": self.rank, "signal": self.signal, "after_s": self.after_s,
                 "allowed": self.site.drills.allowed_nodes}
        return HetJobRequest(job=self.job, site=self.site, job_file=self.job_file, job_sha256=self.job_sha256,
                             command=command, template=DRILL_TEMPLATE, extra={"drill": drill}, user=self.user)

    def materialize(self) -> str:
        return self.het_request().materialize()


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayJobRequest:
    """A sweep: one array task per job file, each an independent elastic job.

    Slurm 22.05 has no arrays of heterogeneous jobs, so an array task packs all stages into one
    component: stage ``k`` takes global ranks after those of stages ``0..k-1`` (the SPANK plugin
    and ``OMNI_STAGE_TASKS`` say which). The files must ask for the same shape.
    """

    jobs: tuple[JobFile, ...]
    site: SiteConfig
    job_files: tuple[Path, ...]
    job_sha256s: tuple[str, ...]
    name: str = ""
    """Array job name; empty: the first job's name."""
    max_parallel: int = 0
    """``--array=0-N%max_parallel``; 0: no limit."""
    command: tuple[str, ...] = ()
    """The step's argv before ``--config FILE``; empty: ``omni train``."""
    incarnation_bases: tuple[int, ...] = ()
    """Per task, OMNI_INCARNATION of its first life (see ``HetJobRequest``); empty: all 0."""
    user: str = field(default_factory=current_user)

    def context(self) -> dict[str, Any]:
        if not self.jobs or len(self.jobs) != len(self.job_files) or len(self.jobs) != len(self.job_sha256s):
            raise ConfigError("render: couldn't build a sweep: expected one digest per job file, at least one")
        bases = self.incarnation_bases or (0,) * len(self.jobs)
        if len(bases) != len(self.jobs) or min(bases) < 0:
            raise ConfigError(f"render: couldn't build a sweep: incarnation_bases = {bases} (one per job file, "
                              f"0 or more)")
        own = [str(f) for job, f in zip(self.jobs, self.job_files, strict=True) if job.training.command]
        if own and not self.command:
            raise ConfigError(f"render: couldn't put {own[0]} in a sweep: its [training] command runs your own "
                              "script, and a sweep runs the built-in trainer only (submit it on its own)")
        plans = [plan_stages(job, self.site) for job in self.jobs]
        shape = _array_shape(plans[0], str(self.job_files[0]))
        for path, p in zip(self.job_files[1:], plans[1:], strict=True):
            if _array_shape(p, str(path)) != shape:
                raise ConfigError(f"render: couldn't put {path} in the sweep: its stages ask for another "
                                  f"shape than {self.job_files[0]} (array tasks share one request)")
        first = self.jobs[0].job
        names = [job.job.name for job in self.jobs]
        if len(set(names)) != len(names):
            raise ConfigError(f"render: couldn't build a sweep: job names {names} repeat (each names its "
                              f"checkpoint folder)")
        limits = {job.job.time_limit for job in self.jobs}
        if len(limits) > 1:
            raise ConfigError(f"render: couldn't build a sweep: time limits differ ({sorted(limits)})")
        tasks = [
            {"job_file_comment": quoting.Quoted(json.dumps(str(f))), "env": _quoted_env(_job_env(job, self.site, f, p, self.user)),
             "sha256": s, "name": job.job.name, "spank_stage": quoting.shell(spank_stage_arg(p)),
             "incarnation_base": b}
            for job, f, p, s, b in zip(self.jobs, self.job_files, plans, self.job_sha256s, bases, strict=True)
        ]
        return {
            "version": __version__,
            "name": self.name or first.name,
            "job": first,
            "output": _output(first.log_dir, "%x-%A_%a.out"),
            "log_dir": first.log_dir,
            "shape": shape,
            "array": f"0-{len(self.jobs) - 1}" + (f"%{self.max_parallel}" if self.max_parallel else ""),
            "tasks": tasks,
            "spank": self.site.use_spank_plugin,
            "exit": exit_code_table(),
            "command": self.command or (*omni_argv(self.site), "train"),
            "omni": omni_argv(self.site),
        }

    def materialize(self) -> str:
        return engine.render(ARRAY_TEMPLATE, self.context())


def _units_divide(job: JobFile, plans: Sequence[StagePlan]) -> int:
    """A placement unit count must divide this (the global batch in one unit's micro-batches; 0: any):
    the elastic resume keeps the global batch, so every replica count must cut it evenly."""
    units = math.gcd(*(p.nodes for p in plans))
    per_unit = job.job.data_parallel_size // units * job.training.parallel.micro_batch_size
    total = job.training.parallel.global_batch_size
    return total // per_unit if per_unit and total % per_unit == 0 else 0


def _output(log_dir: Path, pattern: str) -> quoting.Quoted:
    """``--output`` value: the user's folder taken literally, then Slurm's own ``pattern``."""
    return quoting.sbatch(quoting.slurm_filename(log_dir) + "/" + pattern)


def _array_shape(plans: Sequence[StagePlan], where: str) -> dict[str, Any]:
    tpn = {p.tasks_per_node for p in plans}
    gres = {p.gres for p in plans}
    if len(tpn) > 1 or len(gres) > 1:
        raise ConfigError(f"render: couldn't put {where} in a sweep: its stages differ in tasks per node "
                          f"or gres ({sorted(tpn)}, {sorted(gres)}); one array task is one component")
    partitions = list(dict.fromkeys(p.partition for p in plans))
    return {"partition": ",".join(partitions), "nodes": sum(p.nodes for p in plans),
            "tasks_per_node": tpn.pop(), "gres": gres.pop(), "switches": max(p.switches for p in plans),
            "switch_wait": plans[0].switch_wait, "ntasks": sum(p.ntasks for p in plans)}
