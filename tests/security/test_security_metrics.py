"""Issue 18, finding 3: bob plants alice's metrics folder. ``manager.metrics_dir`` with ``{user}`` sits
in a 1777 folder (docs/deployment.md allows it), so bob can make ``<metrics>/alice/<job>/`` first and
put in it a ``metrics-<stage>-0.jsonl`` that is a symlink to alice's ``job.toml``. Before the fix her
rank appended a JSON line through it (her manager then refused to resubmit the changed job file)
and bob could forge her metrics and ``.prom`` files. Now the rank opens the folder by descriptor,
finds it is not hers, says so in one line and exits 78: nothing of hers is written through bob's
folder. Run as the two real users on the real file system, with alice's real rank (``omni train``
as one process: the metrics code path is the same under Slurm)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from manager.manager_cluster_support import job_file_text, make_shards
from multiuser_support import User
from security_support import omni, open_to_all

pytestmark = [pytest.mark.multiuser, pytest.mark.timeout(300)]

NAME = "sec-metrics"


def test_a_metrics_file_bob_planted_is_not_written_through(alice: User, bob: User, alice_dir: Path,
                                                           shared: Path) -> None:
    shards = open_to_all(make_shards(shared))
    job = alice_dir / "job.toml"
    job.write_text(job_file_text(NAME, alice_dir, shards, max_steps=1))
    alice.own(alice_dir)
    before = job.read_bytes()
    metrics = shared / "metrics"                                    # the site's textfile folder, 1777
    metrics.mkdir()
    metrics.chmod(0o1777)
    # metrics_dir = "<metrics>/{user}": bob made alice's folder and her job's in it (a job folder of
    # his directly in a sticky root is the same refusal one level down: test_ownership_check.py)
    theirs, blamed = metrics / "alice" / NAME, metrics / "alice"
    r = bob.run("sh", "-c", f"umask 0 && mkdir -p {theirs}")
    assert r.returncode == 0, r.stderr
    for stage in ("vision+text", "vision", "text"):
        r = bob.run("ln", "-s", str(job), str(theirs / f"metrics-{stage}-0.jsonl"))
        assert r.returncode == 0, r.stderr

    done = omni(alice, "train", "--config", str(job), timeout=240, cwd=alice_dir,
                env={"OMNI_RUN_DIR": str(alice_dir / "run"), "OMNI_METRICS_DIR": str(theirs),
                     "OMNI_STEP_DELAY_S": "0", "OMP_NUM_THREADS": "1"})

    assert job.read_bytes() == before, "alice's rank wrote her job file through bob's symlink"
    assert done.returncode == 78, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if "metrics" in line and "couldn't use" in line]
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"couldn't use {blamed}: a directory of uid " in lines[0], lines[0]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not any(p.is_file() and not p.is_symlink() for p in theirs.iterdir())   # nothing of hers in bob's folder
    assert os.listdir(theirs) and all(p.is_symlink() for p in theirs.iterdir())
