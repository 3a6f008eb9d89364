"""``omni supervise``'s options reach the supervisor (the supervisor itself needs Slurm: its cluster tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from slurm_omni.cli.supervise import supervise


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *options: str) -> tuple[Any, Any]:
    from slurm_omni.supervisor import run

    seen: dict[str, Any] = {}

    class Fake:
        def __init__(self, opts: Any, runner: Any) -> None:
            seen["opts"] = opts

        def run(self) -> int:
            return 0

    monkeypatch.setattr(run, "Supervisor", Fake)
    env = {"OMNI_CKPT_DIR": str(tmp_path), "OMNI_HEARTBEAT_DIR": str(tmp_path / "hb"), "OMNI_DP_SIZE": "4",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]"}
    result = CliRunner().invoke(supervise, ["--stages=main:2:2:1", *options, "--", "train"], env=env)
    return result, seen.get("opts")


def test_the_kill_grace_is_the_sites_choice_and_off_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result, opts = _run(tmp_path, monkeypatch)
    assert result.exit_code == 0 and opts.kill_grace_s == 0.0   # the next launch starts beside the dying tasks
    result, opts = _run(tmp_path, monkeypatch, "--kill-grace=60")
    assert result.exit_code == 0 and opts.kill_grace_s == 60.0
    result, _ = _run(tmp_path, monkeypatch, "--kill-grace=-1")
    assert result.exit_code == 2 and "--kill-grace" in result.output
