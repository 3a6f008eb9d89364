"""``omni config check FILE``: load a site config or a job file as the tools will, and say so."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import click

from slurm_omni.config.cluster_check import cluster_problems
from slurm_omni.config.job import load_job
from slurm_omni.config.schema import read_toml
from slurm_omni.config.site import SiteConfig, load_site, parse_gres, site_path
from slurm_omni.errors import ConfigError
from slurm_omni.render import plan_stages
from slurm_omni.render.request import check_command, training_command
from slurm_omni.slurm.backend import get_backend
from slurm_omni.slurm.hostlist import expand
from slurm_omni.slurm.types import Gres


@click.group()
def config() -> None:
    """Check site configs and job files."""


@config.command()
# no exists/dir_okay checks here: read_toml says what is wrong in one line (click prints usage)
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--site", "site_file", type=click.Path(path_type=Path),
              help="For a job file: also check it against this site config (default: $OMNI_SITE_CONFIG "
                   "or /etc/slurm-omni/omni.toml, when present).")
@click.option("--cluster", "against_cluster", is_flag=True,
              help="Also check partitions, gres and node names against the running cluster (sinfo).")
def check(file: Path, site_file: Path | None, against_cluster: bool) -> None:
    """Load FILE strictly (a job file when it has a [job] table, else a site config)."""
    if "job" not in read_toml(file):
        site = load_site(file)
        if against_cluster:
            _check_cluster(file, [(f"stages.{name}", s.partition, parse_gres(s.gres))
                                  for name, s in site.stages.items()], _site_node_lists(site))
        click.echo(f"ok: {file}: site config of cluster {site.cluster!r}, stages "
                   f"{', '.join(site.stages)}, checkpoints in {site.checkpoint.root}"
                   + (", fits the running cluster" if against_cluster else ""))
        return
    job = load_job(file)
    stages = ", ".join(f"{s.name} x{s.nodes}" for s in job.stages)
    site_at = site_path(site_file)
    if site_file is None and not site_at.exists():
        if against_cluster:
            raise ConfigError(f"config: couldn't check {file} against the cluster: no site config at "
                              f"{site_at} to place its stages (pass --site)")
        click.echo(f"ok: {file}: job {job.job.name!r}, stages {stages} (no site config at {site_at} to "
                   f"check against)")
        return
    site = load_site(site_at)
    plans = plan_stages(job, site)
    if against_cluster:
        _check_cluster(file, [(f"stages {p.name!r}", p.partition, parse_gres(p.gres) if p.gres else None)
                              for p in plans], _site_node_lists(site))
    placed = ", ".join(f"{p.name} on {p.partition} {p.nodes}x{p.tasks_per_node} {p.gres}" for p in plans)
    runs = ""
    if job.training.command:
        argv = training_command(job, site, file.resolve())
        check_command(argv, job.job.name, job.job.workdir)
        runs = f"; runs {shlex.join(argv)}"
    click.echo(f"ok: {file}: job {job.job.name!r}, {placed}{runs}"
               + (", fits the running cluster" if against_cluster else ""))


def _site_node_lists(site: SiteConfig) -> list[tuple[str, Sequence[str]]]:
    return [("drills.allowed_nodes", site.drills.nodes),
            ("elasticity.spare_nodes", expand(site.elasticity.spare_nodes))]


def _check_cluster(file: Path, stages: list[tuple[str, str, Gres | None]],
                   node_lists: list[tuple[str, Sequence[str]]]) -> None:
    nodes = get_backend().nodes()
    problems = cluster_problems(nodes, stages, node_lists)
    if problems:
        raise ConfigError(f"config: {file}: {problems[0]}"
                          + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
