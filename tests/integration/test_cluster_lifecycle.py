"""A second, small cluster on other ports: up, no-op up, down, and nothing of ours left running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def omni(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurm_omni.cli.main", *args], capture_output=True,
                          check=False, text=True, timeout=180, env={**os.environ, **(env or {})})


def our_processes(state_dir: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        if str(state_dir) in cmd:
            found.append(f"{proc.name}: {cmd}")
    return found


def mount_points() -> set[str]:
    return {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}


def free_ports(count: int, start: int = 20000, stop: int = 60000) -> int:
    """The first port of ``count`` consecutive ports that nothing listens on (other clusters of the
    same machine, e.g. other checkouts' test runs, hold fixed ones)."""
    port = start
    while port + count < stop:
        for offset in range(count):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port + offset))
                except OSError:
                    port += offset + 1
                    break
        else:
            return port
    raise RuntimeError(f"no {count} free consecutive ports in {start}..{stop}")


def test_up_down_leaves_nothing(tmp_path: Path, slurm_cluster) -> None:
    state = tmp_path / "c2"
    shape = ["--state-dir", str(state), "--nodes", "2", "--nodes-per-switch", "1", "--gpus-per-node", "2",
             "--ctld-port", str(ctld := free_ports(1, 20000 + os.getpid() % 20000)),
             "--slurmd-base-port", str(free_ports(2, ctld + 1))]
    version = slurm_cluster.cluster.spec.slurm_version     # the version lane's, 22.05 by default
    mounts: list[str] = []
    up = omni("cluster", "up", *shape, "--slurm", version)
    try:
        assert up.returncode == 0, up.stderr
        again = omni("cluster", "up", "--state-dir", str(state))
        assert again.returncode == 0 and "already up" in again.stdout
        doc = json.loads(omni("cluster", "status", "--json", "--state-dir", str(state)).stdout)
        assert [n["gres"] for n in doc["nodes"]] == [["gpu:h100:2"]] * 2
        assert {s["name"] for s in doc["switches"]} == {"leaf1", "leaf2", "root"}
        assert len(our_processes(state)) == 4   # munged, slurmctld, 2 slurmd
        assert doc["slurm_version"] == version and doc["slurm_release"].startswith(version + ".")
        mounts = json.loads((state / "mounts.json").read_text())["mounts"] if version != "22.05" else []
        assert all(m in mount_points() for m in mounts)
    finally:
        down = omni("cluster", "down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert our_processes(state) == []
    assert not set(mounts) & mount_points() and not (state / "mounts.json").exists()   # only ours, all gone
    # The main cluster was not touched.
    assert all(slurm_cluster.cluster.running().values())


def test_bad_shape_is_one_line(tmp_path: Path) -> None:
    r = omni("cluster", "up", "--state-dir", str(tmp_path / "c3"), "--nodes", "0")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "nodes = 0" in r.stderr and "allowed" in r.stderr


def test_bad_config_file_names_key(tmp_path: Path) -> None:
    cfg = tmp_path / "site.toml"
    cfg.write_text("[cluster]\nnodes = 4\nswitch_count = 2\n")
    r = omni("cluster", "up", "--state-dir", str(tmp_path / "c4"), "--config", str(cfg))
    assert r.returncode == 2 and "cluster.switch_count" in r.stderr and str(cfg) in r.stderr
