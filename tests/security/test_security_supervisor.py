"""bob against alice's step supervisor (issue 18, findings 5 and 6 and the srun line), on the
embedded cluster: alice's in-allocation job runs as alice, bob acts as bob. A fake ``srun`` of bob's
named like alice's launch is not adopted; rendezvous ports bob holds are not used; a line a rank prints
that reads like srun's own (``srun: error: Node failure on ...``) is no report of srun's. In each, the
job's step runs and ends with one launch.

The ranks are a small Python program (no torch): what is under test is the supervisor and Slurm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from multiuser.multiuser_support import User
from support import wait_until

from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.policy.supervision import rendezvous_ports
from slurm_omni.render import HetJobRequest
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor import ports
from slurm_omni.supervisor.journal import SupervisorJournal, journal_path, read_status, status_path

pytestmark = [pytest.mark.multiuser, pytest.mark.cluster]

DATA = Path(__file__).resolve().parents[1] / "templates" / "data"
PYTHON = sys.executable

# A rank: rank 0 listens on MASTER_PORT as torch's store would (exit 1 when it cannot); every rank
# prints the sample file it is given (the job's data: bob may have written it), records its launch,
# port and the time, then waits for the test's "done".
RANK = """\
import os, socket, sys, time
work, sample = sys.argv[1], sys.argv[2]
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
if rank == 0:
    store = socket.socket()
    store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        store.bind(("0.0.0.0", port))
        store.listen()
    except OSError as e:
        print(f"rank 0: couldn't listen on {port}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
if sample:
    with open(sample) as f:
        text = f.read()
    print(text, flush=True)
    print(text, file=sys.stderr, flush=True)
with open(os.path.join(work, "ranks"), "a") as f:
    f.write(f"{os.environ['OMNI_LAUNCH']} {rank} {port} {time.time()}\\n")
while not os.path.exists(os.path.join(work, "done")):
    time.sleep(0.2)
"""


@dataclass
class AliceJob:
    job_id: int
    work: Path
    ckpt: Path
    logs: Path
    runner: CommandRunner

    def launches(self) -> dict[int, list[tuple[int, int, float]]]:
        path = self.work / "ranks"
        out: dict[int, list[tuple[int, int, float]]] = {}
        for line in path.read_text().splitlines() if path.exists() else ():
            launch, rank, port, at = line.split()
            out.setdefault(int(launch), []).append((int(rank), int(port), float(at)))
        return out

    def release(self) -> None:
        self.runner.run(["scontrol", "release", str(self.job_id)])

    def finish(self) -> None:
        (self.work / "done").touch()
        wait_until(lambda: not self.runner.run(["squeue", "-h", "-j", str(self.job_id)], check=False).stdout.strip(),
                   90, "alice's job to finish")

    def journal(self) -> SupervisorJournal:
        return SupervisorJournal(journal_path(self.ckpt, str(self.job_id)))

    def batch_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs.glob("*.out"))

    def first_launch(self, what: str) -> list[tuple[int, int, float]]:
        """Launch 0's two ranks, once both run (a timeout shows the batch script's log)."""
        try:
            return wait_until(lambda: len(self.launches().get(0, [])) == 2 and self.launches()[0], 90, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- the job's log:\n{self.batch_log()[-3000:]}") from None


@pytest.fixture
def site_area() -> Iterator[Path]:
    """Shared by every user: ``ckpt/`` (1777, as /tmp) and ``data/`` (1777: bob contributes samples)."""
    base = Path("/tmp") / f"omni-security-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o755)
    for name in ("ckpt", "data"):
        (base / name).mkdir()
        (base / name).chmod(0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _submit_held(slurm_cluster, alice: User, folder: Path, area: Path, sample: Path | None = None) -> AliceJob:
    """alice's in-allocation job (one node per stage, no spare, no warm standbys), submitted held."""
    site = load_site(DATA / "site.toml")
    site = replace(site, stages={n: replace(s, partition="debug") for n, s in site.stages.items()},
                   use_spank_plugin=False, checkpoint=replace(site.checkpoint, root=area / "ckpt"),
                   elasticity=replace(site.elasticity, recovery="in_allocation", default_spares=0),
                   manager=replace(site.manager, spool_dir=folder / "spool", registry_dir=folder / "registry"))
    job = load_job(DATA / "job.toml")
    logs, work = folder / "logs", folder / "work"
    logs.mkdir()
    work.mkdir()
    (folder / "rank.py").write_text(RANK)
    job = replace(job, job=replace(job.job, log_dir=logs, data_parallel_size=1),
                  stages=[replace(s, nodes=1, tasks_per_node=1) for s in job.stages])
    request = HetJobRequest(job=job, site=site, job_file=folder / "job.toml", job_sha256="0" * 64,
                            command=(PYTHON, str(folder / "rank.py"), str(work), str(sample or "")), user=alice.name)
    (folder / "job.sbatch").write_text(request.materialize())
    alice.own(folder)
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(PYTHON).parent}:{os.environ['PATH']}",
           "OMNI_STANDBY": "0"}
    r = alice.run("sbatch", "--parsable", "--hold", str(folder / "job.sbatch"), env=env, cwd=folder)
    assert r.returncode == 0, r.stderr
    return AliceJob(parse_sbatch_id(r.stdout), work, site.checkpoint.job_dir(alice.name, job.job.name), logs,
                    CommandRunner(slurm_cluster.env))


