"""Shared inputs of the template tests: the site and job files under data/, the SPANK plugin."""

from __future__ import annotations

import hashlib
import subprocess

import pytest
from render_support import DATA, REPO

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


@pytest.fixture(scope="session")
def plugin_built() -> None:
    """The SPANK plugin the cluster's plugstack.conf names: without it srun refuses --omni-stage."""
    subprocess.run(["make", "-s", "-C", str(REPO / "spank")], check=True, capture_output=True, timeout=120)
