"""Issue 18, findings 2, 8 and 4, as alice and bob against the real cluster.

- 2: ``omni demo --user alice`` (run as root) ran as root in alice's home: a FIFO alice planted at
  ``~/omni-demo/sample/het-sample.sbatch`` fed root's ``sbatch`` her own script (it ran as root),
  and root's whole environment reached her submission (and its registry record).
- 8: the demo's cleanup cancelled every job of its job's name, bob's too.
- 4: bob's job name of bytes that are not UTF-8 made alice's manager fail every tick.

One demo run (module fixture) serves 2 and 8: the story up to its drill, on a job file whose
training command only sleeps (no step ever comes, so the drill gives up after ``--timeout`` and the
demo cleans up), about a minute. The demo runs as root here; everything else as alice or bob.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from multiuser.multiuser_support import User, lookup
from omni_configs import job_toml, site_toml
from support import wait_until

from slurm_omni.slurm.types import Job, JobState

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster, pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
ROOT_SECRET = "OMNI_TEST_ROOT_SECRET"
DEMO_NAME = "omni-demo"
FIFO_JOB = "mu-fifo-served"


@pytest.fixture(scope="module")
def users() -> dict[str, User]:
    if os.geteuid() != 0:
        pytest.skip("multiuser tests switch users: run them as root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    try:
        return {name: lookup(name) for name in ("alice", "bob")}
    except KeyError:
        pytest.skip("users alice and bob are missing: run scripts/setup.sh as root")


def _own_dir(user: User) -> Path:
    """A fresh 0700 folder of ``user``'s in their home."""
    path = user.home / "omni-tests" / uuid.uuid4().hex[:8]
    r = user.run("mkdir", "-p", "-m", "0700", str(path))
    assert r.returncode == 0, r.stderr
    return path


def _jobs(env: dict[str, str]) -> dict[int, Job]:
    from slurm_omni.slurm.cli_backend import CliBackend

    return {j.job_id: j for j in CliBackend(env=env, timeout_s=20, retries=3).jobs()}


def _cancel(env: dict[str, str], *ids: int) -> None:
    from slurm_omni.slurm.runner import CommandRunner

    if ids:
        CommandRunner(env).run(["scancel", *map(str, ids)], check=False)


@dataclass
class DemoRun:
    proc: subprocess.CompletedProcess[str]
    before: int                 # the highest job id before the demo
    jobs: dict[int, Job]        # every job Slurm knows right after it
    bobs: int                   # bob's held job named like the demo's
    work: Path


