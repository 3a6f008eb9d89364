"""``omni data``: data tools (``synth`` writes synthetic shards)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def data() -> None:
    """Training data: shards in the format of docs/data-format.md."""


@data.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder to write the *.h5 shards into.")
@click.option("--pairs", default=256, show_default=True, help="Image-text pairs (source 'pairs').")
@click.option("--text", default=128, show_default=True, help="Text-only samples (source 'text').")
@click.option("--shard-size", default=64, show_default=True, help="Samples per shard file.")
@click.option("--image-size", default=16, show_default=True, help="Image side in pixels.")
@click.option("--seq-len", default=16, show_default=True, help="Tokens per sample (padded).")
@click.option("--vocab-size", default=256, show_default=True, help="Token ids are 1 .. vocab-1 (0 pads).")
@click.option("--seed", default=0, show_default=True)
def synth(out_dir: Path, pairs: int, text: int, shard_size: int, image_size: int, seq_len: int,
          vocab_size: int, seed: int) -> None:
    """Write synthetic image-text pairs and text-only samples as HDF5 shards."""
    from slurm_omni.runtime.synth import SynthSpec, write_shards

    paths = write_shards(SynthSpec(out_dir=out_dir, pairs=pairs, text=text, shard_size=max(1, shard_size),
                                   image_size=image_size, seq_len=seq_len, vocab_size=vocab_size, seed=seed))
    click.echo(f"wrote {len(paths)} shards ({pairs} pairs, {text} text) to {out_dir}")
