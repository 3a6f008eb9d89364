"""``omni render`` prints a batch script; ``omni submit`` renders, submits and registers it."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from slurm_omni.checkpoint.fence import read_fence
from slurm_omni.config.job import JobFile, load_job
from slurm_omni.config.site import SiteConfig, load_site, site_path
from slurm_omni.errors import ConfigError, SlurmError
from slurm_omni.formats.registry import RegisteredTask
from slurm_omni.ownership import current_user, ensure_own_dir, user_folder
from slurm_omni.render import ArrayJobRequest, HetJobRequest, plan_stages
from slurm_omni.render.allocation import AllocationRequest, allocation_mode
from slurm_omni.render.registry import RegistryRecord, open_registry, register, registered_stages
from slurm_omni.render.request import check_command, training_command

if TYPE_CHECKING:
    from slurm_omni.slurm.runner import CommandRunner

log = logging.getLogger(__name__)

_SBATCH_ID = re.compile(r"([0-9]+)(?:;\S+)?")


def parse_sbatch_id(stdout: str) -> int:
    """Job id from ``sbatch --parsable``: ``1234`` or ``1234;cluster``."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    m = _SBATCH_ID.fullmatch(line.strip())
    if m is None:
        raise SlurmError(f"sbatch: couldn't read the job id from {stdout.strip()[:80]!r}")
    return int(m[1])


def _load(job_files: tuple[Path, ...], site_file: Path | None) -> tuple[list[tuple[Path, JobFile, str]], SiteConfig]:
    site = load_site(site_path(site_file))
    loaded = []
    for path in job_files:
        absolute = path.resolve()
        job = load_job(absolute)
        loaded.append((absolute, job, hashlib.sha256(absolute.read_bytes()).hexdigest()))
    return loaded, site


def _request(loaded: list[tuple[Path, JobFile, str]], site: SiteConfig, max_parallel: int,
             sweep: bool) -> HetJobRequest | ArrayJobRequest:
    if len(loaded) == 1 and not sweep:
        path, job, digest = loaded[0]
        return HetJobRequest(job=job, site=site, job_file=path, job_sha256=digest,
                             incarnation_base=first_incarnation(site.checkpoint.job_dir(current_user(), job.job.name)))
    return ArrayJobRequest(jobs=tuple(j for _, j, _ in loaded), site=site,
                           job_files=tuple(p for p, _, _ in loaded),
                           job_sha256s=tuple(d for _, _, d in loaded), max_parallel=max_parallel,
                           incarnation_bases=tuple(first_incarnation(site.checkpoint.job_dir(current_user(), j.job.name))
                                                   for _, j, _ in loaded))


_site_option = click.option("--site", "site_file", type=click.Path(path_type=Path, dir_okay=False),
                            help="Site config (default: $OMNI_SITE_CONFIG, else /etc/slurm-omni/omni.toml).")
_sweep_option = click.option("--sweep", is_flag=True,
                             help="A job array, one task per job file (implied by several files).")
_parallel_option = click.option("--max-parallel", type=click.IntRange(min=0), default=0,
                                help="At most this many array tasks at once (0: no limit).")
_files_argument = click.argument("job_files", nargs=-1, required=True,
                                 type=click.Path(path_type=Path, dir_okay=False))


@click.command()
@_files_argument
@_site_option
@_sweep_option
@_parallel_option
def render(job_files: tuple[Path, ...], site_file: Path | None, sweep: bool, max_parallel: int) -> None:
    """Print the batch script for JOB_FILES (one: a heterogeneous job; several: a sweep)."""
    loaded, site = _load(job_files, site_file)
    request = _request(loaded, site, max_parallel, sweep)
    script = request.materialize()
    if isinstance(request, HetJobRequest) and allocation_mode(request):
        first, rest = script.split("\n", 1)
        script = f"{first}\n{AllocationRequest(request).dry_run()}{rest}"
    click.echo(script, nl=False)