@pytest.fixture(scope="module")
def demo_run(slurm_cluster, users: dict[str, User]) -> Iterator[DemoRun]:
    alice, bob = users["alice"], users["bob"]
    env = {**os.environ, **slurm_cluster.env}
    # a --job-file demo works in ~/omni-demo-<job name> (the job file below keeps the demo's name)
    work = alice.home / f"omni-demo-{DEMO_NAME}"
    shutil.rmtree(work, ignore_errors=True)                 # an earlier demo's (the demo rebuilds it anyway)
    sample = work / "sample"
    assert alice.run("mkdir", "-p", str(sample), env=env).returncode == 0
    fifo = sample / "het-sample.sbatch"
    job_dir = _own_dir(alice)
    assert alice.run("mkfifo", str(fifo), env=env).returncode == 0
    # alice serves her own script to whoever reads the FIFO after writing to it (root's sbatch, before)
    served = (f"#!/bin/bash\n#SBATCH --job-name={FIFO_JOB}\n#SBATCH --output=/dev/null\n"
              "#SBATCH --partition=vision --nodes=1 --ntasks=1\n"
              f"id -u > {sample}/het-sample.out\n")
    helper = subprocess.Popen(["setpriv", f"--reuid={alice.uid}", f"--regid={alice.gid}", "--init-groups",
                               "sh", "-c", 'cat "$F" > /dev/null; printf "%s" "$S" > "$F"'],
                              env={"PATH": "/usr/bin:/bin", "F": str(fifo), "S": served},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    bobs = 0
    before = 1 << 62
    try:
        held = bob.run("sbatch", "--parsable", "--hold", f"--job-name={DEMO_NAME}", "--output=/dev/null",
                       "--wrap=sleep 300", env=env)
        assert held.returncode == 0, held.stderr
        bobs = int(held.stdout.strip().split(";")[0])
        text = (REPO / "examples" / "demo" / "job.toml").read_text()
        assert "[training]\n" in text
        # a job that runs and never trains: the drill waits for steps until --timeout, then the demo cleans up
        alice_job = job_dir / "job.toml"
        alice_job.write_text(text.replace("[training]\n", '[training]\ncommand = ["/bin/sleep", "600"]\n'))
        alice.own(job_dir)
        before = max([bobs, *_jobs(env)])
        root_env = {**os.environ, **slurm_cluster.env, ROOT_SECRET: "root-only-7f3a",
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run([str(BIN / "omni"), "demo", "--state-dir", str(slurm_cluster.state_dir),
                               "--user", "alice", "--timeout", "25", "--job-file", str(alice_job)],
                              env=root_env, capture_output=True, text=True, timeout=480, check=False)
        # the demo's cleanup cancelled its job: wait until Slurm is done with it (COMPLETING, then CANCELLED)
        wait_until(lambda: not any(j.state is JobState.COMPLETING for i, j in _jobs(env).items() if i > before),
                   60, "the demo's cancelled jobs to leave COMPLETING")
        yield DemoRun(proc, before, _jobs(env), bobs, work)
    finally:
        if helper.poll() is None:
            os.killpg(helper.pid, 9)
        helper.wait()
        _cancel(env, *([bobs] if bobs else []))
        try:
            _cancel(env, *[j.job_id for j in _jobs(env).values() if j.job_id > before and not j.state.finished])
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)


def test_demo_for_a_user_runs_as_that_user_with_a_clean_environment(demo_run: DemoRun,
                                                                    users: dict[str, User]) -> None:
    """Finding 2: every job the demo submitted is alice's (the FIFO she planted was replaced, not read
    by root's sbatch), her home holds nothing of anyone else's, and her job's environment (the
    registry record keeps what sbatch got) has nothing of root's."""
    alice = users["alice"]
    out = demo_run.proc.stdout + demo_run.proc.stderr
    new = {i: j for i, j in demo_run.jobs.items() if i > demo_run.before}
    assert new, out
    assert {j.user for j in new.values()} == {"alice"}, {i: (j.name, j.user) for i, j in new.items()}
    assert FIFO_JOB not in {j.name for j in new.values()}
    assert "2/11 placement: a het job ran 4 tasks across two leaf switches" in out and \
        "task=3 component=1" in out, out
    (sample,) = [j for j in new.values() if j.name == "omni-demo-het"]   # the sample, from alice's own file
    assert sample.state is JobState.COMPLETED
    foreign = []
    for root, dirs, names in os.walk(demo_run.work):
        for name in (*dirs, *names):
            s = os.lstat(os.path.join(root, name))
            if s.st_uid != alice.uid or s.st_gid != alice.gid:
                foreign.append((os.path.join(root, name), s.st_uid))
    assert os.lstat(demo_run.work).st_uid == alice.uid and not foreign, foreign
    (record,) = (demo_run.work / "registry").glob("*.json")
    environment = json.loads(record.read_text())["environment"]
    assert ROOT_SECRET not in environment and "root-only-7f3a" not in json.dumps(environment)
    assert environment["HOME"] == str(alice.home) and environment["USER"] == "alice"
    assert environment.get("LC_CTYPE", "C.UTF-8") == "C.UTF-8"   # Python's own (PEP 538) in a C locale
    allowed = {"PATH", "HOME", "USER", "LOGNAME", "SLURM_CONF", "OMP_NUM_THREADS", "LC_CTYPE"}
    assert {k for k in environment if k not in allowed and not k.startswith("OMNI_")} == set(), environment


def test_demo_cleanup_cancels_its_own_jobs_not_another_users_of_the_same_name(demo_run: DemoRun) -> None:
    """Finding 8: the demo gave up at its drill and cleaned up: its own job cancelled by id, bob's held
    job of the same name untouched."""
    out = demo_run.proc.stdout + demo_run.proc.stderr
    assert demo_run.proc.returncode != 0 and "(drill) failed" in out, out
    bobs = demo_run.jobs[demo_run.bobs]
    assert (bobs.user, bobs.name, bobs.state) == ("bob", DEMO_NAME, JobState.PENDING), out
    assert f"job {demo_run.bobs} cancelled" not in out
    (ours,) = [j for i, j in demo_run.jobs.items() if i > demo_run.before and j.name == DEMO_NAME]
    assert ours.user == "alice" and ours.state is JobState.CANCELLED, out
    assert f"cleanup: job {ours.job_id} cancelled" in out, out


def test_a_job_name_not_utf8_blinds_no_other_users_manager(slurm_cluster, users: dict[str, User]) -> None:
    """Finding 4: bob's ``--job-name=$'bob\\xff\\xfe'`` in the queue; alice's manager handles its tick and
    sees her job and his, his name with replacement characters, hers exactly."""
    alice, bob = users["alice"], users["bob"]
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    bad_name, bad_comment = os.fsdecode(b"bob\xff\xfe"), os.fsdecode(b"c\xc3(")   # bytes as argv carries them
    held = bob.run("sbatch", "--parsable", "--hold", f"--job-name={bad_name}", f"--comment={bad_comment}",
                   "--output=/dev/null", "--wrap=sleep 300", env=env)
    assert held.returncode == 0, held.stderr
    bobs = int(held.stdout.strip().split(";")[0])
    where = _own_dir(alice)
    name = "mu-bytes-ok"
    theirs: list[int] = [bobs]
    try:
        (where / "site.toml").write_text(site_toml(where, spool_dir=slurm_cluster.spool))
        (where / "job.toml").write_text(job_toml(name, time_limit="00:10:00",
                                                 job_keys=f'log_dir = "{where}/logs"\n'))
        alice.own(where)
        r = alice.run(str(BIN / "omni"), "submit", "--hold", str(where / "job.toml"), "--site",
                      str(where / "site.toml"), env=env)
        assert r.returncode == 0, r.stderr
        mine = int(r.stdout.split("submitted job ")[1].split()[0])
        theirs.append(mine)
        r = alice.run(str(BIN / "omni"), "-v", "manager", "run", "--once", "--site-config", str(where / "site.toml"),
                      "--state-dir", str(where / "manager"), env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "couldn't handle" not in r.stderr and "UnicodeDecodeError" not in r.stderr, r.stderr
        assert "couldn't poll Slurm" not in r.stderr, r.stderr
        probe = ("import json; from slurm_omni.slurm.cli_backend import CliBackend; "
                 "print(json.dumps({j.job_id: [j.name, j.user, j.comment] for j in CliBackend().jobs()}))")
        r = alice.run(sys.executable, "-c", probe, env=env)
        assert r.returncode == 0, r.stderr
        seen = json.loads(r.stdout)
        assert seen[str(mine)][:2] == [name, "alice"]
        # 22.05 prints the bytes as given (decoded with replacement here); a later Slurm may escape them
        assert seen[str(bobs)][1] == "bob" and seen[str(bobs)][0].startswith("bob"), seen[str(bobs)]
        assert seen[str(bobs)][0] != "bob"
        if slurm_cluster.cluster.spec.slurm_version == "22.05":
            assert seen[str(bobs)] == ["bob\ufffd\ufffd", "bob", "c\ufffd("]
    finally:
        _cancel(slurm_cluster.env, *theirs)
        shutil.rmtree(where, ignore_errors=True)
