"""``omni drill KIND --job NAME``: a fault on purpose against a running job, measured and checked.

Kinds: node-down (scontrol DOWN, then RESUME), kill-rank (SIGKILL to a pid from scontrol listpids),
stall-rank (SIGSTOP, SIGCONT after --stall-s), ckpt-crash (SIGKILL while a checkpoint persists),
slurmd-crash (SIGKILL to the embedded cluster's slurmd, then restart). ``--matrix`` runs several in a
row against the same job, each after the previous recovery. Only nodes of the site's
``drills.allowed_nodes`` are touched; each is returned to service afterwards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from slurm_omni.cluster.spec import DEFAULT_STATE_DIR
from slurm_omni.fsio import write_atomic


def _kinds(kind: str | None, matrix: str) -> list[str]:
    from slurm_omni.drill.run import KINDS
    from slurm_omni.errors import ConfigError

    if matrix:
        names = list(KINDS) if matrix == "all" else [k.strip() for k in matrix.split(",") if k.strip()]
    elif kind:
        names = [kind]
    else:
        raise ConfigError(f"drill: couldn't tell what to drill: give KIND or --matrix (kinds: {', '.join(KINDS)})")
    bad = [k for k in names if k not in KINDS]
    if bad:
        raise ConfigError(f"drill: kind {bad[0]!r} is not allowed (kinds: {', '.join(KINDS)}, or --matrix all)")
    return names


@click.command()
@click.argument("kind", required=False)
@click.option("--job", "job", required=True, help="Registered job: name or Slurm job id (omni submit).")
@click.option("--factor", type=float, default=1.5, show_default=True,
              help="slow-node: how many times slower the node's ranks run.")
@click.option("--method", type=click.Choice(["auto", "cgroup", "signals"]), default="signals", show_default=True,
              help="slow-node: SIGSTOP/SIGCONT duty cycles (exact factor), or a cgroup CPU quota of the "
                   "measured use / F (auto: where cgroups are writable; ranks that mostly wait get "
                   "starved bursts, see docs/failslow.md).")
@click.option("--duration", "duration_s", type=float, default=0.0, show_default=True,
              help="slow-node: seconds to keep the node slow (0: until Ctrl-C or SIGTERM).")
@click.option("--site", "site_file", type=click.Path(path_type=Path, dir_okay=False),
              help="Site config (default: $OMNI_SITE_CONFIG, else /etc/slurm-omni/omni.toml).")
@click.option("--matrix", default="", help="Comma-separated kinds to run in a row, or 'all'.")
@click.option("--node", default="", help="Node to drill (default: the job's last node drills may touch that runs "
              "ranks: never a spare, the batch host only when no other node runs ranks).")
@click.option("--rank", type=int, help="Global rank for the rank drills (default: lowest on the node).")
@click.option("--stall-s", type=float, default=10.0, show_default=True, help="stall-rank: SIGSTOP for this long.")
@click.option("--after-steps", type=int, default=3, show_default=True,
              help="Inject once the running incarnation has made this many steps.")
@click.option("--timeout", "timeout_s", type=float, default=240.0, show_default=True,
              help="Per drill: give up on the recovery after this long.")
@click.option("--timeline", type=click.Path(path_type=Path, dir_okay=False),
              help="The manager's timeline.json (default: its state dir beside the site's registry).")
@click.option("--reference", type=click.Path(path_type=Path, file_okay=False),
              help="Metrics folder of a run that never failed: wait for the job to finish and check "
                   "the loss curve and the data against it.")
@click.option("--run-reference", is_flag=True,
              help="Train the job file once here without a fault (local launcher) as the reference.")
@click.option("--rtol", type=float, default=1e-3, show_default=True,
              help="Loss tolerance when the layout changed (a shrink); same layout must be bitwise.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("drills"),
              show_default=True, help="Folder for drill-<n>-<kind>.json and drills.json (bench/goodput --drill-json).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              default=lambda: os.environ.get("OMNI_CLUSTER_DIR", str(DEFAULT_STATE_DIR)),
              help="Embedded cluster state dir (slurmd-crash).")
@click.option("--busy", "busy_s", type=click.IntRange(min=0), default=0, metavar="SECONDS",
              help="Before each drill fill every free node with another job running this long (a resubmission "
                   "then waits in the queue); they are cancelled after the drill. 0: no fillers.")
def drill(kind: str | None, job: str, factor: float, method: str, duration_s: float, site_file: Path | None,
          matrix: str, node: str, rank: int | None, stall_s: float, after_steps: int, timeout_s: float,
          timeline: Path | None, reference: Path | None, run_reference: bool, rtol: float, out_dir: Path,
          state_dir: Path, busy_s: int) -> None:
    """Inject KIND into a running job (node-down, kill-rank, stall-rank, ckpt-crash, slurmd-crash),
    measure detection and recovery, and return the node to service. ``slow-node`` makes the job's
    ranks on --node --factor times slower until --duration ends (or Ctrl-C / SIGTERM), then undoes it."""
    if kind == "slow-node" and not matrix:
        _slow_node(job, site_file, node, factor, method, duration_s)
        return
    from slurm_omni.cluster.busy import BusyCluster
    from slurm_omni.config.site import load_site, site_path
    from slurm_omni.drill.faults import fill_faults
    from slurm_omni.drill.inject import Injector, read_state_dir
    from slurm_omni.drill.job import JobHandle, find_registration
    from slurm_omni.drill.measure import goodput_document, render_table
    from slurm_omni.drill.run import DrillRunner, DrillSpec
    from slurm_omni.errors import OmniError
    from slurm_omni.manager.daemon import default_state_dir
    from slurm_omni.slurm.cli_backend import CliBackend

    kinds = _kinds(kind, matrix)
    path = site_path(site_file)
    site = load_site(path)
    allowed = site.drills.nodes
    cluster = read_state_dir(state_dir)
    backend = CliBackend(env=cluster.env if cluster else None, timeout_s=20, retries=3)
    injector = Injector(allowed=allowed, site=str(path), backend=backend, cluster=cluster)
    if node:
        injector.check(node)
    injector.check(*allowed)      # refuses an empty allowed set before anything runs
    record = find_registration(site, job)
    handle = JobHandle.from_registration(record, site)
    runner = DrillRunner(injector, backend, handle, timeline=timeline or default_state_dir(site) / "timeline.json",
                         on_event=lambda line: click.echo(f"  {line}"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i, name in enumerate(kinds, start=1):
        click.echo(f"drill {i}/{len(kinds)}: {name} on job {handle.name}")
        spec = DrillSpec(kind=name, node=node, rank=rank, stall_s=stall_s,  # type: ignore[arg-type]
                         after_steps=after_steps, timeout_s=timeout_s)
        filler = BusyCluster(backend, seconds=busy_s, tag=f"omni-drill-busy-{os.getpid()}")
        if busy_s:
            busy_nodes = filler.fill()
            click.echo(f"  busy: {len(busy_nodes)} filler job(s) of {busy_s} s on every free node")
        try:
            result = runner.run(spec)
        finally:
            filler.clear()
        results.append(result)
        _write(out_dir / f"drill-{i}-{name}.json", goodput_document([result], source=_source(name, job)))
        if result.error:
            break
    if run_reference and reference is None:
        from slurm_omni.drill.reference import run_reference as train_reference

        click.echo(f"training the reference run of {record['job_file']} in {out_dir / 'reference'}")
        reference = train_reference(Path(record["job_file"]), out_dir / "reference", timeout_s * 2)
    if reference is not None:
        from slurm_omni.drill.verify import verify_run

        click.echo(f"waiting for job {handle.name} to finish, then checking it against {reference}")
        equivalence = verify_run(runner, reference, rtol=rtol, timeout_s=timeout_s * 2)
        click.echo(f"  equivalence: {'ok' if equivalence.ok else 'FAILED'}: {equivalence.summary()}")
        results = [r.with_equivalence(equivalence.to_json()) for r in results]
    _write(out_dir / "drills.json", goodput_document(results, source=_source(",".join(kinds), job)))
    filled = fill_faults(runner.timeline, results, out_dir / "timeline.json") if runner.timeline else None
    click.echo(render_table(results))
    click.echo(f"wrote {out_dir / 'drills.json'} (python -m bench.goodput --drill-json {out_dir / 'drills.json'})"
               + (f" and {filled} (omni report --timeline)" if filled else ""))
    failed = [r for r in results if not r.ok]
    if failed or len(results) < len(kinds):
        raise OmniError(f"drill: {len(failed)} of {len(kinds)} drills failed"
                        + (f": {failed[0].kind}: {failed[0].error}" if failed and failed[0].error else ""))


def _slow_node(job: str, site_file: Path | None, node: str, factor: float, method: str, duration_s: float) -> None:
    from slurm_omni.config.site import check_hostlist, load_site, site_path
    from slurm_omni.drill.inject import check_allowed
    from slurm_omni.drill.job import JobHandle, find_registration
    from slurm_omni.drill.slow import slow_node
    from slurm_omni.errors import ConfigError

    if not node:
        raise ConfigError("drill: slow-node needs --node (the node, or a hostlist of nodes, whose ranks run slower)")
    path = site_path(site_file)
    site = load_site(path)
    nodes = list(check_hostlist("--node", node))
    check_allowed(nodes, site.drills.nodes, str(path))
    handle = JobHandle.from_registration(find_registration(site, job), site)
    slow_node(handle.heartbeat_dir, nodes, factor, method=method, duration_s=duration_s,  # type: ignore[arg-type]
              say=click.echo)


def _source(kinds: str, job: str) -> str:
    return f"omni drill {kinds} --job {job}"


def _write(path: Path, doc: dict[str, object]) -> None:
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n", mode=0o644)
