"""The shipped site config gives the manager what it expects: nearest-first spares (the failed
node's leaf switch, then the lowest common switch), and shows every elasticity knob it reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slurm_omni.config.site import ElasticitySite, load_site

SITE = Path(__file__).resolve().parents[2] / "site-config" / "omni.toml"


def test_shipped_site_config_passes_the_check_and_spares_nearest_first() -> None:
    omni = Path(sys.executable).with_name("omni")
    r = subprocess.run([str(omni), "config", "check", str(SITE)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    elasticity = load_site(SITE).elasticity
    assert elasticity.spare_policy == ElasticitySite().spare_policy == "any_switch"
    text = SITE.read_text()
    for key in ("spare_policy", "spare_wait_s", "quarantine_s", "drain_failed"):
        (line,) = [x for x in text.splitlines() if x.startswith(f"{key} = ")]
        assert "#" in line, f"{key} has no comment in {SITE}"
