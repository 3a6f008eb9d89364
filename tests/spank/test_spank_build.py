"""The plugin builds with -Werror and hardening, and exports only what Slurm looks up."""

from __future__ import annotations

import subprocess
from pathlib import Path

from spank_support import SPANK


def _readelf(*args: str) -> str:
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def test_exports_only_slurm_spank_hooks_and_plugin_stamp(plugin: Path) -> None:
    out = subprocess.run(["nm", "-D", "--defined-only", str(plugin)], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    symbols = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {s for s in symbols if not s.startswith("slurm_spank_")} == {
        "plugin_name", "plugin_type", "plugin_version", "spank_plugin_version"}
    assert {"slurm_spank_init", "slurm_spank_task_init", "slurm_spank_task_exit", "slurm_spank_job_epilog"} <= symbols


def test_hardened_binary(plugin: Path) -> None:
    dynamic = _readelf("-d", str(plugin))
    assert "BIND_NOW" in dynamic or "Flags: NOW" in dynamic
    assert "GNU_RELRO" in _readelf("-lW", str(plugin))
    symbols = _readelf("-sW", str(plugin))
    assert "__stack_chk_fail" in symbols
    assert "_chk@" in symbols.replace("__stack_chk_fail", "")   # a FORTIFY_SOURCE wrapper is linked


def test_build_flags() -> None:
    out = subprocess.run(["make", "-n", "-B", "-C", str(SPANK)], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    for flag in ("-Wall", "-Wextra", "-Werror", "-fstack-protector-strong", "-D_FORTIFY_SOURCE=2", "-O2",
                 "-fPIC", "-Wl,-z,relro,-z,now", "--version-script=omni_spank.map"):
        assert flag in out, flag
