"""Site configs and job files as tests write them to disk: the embedded cluster's two stages
(partitions ``vision`` and ``text``, ``gpu:h100:4`` per node), one component per stage."""

from __future__ import annotations

import json
from pathlib import Path


def _toml_str(value: str | Path) -> str:
    # A JSON string is a TOML basic string (same escapes).
    return json.dumps(str(value))


def site_toml(under: Path | None = None, *, tables: str = "", ckpt_root: str | Path | None = None,
              spool_dir: str | Path | None = None, registry_dir: str | Path | None = None,
              metrics_dir: str | Path | None = None) -> str:
    """A site config whose folders are ``under``/ckpt, spool, registry and metrics unless given;
    ``tables``: more TOML tables (``[drills]``, ``[elasticity]``, ...), put before ``[manager]``."""
    def folder(given: str | Path | None, name: str) -> str:
        if given is None and under is None:
            raise ValueError(f"site_toml: give {name} or under")
        return _toml_str(given if given is not None else Path(under or "") / name)

    return (
        '\ncluster = "omni"\n'
        '[stages.vision]\npartition = "vision"\ngres = "gpu:h100:4"\n'
        '[stages.text]\npartition = "text"\ngres = "gpu:h100:4"\n'
        f"[checkpoint]\nroot = {folder(ckpt_root, 'ckpt')}\n"
        f"{tables}"
        f"[manager]\nspool_dir = {folder(spool_dir, 'spool')}\nregistry_dir = {folder(registry_dir, 'registry')}\n"
        f"metrics_dir = {folder(metrics_dir, 'metrics')}\n"
    )


def job_toml(name: str, *, data_parallel_size: int = 1, nodes: int = 1, time_limit: str = "00:05:00",
             job_keys: str = "", training: str = '[training.data]\nshard_dir = "shards"\n') -> str:
    """A job file of stages vision and text on ``nodes`` nodes each; ``job_keys``: more ``[job]``
    lines; ``training``: the ``[training...]`` tables."""
    return (
        f"\n[job]\nname = {_toml_str(name)}\ndata_parallel_size = {data_parallel_size}\n"
        f"time_limit = {_toml_str(time_limit)}\n{job_keys}"
        f'[[stages]]\nname = "vision"\nnodes = {nodes}\n[[stages]]\nname = "text"\nnodes = {nodes}\n'
        f"{training}"
    )
