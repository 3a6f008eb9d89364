"""``omni cluster up | down | status | env``: the embedded local Slurm cluster."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import click

from slurm_omni.cluster.local import LocalCluster
from slurm_omni.cluster.spec import DEFAULT_STATE_DIR, ClusterSpec
from slurm_omni.cluster.versions import VERSIONS
from slurm_omni.config.schema import load_dataclass, read_toml
from slurm_omni.errors import ClusterError, OmniError
from slurm_omni.slurm.cli_backend import CliBackend

state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path),
    default=lambda: os.environ.get("OMNI_CLUSTER_DIR", str(DEFAULT_STATE_DIR)), show_default=".omni/cluster",
    help="Where the cluster's config, logs and state live (env OMNI_CLUSTER_DIR).")


@click.group()
def cluster() -> None:
    """The embedded Slurm cluster (22.05, 24.11 or 26.05): one slurmctld and one slurmd per node on 127.0.0.1."""


@cluster.command()
@state_dir_option
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="A TOML file whose [cluster] table sets the shape (e.g. site-config/omni.toml).")
@click.option("--nodes", type=int, help="Number of nodes [8].")
@click.option("--nodes-per-switch", type=int, help="Nodes under each leaf switch [4].")
@click.option("--gpus-per-node", type=int, help="Fake GPUs per node [4].")
@click.option("--gres-type", help="GPU type name [h100].")
@click.option("--cpus-per-node", type=int, help="CPUs each node declares [4].")
@click.option("--ctld-port", type=int, help="slurmctld's port [16817]; a second cluster needs others.")
@click.option("--slurmd-base-port", type=int, help="First slurmd port [16900].")
@click.option("--first-job-id", type=int,
              help="First job id [1]; clusters running side by side on one machine need ranges that "
                   "don't overlap (scripts take their rendezvous port from the job id).")
@click.option("--slurm", "slurm_version", type=click.Choice(list(VERSIONS)),
              help="Slurm version [22.05: the host's packages]; 24.11 and 26.05 run from a Debian root "
                   "built once and cached (OMNI_SLURM_ROOTS, default /var/cache/slurm-omni/roots).")
@click.option("--wait", "wait_s", type=float, default=90.0, show_default=True,
              help="Seconds to wait for every node to be idle.")
def up(state_dir: Path, config_file: Path | None, wait_s: float, **shape: Any) -> None:
    """Generate the configs, start munge, slurmctld and the slurmds, and wait until all nodes are idle."""
    recorded = LocalCluster(state_dir).recorded_spec()
    spec = _spec(config_file, shape, recorded)
    lc = LocalCluster(state_dir, spec)
    started = lc.up(wait_s=wait_s)
    verb = "up" if started else "already up"
    click.echo(f"cluster {verb}: {lc.spec.nodes} nodes, Slurm {lc.spec.slurm_version}, in {lc.paths.root}")
    for line in lc.env_lines():
        click.echo(line)


def _spec(config_file: Path | None, flags: dict[str, Any], recorded: ClusterSpec | None = None) -> ClusterSpec | None:
    """The shape from a config file and flags; flags alone change only what they name of the shape
    the state directory records (``up --slurm 24.11`` again is the same cluster, not a reshape)."""
    table: dict[str, Any] = {}
    if recorded is not None and config_file is None:
        table = {f.name: getattr(recorded, f.name) for f in dataclasses.fields(recorded)}
        table["partitions"] = list(recorded.partitions)
    if config_file is not None:
        table = dict(read_toml(config_file).get("cluster", {}))
    table.update({k: v for k, v in flags.items() if v is not None})
    if not table and config_file is None:
        return None  # keep whatever shape the state directory records
    return load_dataclass(ClusterSpec, table, source=str(config_file or "command line"), prefix="cluster"
                          if config_file else "")


@cluster.command()
@state_dir_option
def down(state_dir: Path) -> None:
    """Stop the daemons this state directory started (never a system Slurm)."""
    stopped = LocalCluster(state_dir).down()
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing of ours was running")


@cluster.command()
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(state_dir: Path, as_json: bool) -> None:
    """Nodes with states, reasons, switches and gres; the daemons and their pids."""
    lc = LocalCluster(state_dir)
    if lc.recorded_spec() is None:
        raise ClusterError(f"cluster: no cluster in {lc.paths.root} (run 'omni cluster up')")
    daemons = lc.running()
    doc: dict[str, Any] = {"state_dir": str(lc.paths.root), "slurm_conf": str(lc.paths.slurm_conf),
                           "slurm_version": lc.spec.slurm_version, "daemons": daemons,
                           "up": all(daemons.values())}
    try:
        backend = CliBackend(env=lc.env, timeout_s=5, retries=0)
        doc["slurm_release"] = backend.version()
        topo = backend.topology(refresh=True)
        nodes = backend.nodes()
        doc["nodes"] = [_node_doc(n) for n in nodes]
        doc["switches"] = [dataclasses.asdict(s) for s in topo.switches.values()]
    except OmniError as e:
        doc.update(nodes=[], switches=[], error=str(e))
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=list))
        return
    click.echo(f"state dir {doc['state_dir']}  Slurm {doc.get('slurm_release', doc['slurm_version'])}  "
               f"({'up' if doc['up'] else 'partly down'})")
    for name, pid in daemons.items():
        click.echo(f"  {name:<14} {'pid ' + str(pid) if pid else 'not running'}")
    if "error" in doc:
        click.echo(f"slurmctld: {doc['error']}")
    click.echo(f"{'NODE':<8} {'STATE':<22} {'GRES':<14} {'SWITCHES':<14} REASON")
    for n in doc["nodes"]:
        click.echo(f"{n['name']:<8} {n['slurm_state']:<22} {','.join(n['gres']):<14} "
                   f"{'/'.join(n['switch_path']):<14} {n['reason']}")


def _node_doc(n: Any) -> dict[str, Any]:
    return {"name": n.name, "state": n.state.value, "slurm_state": n.slurm_state, "flags": sorted(n.flags),
            "reason": n.reason, "gres": [str(g) for g in n.gres], "partitions": list(n.partitions),
            "switch_path": list(n.switch_path)}


@cluster.command()
@state_dir_option
def env(state_dir: Path) -> None:
    """Print the shell line that points Slurm clients at this cluster (eval "$(omni cluster env)")."""
    lc = LocalCluster(state_dir)
    for line in lc.env_lines():
        click.echo(line)


@cluster.command("kill")
@state_dir_option
@click.argument("daemon")
@click.option("--signal", "sig", default="KILL", show_default=True, help="Signal name.")
def kill_(state_dir: Path, daemon: str, sig: str) -> None:
    """Signal one daemon we started (e.g. ``slurmd:node3``), for drills."""
    try:
        signum = signal.Signals["SIG" + sig.upper().removeprefix("SIG")]
    except KeyError as e:
        raise ClusterError(f"cluster: couldn't use signal {sig!r} (e.g. KILL, TERM, STOP)") from e
    pid = LocalCluster(state_dir).kill_daemon(daemon, signum)
    click.echo(f"sent {signum.name} to {daemon} (pid {pid})")
