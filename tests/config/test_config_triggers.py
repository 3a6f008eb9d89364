"""site-config/install-triggers.sh against the embedded cluster: installs, is idempotent, writes
node events into the spool, and removes only its own triggers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_omni.manager.events import scan_spool

pytestmark = pytest.mark.cluster

SCRIPT = Path(__file__).resolve().parents[2] / "site-config" / "install-triggers.sh"


def _install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def _ours(env: dict[str, str], bin_dir: Path) -> list[str]:
    out = subprocess.run(["strigger", "--get", "--noheader"], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if str(bin_dir) in line)


def test_install_fire_and_remove(slurm_cluster, tmp_path: Path) -> None:

    env = {**os.environ, **slurm_cluster.env}
    spool, bin_dir = tmp_path / "spool", tmp_path / "bin"
    try:
        for _ in range(2):                                         # the second run replaces, not adds
            r = _install(env, "--spool", str(spool), "--bin-dir", str(bin_dir))
            assert r.returncode == 0, r.stderr
        assert _ours(env, bin_dir) == [str(bin_dir / f"omni-node-{e}") for e in ("down", "drained", "fail", "up")]
        subprocess.run([str(bin_dir / "omni-node-down"), 'node[3-4]"}, {"x'], check=True, timeout=30)
        nodes = spool / "nodes"                                    # every user's manager reads <spool>/nodes
        (record,) = [json.loads(p.read_text()) for p in nodes.glob("node-down-*.json")]
        assert record["kind"] == "down" and isinstance(record["time"], float)
        assert record["nodes"] == "node[3-4]__,___x"                # quotes and spaces cannot break the JSON
        assert not list(nodes.glob(".*")) and oct(nodes.stat().st_mode & 0o777) == oct(0o755)
        # The manager's validator takes what the trigger program wrote.
        subprocess.run([str(bin_dir / "omni-node-down"), "node[5-6]"], check=True, timeout=30)
        events = [e for _, e in scan_spool(nodes, shared=True) if getattr(e, "node_names", None) == ("node5", "node6")]
        assert len(events) == 1 and events[0].kind == "down"
    finally:
        r = _install(env, "--remove", "--bin-dir", str(bin_dir))
    assert r.returncode == 0, r.stderr
    assert _ours(env, bin_dir) == []


def test_refuses_relative_paths(slurm_cluster) -> None:
    r = _install({"PATH": "/usr/bin:/bin"}, "--spool", "spool")
    assert r.returncode == 2 and "must be absolute" in r.stderr
