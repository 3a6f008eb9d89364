"""``omni config check FILE``: load a site config or a job file as the tools will, and say so."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from slurm_omni.config.job import load_job
from slurm_omni.config.schema import read_toml
from slurm_omni.config.site import load_site, site_path
from slurm_omni.render import plan_stages
from slurm_omni.render.request import check_command, training_command


@click.group()
def config() -> None:
    """Check site configs and job files."""


@config.command()
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--site", "site_file", type=click.Path(path_type=Path, dir_okay=False),
              help="For a job file: also check it against this site config (default: $OMNI_SITE_CONFIG "
                   "or /etc/slurm-omni/omni.toml, when present).")
def check(file: Path, site_file: Path | None) -> None:
    """Load FILE strictly (a job file when it has a [job] table, else a site config)."""
    if "job" not in read_toml(file):
        site = load_site(file)
        click.echo(f"ok: {file}: site config of cluster {site.cluster!r}, stages "
                   f"{', '.join(site.stages)}, checkpoints in {site.checkpoint.root}")
        return
    job = load_job(file)
    stages = ", ".join(f"{s.name} x{s.nodes}" for s in job.stages)
    site_at = site_path(site_file)
    if site_file is None and not site_at.exists():
        click.echo(f"ok: {file}: job {job.job.name!r}, stages {stages} (no site config at {site_at} to "
                   f"check against)")
        return
    site = load_site(site_at)
    plans = plan_stages(job, site)
    placed = ", ".join(f"{p.name} on {p.partition} {p.nodes}x{p.tasks_per_node} {p.gres}" for p in plans)
    runs = ""
    if job.training.command:
        argv = training_command(job, site, file.resolve())
        check_command(argv, job.job.name)
        runs = f"; runs {shlex.join(argv)}"
    click.echo(f"ok: {file}: job {job.job.name!r}, {placed}{runs}")