def _as(user: User, argv: list[str]) -> subprocess.Popen[bytes]:
    """``argv`` in the background as ``user``."""
    return subprocess.Popen(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", *argv],
                            env={"PATH": os.environ["PATH"], "HOME": str(user.home)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=10)


def test_bobs_fake_srun_named_like_alices_launch_is_not_adopted(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, site_area: Path) -> None:
    job = _submit_held(slurm_cluster, alice, alice_dir, site_area)
    # bob knows the job id (squeue shows it) and so the launch's step name: a process named srun of his
    fake = _as(bob, ["bash", "-c", f'exec -a srun {PYTHON} -c "import time; time.sleep(600)" '
                                   + f"--job-name=omni-{job.job_id}-launch-0"])
    try:
        wait_until(lambda: any(f"omni-{job.job_id}-launch-0".encode() in _cmdline(pid) for pid in _pids(bob)), 30,
                   "bob's fake srun to run")
        job.release()
        first = job.first_launch("alice's launch 0 to run its 2 ranks (not bob's process 'adopted')")
        assert sorted(rank for rank, _, _ in first) == [0, 1]
        job.finish()
    finally:
        (job.work / "done").touch()
        job.runner.run(["scancel", str(job.job_id)], check=False)
        _stop(fake)
    log = job.batch_log()
    assert f"supervisor: pid {fake.pid}, named like step omni-{job.job_id}-launch-0, runs as uid {bob.uid}" in log
    assert "adopted" not in log.replace("not adopted", "")
    state = job.journal().state
    assert [la.number for la in state.launches] == [0] and state.outcome == "done"
    assert state.launches[0].pid != fake.pid


def test_rendezvous_ports_bob_holds_are_not_alices_master_port(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, site_area: Path) -> None:
    job = _submit_held(slurm_cluster, alice, alice_dir, site_area)
    # the candidates follow from the public job id: bob holds those of alice's first four launches
    held = sorted({p for launch in range(4)
                   for p in rendezvous_ports(str(job.job_id), launch, avoid=ports.ephemeral_range())})
    holder = _as(bob, [PYTHON, "-c", HOLD_PORTS, *map(str, held)])
    try:
        wait_until(lambda: all(ports.in_use(p) for p in held), 30, "bob to hold alice's rendezvous ports")
        job.release()
        first = job.first_launch("alice's launch 0 to run its 2 ranks on a port bob does not hold")
        job.finish()
    finally:
        (job.work / "done").touch()
        job.runner.run(["scancel", str(job.job_id)], check=False)
        _stop(holder)
    (port,) = {p for _, p, _ in first}
    assert port not in held
    state = job.journal().state
    assert [la.number for la in state.launches] == [0] and state.outcome == "done"
    assert state.launches[0].port == port


HOLD_PORTS = """\
import socket, sys, time
held = []
for port in sys.argv[1:]:
    s = socket.socket()
    s.bind(("0.0.0.0", int(port)))
    s.listen()
    held.append(s)
time.sleep(600)
"""


def test_a_line_a_rank_prints_is_no_report_of_sruns(
        slurm_cluster, alice: User, bob: User, alice_dir: Path, site_area: Path) -> None:
    nodes = slurm_cluster.nodes
    # bob's sample in the shared data: srun's own words for a node failure and the step's end
    sample = site_area / "data" / "sample.txt"
    lines = [f"srun: error: Node failure on {n}" for n in nodes]
    lines += [f"srun: error: {n}: task 0: Exited with exit code 1" for n in nodes]
    r = bob.run("sh", "-c", f"printf '%s\\n' \"$@\" > {sample}", "sh", *lines, "srun: Terminating StepId=1.0")
    assert r.returncode == 0, r.stderr
    job = _submit_held(slurm_cluster, alice, alice_dir, site_area, sample=sample)
    try:
        job.release()
        first = job.first_launch("alice's launch 0 to run its 2 ranks")
        printed = max(at for _, _, at in first)
        # the supervisor reads its step's log as it grows; give it a few seconds of its own clock
        # (its status file, rewritten every few seconds) after the ranks printed, or its verdict
        def watched() -> bool:
            status = read_status(status_path(job.ckpt, str(job.job_id)))
            return status is not None and (status.updated_at > printed + 4 or status.phase != "running") \
                or len(job.journal().state.launches) > 1
        wait_until(watched, 60, "the supervisor to go on watching the step, or to act")
        assert job.journal().state.launches[0].confirmed is None, job.batch_log()[-2000:]
        assert job.launches().keys() == {0}
        job.finish()
    finally:
        (job.work / "done").touch()
        job.runner.run(["scancel", str(job.job_id)], check=False)
    state = job.journal().state
    assert [la.number for la in state.launches] == [0] and state.outcome == "done"
    assert state.launches[0].confirmed is None
    # the ranks' output is kept, in the launch's own log
    launch_log = job.journal().path.parent / f"omni-{job.job_id}-launch-0.log"
    assert "srun: error: Node failure on" in launch_log.read_text(errors="replace")


def _pids(user: User) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == user.uid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""

