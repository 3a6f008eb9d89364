"""Which step commands go through a node's warm standby: ``omni train`` by name or by absolute path."""

from __future__ import annotations

import sys

from slurm_omni.standby import CLIENT, through_standby


def test_absolute_omni_train_goes_through_the_standby() -> None:
    client = (sys.executable, "-S", str(CLIENT), "node", "--")
    assert through_standby(["/v/bin/python", "-m", "slurm_omni.cli.main", "train", "--config", "j"]) == (
        *client, "train", "--config", "j")
    assert through_standby(["omni", "train", "--config", "j"]) == (*client, "train", "--config", "j")
    own = ("/v/bin/python", "/jobs/train.py", "--steps", "3")
    assert through_standby(own) == own
