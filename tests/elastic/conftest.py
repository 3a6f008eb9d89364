"""One reference run of examples/own-script for every test of it in this folder (the local
launcher's and the cluster's): the same script and job file, never failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from own_script_support import own_job

from slurm_omni.drill.reference import JOB_ENV, launch_job


@pytest.fixture(scope="session")
def own_job_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_job(tmp_path_factory.mktemp("own"))


@pytest.fixture(scope="session")
def own_reference(own_job_file: Path) -> Path:
    """The reference's metrics folder (dp 2, vision | text, sample ids traced)."""
    run_dir = own_job_file.parent / "reference"
    job = launch_job(own_job_file, data_parallel_size=2, run_dir=run_dir, incarnation=0,
                     extra_env={**JOB_ENV, "OMNI_STEP_DELAY_S": "0", "OMNI_HEARTBEAT_INTERVAL": "0.5"})
    codes = job.wait(600)
    assert codes == [0, 0, 0, 0], job.logs()[-3000:]
    return run_dir / "metrics"