@click.command()
@_files_argument
@_site_option
@_sweep_option
@_parallel_option
@click.option("--hold", is_flag=True, help="Submit held (release with scontrol release).")
def submit(job_files: tuple[Path, ...], site_file: Path | None, sweep: bool, max_parallel: int,
           hold: bool) -> None:
    """Render, submit with sbatch and register the job with the manager (allocation mode: salloc, and
    the step supervisor started here)."""
    from slurm_omni.slurm.runner import CommandRunner

    loaded, site = _load(job_files, site_file)
    user = current_user()
    for _, job, _ in loaded:   # before the fence is read: a folder someone else made is never trusted
        ensure_own_dir(site.checkpoint.job_dir(user, job.job.name), below=site.checkpoint.root,
                       what="submit: checkpoint folder")
    # before sbatch: a job the manager would never read the registration of must not start
    registry_below, registry = user_folder(site.manager.registry_dir, user)
    open_registry(registry, below=registry_below).close()
    request = _request(loaded, site, max_parallel, sweep)
    script = request.materialize()
    for path, job, _ in loaded:
        if job.training.command:    # a missing program would fail every rank of every life
            check_command(training_command(job, site, path), job.job.name, job.job.workdir)
    for _, job, _ in loaded:
        _make_log_dir(job.job.log_dir)
    runner = CommandRunner()
    allocation = isinstance(request, HetJobRequest) and allocation_mode(request)
    if allocation and hold:
        raise ConfigError("submit: couldn't hold an allocation-mode job (salloc has no --hold; submit it "
                          "without --hold, or with [job] recovery = \"in_allocation\")")
    if isinstance(request, HetJobRequest) and allocation:
        job_id = _allocate(runner, request)
    else:
        argv = ["sbatch", "--parsable", *(["--hold"] if hold else [])]
        job_id = parse_sbatch_id(runner.run(argv, input_text=script, timeout_s=60).stdout)
    first_path, first, digest = loaded[0]
    script_path = _keep_script(first.job.log_dir, first.job.name, job_id, script)
    registration = RegistryRecord(
        job_id=job_id, kind="het" if isinstance(request, HetJobRequest) else "array", name=first.job.name,
        cluster=site.cluster, job_file=first_path, job_sha256=digest, script=script_path,
        ckpt_dir=site.checkpoint.job_dir(user, first.job.name), data_parallel_size=first.job.data_parallel_size,
        max_requeues=first.job.max_requeues, stages=registered_stages(plan_stages(first, site)),
        array_tasks=None if isinstance(request, HetJobRequest) else tuple(
            RegisteredTask(task_id=i, job_file=p, name=j.job.name, job_sha256=d,
                           ckpt_dir=site.checkpoint.job_dir(user, j.job.name),
                           incarnation_base=request.incarnation_bases[i])
            for i, (p, j, d) in enumerate(loaded)),
        incarnation_base=request.incarnation_base if isinstance(request, HetJobRequest) else 0,
        environment=runner.environment())   # what sbatch gave the job: the manager resubmits with it
    record = register(registry, registration, below=registry_below)
    if isinstance(request, HetJobRequest) and allocation:
        proc = _start_supervisor(runner, request, job_id)
        click.echo(f"submitted job {job_id} ({first.job.name}) as an allocation without a batch script; its step "
                   f"supervisor runs here as pid {proc.pid}; registered in {record}")
        return
    click.echo(f"submitted job {job_id} ({first.job.name}); registered in {record}")


def _allocate(runner: CommandRunner, request: HetJobRequest) -> int:
    """Allocation mode: ``salloc --no-shell --no-kill`` (detached: it may wait in the queue); its job id."""
    from slurm_omni.slurm.salloc import request_allocation

    j = request.job.job
    output = j.log_dir / f"{j.name}-salloc-{time.time_ns()}.out"
    job_id = request_allocation(runner, AllocationRequest(request).salloc_argv(), output)
    with contextlib.suppress(OSError):   # the id in the name, as sbatch's %j gives it
        output.rename(j.log_dir / f"{j.name}-{job_id}.salloc.out")
    return job_id


def _start_supervisor(runner: CommandRunner, request: HetJobRequest, job_id: int) -> subprocess.Popen[bytes]:
    """Allocation mode: the step supervisor, detached, here (it waits for the allocation to start);
    the manager starts it again if it is gone."""
    from slurm_omni.supervisor.outside import start_detached

    alloc = AllocationRequest(request)
    j = request.job.job
    return start_detached(runner, alloc.supervisor_argv(job_id), alloc.supervisor_env(job_id),
                          j.log_dir / f"{j.name}-{job_id}.supervisor.log")


def first_incarnation(ckpt_dir: Path) -> int:
    """A job submitted again onto a checkpoint root that earlier incarnations fenced (checkpoint/fence.py)
    numbers its lives past them; otherwise its checkpoints would all be refused."""
    fence = read_fence(ckpt_dir)
    return fence.incarnation + 1 if fence is not None else 0


def _make_log_dir(log_dir: Path) -> None:
    """sbatch does not create the ``--output`` folder; without it the job fails unseen."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"submit: couldn't create log_dir {log_dir}: {e.strerror} (job.log_dir)") from e


def _keep_script(log_dir: Path, name: str, job_id: int, script: str) -> Path | None:
    """A copy of what was submitted, next to the job's logs; losing it is not an error."""
    path = log_dir / f"{name}-{job_id}.sbatch"
    try:
        path.write_text(script)
    except OSError as e:
        log.warning("couldn't keep a copy of the script in %s: %s", path, e.strerror)
        return None
    return path

