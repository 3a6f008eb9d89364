"""Warm standbys: a per-node server that has imported the trainer and forks it on demand
(``server.py``), and the tiny client an srun task runs instead (``client.py``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

CLIENT = Path(__file__).with_name("client.py")


def through_standby(command: Sequence[str]) -> tuple[str, ...]:
    """``command`` with its ``omni train ...`` (or ``PYTHON -m slurm_omni.cli.main train ...``) run
    through the node's standby; the rest (a drill wrapper that execs it) unchanged. A command that
    runs no built-in trainer (``[training] command``) is returned as it is."""
    cmd = tuple(command)
    for i, word in enumerate(cmd):
        if word != "train" or i == 0:
            continue
        if cmd[i - 1] == "omni" or cmd[i - 1].endswith("/omni"):
            start = i - 1
        elif i >= 3 and cmd[i - 2:i] == ("-m", "slurm_omni.cli.main"):
            start = i - 3
        else:
            continue
        # the supervisor's own interpreter: the batch script started it with the job's python
        return (*cmd[:start], sys.executable, "-S", str(CLIENT), "node", "--", *cmd[i:])
    return cmd
