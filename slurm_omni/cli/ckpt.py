"""``omni ckpt ls | inspect | verify``: what a checkpoint root holds, and whether a checkpoint is sound.

None of these import torch: they read the manifest, the HDF5 structure and the bytes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.verify import resolve, total_bytes, verify
from slurm_omni.errors import CheckpointError

json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
path_argument = click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))


@click.group()
def ckpt() -> None:
    """Checkpoints: list a root, inspect one, verify its checksums."""


@ckpt.command("ls")
@path_argument
@json_option
def ls(path: Path, as_json: bool) -> None:
    """Every step directory under the checkpoint root PATH, oldest first, with its status."""
    rows = [_row(e) for e in fmt.scan(path)]
    if as_json:
        click.echo(json.dumps({"root": str(path), "latest_complete": fmt.latest_step(path), "checkpoints": rows},
                              indent=2))
        return
    if not rows:
        click.echo(f"no checkpoints under {path}")
        return
    click.echo(f"{'STEP':>10}  {'STATUS':<10}  {'SIZE':>10}  {'SHARDS':>6}  {'AGE':>8}  NOTE")
    for r in rows:
        click.echo(f"{r['step']:>10}  {r['status']:<10}  {_size(r['bytes']):>10}  "
                   f"{r['shards'] if r['shards'] is not None else '-':>6}  {_age(r['mtime']):>8}  {r['note']}")


def _row(e: fmt.Entry) -> dict[str, Any]:
    files = [p for p in e.path.iterdir() if p.is_file()] if e.path.is_dir() else []
    shards = None
    if e.status is fmt.Status.COMPLETE:
        try:
            shards = len(fmt.read_manifest(e.path).shards)
        except CheckpointError as err:
            return {**_row(fmt.Entry(e.step, e.path, fmt.Status.CORRUPT, str(err))), "shards": None}
    return {"step": e.step, "status": e.status.value, "path": str(e.path),
            "bytes": sum(p.stat().st_size for p in files), "shards": shards,
            "mtime": max((p.stat().st_mtime for p in files), default=e.path.stat().st_mtime),
            "note": e.reason.splitlines()[0][:120] if e.reason else
            "shard files only in the memory tier" if e.status is fmt.Status.COMPLETE and fmt.memory_only(e.path) else ""}


@ckpt.command()
@path_argument
@json_option
def inspect(path: Path, as_json: bool) -> None:
    """The manifest of one checkpoint (PATH is a step directory, or a root for its newest complete one)."""
    step_path = resolve(path)
    manifest = fmt.read_manifest(step_path)
    if as_json:
        data = manifest.to_json()
        for u in data["units"].values():
            u.pop("skeleton")
        click.echo(json.dumps({"path": str(step_path), **data}, indent=2))
        return
    click.echo(f"checkpoint {step_path}")
    click.echo(f"  step {manifest.step}, world size {manifest.world_size}, incarnation {manifest.incarnation}, "
               f"written by slurm-omni {manifest.writer_version} "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created))}")
    click.echo(f"  load order: {', '.join(manifest.load_order)}")
    click.echo(f"  {_size(total_bytes(manifest))} of tensors in {sum(len(u.tensors) for u in manifest.units.values())}"
               f" tensors")
    click.echo("  layout:")
    for s in sorted(manifest.shards.values(), key=lambda s: s.rank):
        click.echo(f"    rank {s.rank:>4}  stage {s.stage:<10} dp {s.data_parallel_rank}/{s.data_parallel_size}  "
                   f"{s.file or '(no tensors)'} {_size(s.file_bytes) if s.file else ''}")
    click.echo("  units:")
    for u in manifest.units.values():
        split = sum(1 for t in u.tensors.values() if t.split_dim is not None)
        click.echo(f"    {u.name:<32} stage {u.stage:<10} {len(u.tensors):>5} tensors {_size(u.nbytes):>10}"
                   + (f"  ({split} split across data-parallel ranks)" if split else ""))


@ckpt.command("verify")
@path_argument
@json_option
@click.option("--progress/--no-progress", default=None, help="Progress bar [on when stderr is a terminal].")
def verify_cmd(path: Path, as_json: bool, progress: bool | None) -> None:
    """Check completeness, the manifest, the HDF5 structure and every dataset's checksum."""
    step_path = resolve(path)
    show = sys.stderr.isatty() if progress is None else progress
    total = 0
    try:
        total = total_bytes(fmt.read_manifest(step_path))
    except CheckpointError:
        pass  # verify() reports it
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=step_path.name, disable=not show, file=sys.stderr) as bar:
        report = verify(step_path, progress=bar.update)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        for p in report.problems:
            click.echo(f"  {p}")
        if report.ok:
            memory = (f"; {len(report.in_memory)} shard(s) only in the memory tier, not checked here"
                      if report.in_memory else "")
            click.echo(f"{step_path}: ok ({report.datasets} datasets, {_size(report.bytes)} in {report.seconds:.1f} s"
                       f"{memory})")
    if not report.ok:
        raise CheckpointError(f"checkpoint: {step_path} failed verification: {len(report.problems)} problem(s)")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _age(mtime: float) -> str:
    s = max(0, int(time.time() - mtime))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"
