"""Shared inputs of the template tests: the site and job files under data/, stub Slurm commands."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest
from render_support import DATA, STUB_SCONTROL, STUB_SRUN

from slurm_omni.config.job import JobFile, load_job
from slurm_omni.config.site import SiteConfig, load_site


@pytest.fixture(scope="session")
def site() -> SiteConfig:
    return load_site(DATA / "site.toml")


@pytest.fixture(scope="session")
def job() -> JobFile:
    return load_job(DATA / "job.toml")


@pytest.fixture(scope="session")
def job_sha256() -> str:
    return hashlib.sha256((DATA / "job.toml").read_bytes()).hexdigest()


@pytest.fixture()
def stub_env(tmp_path: Path) -> dict[str, str]:
    """PATH with stub srun/scontrol and the variables Slurm gives a batch script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "stub-out"
    out.mkdir()
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_OUT": str(out), "STUB_MODE": "exit:0",
            "SLURM_JOB_ID": "123", "SLURM_JOB_NODELIST_HET_GROUP_0": "node[1-2]",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_ARRAY_TASK_ID": "0", "HOME": str(tmp_path)}
