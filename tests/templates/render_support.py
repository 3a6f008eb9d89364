"""Inputs of the template tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("data")
GOLDEN = Path(__file__).with_name("golden")
# Where the golden scripts say the job file lives: fixed, so goldens do not depend on the checkout.
JOB_FILE = Path("/shared/jobs/omni-tiny/job.toml")

