"""``omni standby serve``: the warm standby of one node (started by the step supervisor)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal

import click

if TYPE_CHECKING:
    from slurm_omni.checkpoint.held import HeldServer

from slurm_omni.errors import ConfigError


@click.group()
def standby() -> None:
    """Warm standbys of an in-allocation job."""


@standby.command()
def serve() -> None:
    """Import the trainer once and fork it for every task of a relaunched step on this node."""
    from slurm_omni.ownership import NotOwnedError
    from slurm_omni.standby.server import open_standby_dir, socket_path
    from slurm_omni.standby.server import serve as run_server

    job, node = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURMD_NODENAME", "")
    if not job or not node:
        raise ConfigError("standby: couldn't start: SLURM_JOB_ID or SLURMD_NODENAME not set (run it with srun)")
    try:
        with open_standby_dir(job) as folder:
            path = socket_path(folder.path, job, node)
    except NotOwnedError as e:   # the clients refuse that folder too: the ranks on this node start cold
        raise NotOwnedError(f"{e}; no warm standby on {node}: its ranks start cold") from None

    cap = _memory_tier()
    keeper = _start_keeper(job, node, cap) if cap is not False else None
    copies = _hold_copies(job, node, cap) if cap is not False else None

    def stop() -> None:
        # the job's end (the supervisor stops its standbys with SIGUSR2, Slurm a step with SIGTERM):
        # stop the replica keeper and the node's copies, then free the job's memory tier on this node
        # (checkpoint/memtier.py)
        from slurm_omni.checkpoint.memtier import base_from_env, free_job

        if keeper is not None:
            _end_keeper(keeper)
        if copies is not None:
            copies.stop()
            copies.store.close()
        free_job(job, base=base_from_env())

    run_server(path, on_stop=stop)


def _memory_tier() -> int | None | Literal[False]:
    """Whether the job keeps a memory tier (False where not) and its cap per node in bytes (None: none)."""
    if os.environ.get("OMNI_MEMORY_TIER") != "1" or not os.environ.get("OMNI_CKPT_DIR"):
        return False
    from slurm_omni.checkpoint import memtier

    settings = memtier.from_env({**os.environ, memtier.KEEPER_ENV: "standby"})   # this process frees it
    if not settings:
        return False
    cap = settings.get("memory_cap_bytes")
    return cap if isinstance(cap, int) else None


def _start_keeper(job: str, node: str, cap: int | None) -> int:
    """This node's replica keeper (``checkpoint/peer.py``: it keeps its ring predecessor's replicas and
    serves this node's copies to a peer), a child forked before the server imports anything heavy or
    starts a thread; its pid."""
    import logging
    from pathlib import Path

    from slurm_omni.checkpoint import memtier, peer

    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        peer.run_keeper(job, Path(os.environ["OMNI_CKPT_DIR"]), node, base=memtier.base_from_env(),
                        cap_bytes=cap, parent=parent, own_copies=False)
    except Exception as e:   # noqa: BLE001 - the keeper is a speed-up: one line, the ranks use the file system
        logging.getLogger(__name__).warning("standby: no replica keeper on %s: %s", node, e)
        code = 1
    finally:
        os._exit(code)


def _hold_copies(job: str, node: str, cap: int | None) -> HeldServer | None:
    """The node's own copies, held in this process's memory (``checkpoint/held.py``): every trainer the
    server forks inherits them and restores from its own memory (``held.hold_here``). Their memory ends
    with the server."""
    from pathlib import Path

    from slurm_omni.checkpoint import memtier, peer

    return peer.hold_copies(job, Path(os.environ["OMNI_CKPT_DIR"]), node, base=memtier.base_from_env(),
                            cap_bytes=cap)


def _end_keeper(pid: int) -> None:
    import signal
    import time

    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
