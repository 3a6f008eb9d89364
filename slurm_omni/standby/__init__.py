"""Warm standbys: a per-node server that has imported the trainer and forks it on demand
(``server.py``), and the tiny client an srun task runs instead (``client.py``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

CLIENT = Path(__file__).with_name("client.py")


def through_standby(command: Sequence[str]) -> tuple[str, ...]:
    """``command`` with its ``omni train ...`` run through the node's standby (the rest, e.g. a
    drill wrapper that execs it, unchanged); unchanged when it runs no ``omni train``."""
    cmd = tuple(command)
    for i in range(len(cmd) - 1):
        if cmd[i] == "omni" and cmd[i + 1] == "train":
            return (*cmd[:i], sys.executable, "-S", str(CLIENT), "node", "--", *cmd[i + 1:])
        # batch scripts run omni by absolute path: PYTHON -m slurm_omni.cli.main train ...
        if cmd[i + 1:i + 4] == ("-m", "slurm_omni.cli.main", "train"):
            return (*cmd[:i], sys.executable, "-S", str(CLIENT), "node", "--", *cmd[i + 3:])
    return cmd
