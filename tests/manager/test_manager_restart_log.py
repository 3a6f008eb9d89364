"""A restarted manager names what its journal left open (recoveries, actions not known done)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omni_configs import site_toml

from slurm_omni.config.site import load_site
from slurm_omni.manager.daemon import Manager, ManagerConfig
from slurm_omni.slurm.cli_backend import CliBackend


def _manager(tmp_path: Path) -> Manager:
    (tmp_path / "site.toml").write_text(site_toml(tmp_path))
    site = load_site(tmp_path / "site.toml")
    # No tick runs: the backend is never asked anything.
    return Manager(ManagerConfig(site=site, state_dir=tmp_path / "state"), CliBackend(env={}))


def test_a_restarted_manager_names_open_recoveries_and_pending_actions(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    m = _manager(tmp_path)
    m.journal.open_recovery("train-a", 0, "node_down", ("node3",), fault_at=1.0, detected_at=1.5, confirmed_at=2.0)
    m.journal.intend("resubmit/train-a/1", "train-a", 1, "resubmit", {}, now=2.5)
    m.close()

    again = _manager(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="slurm_omni.manager.daemon"):
            again._say_what_carries_on()
    finally:
        again.close()
    (line,) = [r.getMessage() for r in caplog.records if "carrying on" in r.getMessage()]
    assert "1 open recoveries (train-a/0)" in line and "1 actions not known done (resubmit train-a/1 intended)" in line


def test_a_clean_journal_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = _manager(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="slurm_omni.manager.daemon"):
            m._say_what_carries_on()
    finally:
        m.close()
    assert not [r for r in caplog.records if "carrying on" in r.getMessage()]
