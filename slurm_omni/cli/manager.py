"""``omni manager run``: the requeue manager daemon; ``omni status``: what it knows of each job."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import click

from slurm_omni.config.site import SiteConfig, load_site, site_path

_site_option = click.option("--site-config", "site_file", type=click.Path(path_type=Path, dir_okay=False),
                            help="Site config (default: $OMNI_SITE_CONFIG, else /etc/slurm-omni/omni.toml).")
_state_option = click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False),
                             help="Journal and timeline folder (default: manager/ beside the site's registry_dir).")


def _state_dir(site: SiteConfig, state_dir: Path | None) -> Path:
    from slurm_omni.manager.daemon import default_state_dir
    return (state_dir or default_state_dir(site)).resolve()


@click.group()
def manager() -> None:
    """The requeue manager: confirms failures, replaces nodes by topology, resubmits, shrinks, grows."""


@manager.command()
@_site_option
@_state_option
@click.option("--once", is_flag=True, help="One poll and one round of decisions, then exit.")
@click.option("--poll-interval", type=click.FloatRange(min=0.2), default=2.0, show_default=True,
              help="Seconds between polls of sinfo/squeue (one poll serves every job).")
@click.option("--tick", type=click.FloatRange(min=0.05), default=0.25, show_default=True,
              help="Seconds between reads of the spool and heartbeat files.")
@click.option("--no-grow", is_flag=True, help="Never grow a shrunk job back.")
def run(site_file: Path | None, state_dir: Path | None, once: bool, poll_interval: float, tick: float,
        no_grow: bool) -> None:
    """Run the manager until SIGTERM or SIGINT (journal: STATE_DIR/journal.sqlite, timeline:
    STATE_DIR/timeline.json). $OMNI_MANAGER_CRASH_AT names a crash point for drills."""
    import os

    from slurm_omni.manager.daemon import Manager, ManagerConfig
    from slurm_omni.slurm.backend import get_backend

    site = load_site(site_path(site_file))
    config = ManagerConfig(site=site, state_dir=_state_dir(site, state_dir), poll_interval_s=poll_interval,
                           tick_s=tick, grow=not no_grow, crash_at=os.environ.get("OMNI_MANAGER_CRASH_AT", ""))
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    m = Manager(config, get_backend("cli"))
    try:
        m.run(once=once, stop=stop)
    finally:
        m.close()


@click.command()
@_site_option
@_state_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable: jobs, incarnations, recoveries.")
def status(site_file: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """Each registered job: incarnations, layout, last checkpoint, heartbeat lag, recovery timelines."""
    import os

    from slurm_omni.errors import OmniError
    from slurm_omni.manager.journal import Journal
    from slurm_omni.manager.status import format_status, status_view

    site = load_site(site_path(site_file))
    path = _state_dir(site, state_dir) / "journal.sqlite"
    if not path.exists():
        raise OmniError(f"status: couldn't read {path}: no journal yet (is `omni manager run` running with "
                        f"this site config?)")
    with Journal(path, readonly=True) as journal:
        jobs = status_view(journal, os.geteuid(), time.time())
    if as_json:
        click.echo(json.dumps({"jobs": jobs}, indent=1, sort_keys=True))
    else:
        click.echo(format_status(jobs), nl=False)
