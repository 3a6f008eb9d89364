"""The rendered batch scripts run by the real cluster (sbatch, srun, scontrol), the training command
swapped for a small Python probe through the request's ``command``: hostile names come back
unchanged, exit codes map to done / requeue / failed, only the requeue signal requeues and only up
to max_requeues, an array task runs its own job file, and a drill spares a node it may not touch.

All jobs are submitted together when the module starts, so that they run side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from render_support import job_rows, start_requeued_now
from support import wait_until

from slurm_omni.cli.submit import parse_sbatch_id
from slurm_omni.config.job import JobFile
from slurm_omni.config.site import SiteConfig
from slurm_omni.elastic import codes as exitcodes
from slurm_omni.errors import ConfigError
from slurm_omni.ownership import current_user
from slurm_omni.policy.supervision import rendezvous_ports
from slurm_omni.render import ArrayJobRequest, DrillRequest, HetJobRequest
from slurm_omni.slurm.runner import CommandRunner
from slurm_omni.supervisor import ports

HOSTILE = "dir with space/quote'\"/$(touch PWNED)/`touch PWNED2`/semi;colon|pipe/new\nline/*?[a]/%x/tab\t/"
# The SPANK plugin refuses control characters in --omni-ckpt (srun would fail the step).
HOSTILE_PRINTABLE = HOSTILE.replace("new\nline/", "").replace("tab\t/", "")

# Stands in for `omni train` in every task: records its argv and environment, then behaves as its
# mode says. argv: MODE OUT_DIR [the argv it stands for...]
PROBE = r"""
import json, os, signal, sys, time
mode, out = sys.argv[1], sys.argv[2]
env = os.environ
rank = env.get("RANK", env.get("SLURM_PROCID", "x"))
tag = os.path.join(out, f"{env['OMNI_JOB_NAME']}-{env.get('SLURM_RESTART_COUNT', '0')}-{rank}")
with open(tag + ".json", "w") as f:
    json.dump({"argv": sys.argv[3:], "env": dict(env)}, f)

def note(signum):
    with open(tag + ".signals", "a") as f:
        f.write(signal.Signals(signum).name + "\n")

def checkpoint(signum, frame):
    note(signum)
    sys.exit(75)

if mode == "by-name":     # rank 0 acts out its job name (exit-N: exit N; kill-N: die of signal N)
    if rank != "0":          # after the others are gone: srun's step exit is then rank 0's alone
        sys.exit(0)
    while len([p for p in os.listdir(out) if p.startswith(env["OMNI_JOB_NAME"] + "-")]) < int(env["WORLD_SIZE"]):
        time.sleep(0.05)
    time.sleep(0.5)
    how, n = env["OMNI_JOB_NAME"].split("-")
    if how == "kill":
        os.kill(os.getpid(), int(n))
        time.sleep(10)
    sys.exit(int(n))
if mode == "checkpoint-on-signal":
    signal.signal(signal.SIGUSR1, checkpoint)
    signal.signal(signal.SIGTERM, checkpoint)
elif mode == "first-saves-first":           # rank 0 exits 75 at once; the others are still saving
    signal.signal(signal.SIGUSR1, checkpoint if rank == "0" else lambda signum, frame: note(signum))
elif mode != "record":
    sys.exit(f"probe: unknown mode {mode}")
if mode != "record":
    open(tag + ".ready", "w").close()
    time.sleep(120)
    sys.exit(1)
"""

cluster = pytest.mark.cluster


def _probe(mode: str, out: Path, *stands_for: str) -> tuple[str, ...]:
    return (sys.executable, "-c", PROBE, mode, str(out), *stands_for)


def _small(job: JobFile, log_dir: Path, name: str, **job_changes: object) -> JobFile:
    """One rank per stage on one GPU: the module's jobs fit on the cluster side by side."""
    return replace(job, job=replace(job.job, name=name, data_parallel_size=1, log_dir=log_dir, **job_changes),
                   stages=[replace(s, gres="gpu:h100:1") for s in job.stages])


@dataclass
class Submitted:
    runner: CommandRunner
    root: Path
    ids: dict[str, int]

    def out(self, key: str) -> Path:
        return self.root / key

    def log(self, name: str) -> str:
        path = self.root / "logs" / name
        return path.read_text() if path.exists() else ""

    def rows(self, job_id: int) -> list[dict[str, str]]:
        return job_rows(self.runner, job_id)

    def wait_gone(self, job_id: int, timeout_s: float = 60) -> None:
        wait_until(lambda: not self.runner.run(["squeue", "-h", "-j", str(job_id)], check=False).stdout.strip(),
                   timeout_s, f"job {job_id} to leave the queue", interval_s=0.5)

    def wait_ready(self, key: str, ranks: int, life: int = 0) -> None:
        wait_until(lambda: len(list(self.out(key).glob(f"*-{life}-*.ready"))) == ranks, 60,
                   f"{ranks} ranks of {key} (life {life}) to start", interval_s=0.3)

    def usr1(self, key: str) -> None:
        self.runner.run(["scancel", "--signal=USR1", "--batch", str(self.ids[key])])


@pytest.fixture(scope="module")
def submitted(slurm_cluster, plugin_built, tmp_path_factory: pytest.TempPathFactory,
              job: JobFile, site: SiteConfig) -> Iterator[Submitted]:
    root = tmp_path_factory.mktemp("scripts")
    logs = root / "logs"
    logs.mkdir()                                   # sbatch does not create the --output folder
    manager = replace(site.manager, spool_dir=slurm_cluster.spool)
    site = replace(site, checkpoint=replace(site.checkpoint, root=root / "ckpt"), manager=manager,
                   drills=replace(site.drills, allowed_nodes="node99"))
    for key in ("hostile", "exits", "usr1", "terminated", "drill"):
        (root / key).mkdir()

    hostile_file = root / HOSTILE / "job.toml"
    hostile_site = replace(site, checkpoint=replace(site.checkpoint, root=root / HOSTILE_PRINTABLE / "ckpt"))
    names = ("exit-0", "exit-75", "exit-1", "kill-9", "kill-15", "exit-3")
    sweep = [_small(job, logs, n) for n in names]
    requests: dict[str, tuple[str, list[str]]] = {
        "hostile": (HetJobRequest(
            job=_small(job, logs, "hostile"), site=hostile_site, job_file=hostile_file, job_sha256="0" * 64,
            command=_probe("record", root / "hostile", "omni", "train", "--config", str(hostile_file)),
        ).materialize(), []),
        # one task past the sweep's end: it has no job file
        "exits": (ArrayJobRequest(
            jobs=tuple(sweep), site=site, job_files=tuple(root / f"{n} $(x) 'q'.toml" for n in names),
            job_sha256s=tuple(str(i) * 64 for i in range(len(names))), name="exits",
            command=_probe("by-name", root / "exits"),
        ).materialize(), [f"--array=0-{len(names)}"]),
        "usr1": (HetJobRequest(
            job=_small(job, logs, "usr1", max_requeues=1), site=site, job_file=root / "j.toml",
            job_sha256="0" * 64, command=_probe("checkpoint-on-signal", root / "usr1"),
        ).materialize(), []),
        "terminated": (HetJobRequest(
            job=_small(job, logs, "terminated"), site=site, job_file=root / "j.toml", job_sha256="0" * 64,
            command=_probe("first-saves-first", root / "terminated"),
        ).materialize(), []),
        "drill": (DrillRequest(
            job=_small(job, logs, "drill"), site=site, job_file=root / "j.toml", job_sha256="0" * 64, rank=1,
            after_s=0, command=_probe("record", root / "drill"),
        ).materialize(), []),
    }
    runner = CommandRunner(slurm_cluster.env)
    ids: dict[str, int] = {}
    try:
        for key, (script, options) in requests.items():
            ids[key] = parse_sbatch_id(runner.run(["sbatch", "--parsable", *options], input_text=script).stdout)
        yield Submitted(runner, root, ids)
    finally:
        for job_id in ids.values():
            runner.run(["scancel", str(job_id)], check=False)


def _recorded(path: Path) -> tuple[list[str], dict[str, str]]:
    record = json.loads(path.read_text())
    return record["argv"], record["env"]


def test_hostile_names_pass_bash_n(job: JobFile, site: SiteConfig, tmp_path: Path) -> None:
    job_file = tmp_path / HOSTILE / "job.toml"
    site = replace(site, checkpoint=replace(site.checkpoint, root=tmp_path / HOSTILE / "ckpt"))
    job = replace(job, job=replace(job.job, log_dir=tmp_path / "logs with space/and 'quote'/$(x)"))
    path = tmp_path / "job.sbatch"
    path.write_text(HetJobRequest(job=job, site=site, job_file=job_file, job_sha256="0" * 64).materialize())
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr


@cluster
def test_hostile_names_come_back_unchanged(submitted: Submitted) -> None:
    leader = submitted.ids["hostile"]
    submitted.wait_gone(leader)
    assert "step finished: training done" in submitted.log(f"hostile-{leader}.out")
    records = sorted(submitted.out("hostile").glob("*.json"))
    assert [p.name for p in records] == ["hostile-0-0.json", "hostile-0-1.json"]
    job_file = submitted.root / HOSTILE / "job.toml"
    ckpt_dir = submitted.root / HOSTILE_PRINTABLE / "ckpt" / current_user() / "hostile"
    ports_seen: set[int] = set()
    for path, stage in zip(records, ("vision", "text"), strict=True):
        argv, env = _recorded(path)
        assert env["OMNI_STAGE_NAME"] == stage                      # --het-group=0,1 --omni-stage=vision:1,text:1
        assert argv == ["omni", "train", "--config", str(job_file)]
        assert env["OMNI_JOB_FILE"] == str(job_file)
        assert env["OMNI_CKPT_DIR"] == str(ckpt_dir)                # from --omni-ckpt, through the plugin
        # the rendezvous: NodeAddr of group 0's first node; the job's first free guess, else the OS's pick
        ephemeral = ports.ephemeral_range() or (32768, 60999)
        port = int(env["MASTER_PORT"])
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert port in rendezvous_ports(str(leader), 0, avoid=ephemeral) or ephemeral[0] <= port <= ephemeral[1]
        ports_seen.add(port)
        assert (env["OMNI_DP_SIZE"], env["OMNI_STAGES"], env["WORLD_SIZE"]) == ("1", "vision,text", "2")
    assert len(ports_seen) == 1                                     # one rendezvous for both ranks
    assert ckpt_dir.is_dir()
    assert not list(submitted.root.rglob("PWNED*"))


# probe's job name -> the batch script's exit code and what it says
EXITS = {
    "exit-0": (exitcodes.EXIT_DONE, "step finished: training done"),
    "exit-75": (exitcodes.EXIT_CHECKPOINTED, "step checkpointed without SIGUSR1 to this shell; not requeueing"),
    "exit-1": (exitcodes.EXIT_FAILED, "step failed with exit code 1"),
    "kill-9": (exitcodes.EXIT_FAILED, "step failed with exit code 137"),
    "kill-15": (exitcodes.EXIT_FAILED, "step failed with exit code 143"),   # TERM without the requeue signal
    "exit-3": (exitcodes.EXIT_FAILED, "step failed with exit code 3"),
}


@cluster
def test_exit_codes_and_array_tasks(submitted: Submitted) -> None:
    """Array task N runs job file N alone; the step's exit code becomes the task's."""
    array_id = submitted.ids["exits"]
    submitted.wait_gone(array_id)
    rows = {int(r["ArrayTaskId"]): r for r in submitted.rows(array_id)}
    assert sorted(rows) == list(range(len(EXITS) + 1))
    for task, (name, (script_exit, says)) in enumerate(EXITS.items()):
        log = submitted.log(f"exits-{array_id}_{task}.out")
        assert says in log, (name, log)
        assert (rows[task]["ExitCode"], rows[task]["Restarts"]) == (f"{script_exit}:0", "0"), (name, rows[task])
        argv, env = _recorded(submitted.out("exits") / f"{name}-0-0.json")
        assert argv == ["--config", str(submitted.root / f"{name} $(x) 'q'.toml")]
        assert (env["OMNI_JOB_NAME"], env["OMNI_CKPT_DIR"]) == (name, str(submitted.root / "ckpt" / current_user() / name))
        assert (env["OMNI_STAGE_NAME"], env["WORLD_SIZE"]) == ("vision", "2")
    missing = len(EXITS)
    assert f"omni: array task {missing} has no job file (sweep of {missing})" in \
        submitted.log(f"exits-{array_id}_{missing}.out")
    assert rows[missing]["ExitCode"] == f"{exitcodes.EXIT_FAILED}:0"


@cluster
def test_usr1_requeues_until_max_requeues(submitted: Submitted) -> None:
    """USR1 reaches every rank through the batch shell and srun; the checkpointed job is requeued
    once (max_requeues = 1) and the second life's checkpoint ends the job."""
    leader = submitted.ids["usr1"]
    out = submitted.out("usr1")
    submitted.wait_ready("usr1", 2)
    submitted.usr1("usr1")
    start_requeued_now(submitted.runner, submitted.ids["usr1"], 1)
    submitted.wait_ready("usr1", 2, life=1)
    submitted.usr1("usr1")
    submitted.wait_gone(leader)
    assert sorted(p.name for p in out.glob("*.signals")) == [f"usr1-{life}-{rank}.signals"
                                                             for life in (0, 1) for rank in (0, 1)]
    assert {p.read_text() for p in out.glob("*.signals")} == {"SIGUSR1\n"}
    log = submitted.log(f"usr1-{leader}.out")
    assert log.count("got SIGUSR1; forwarding it to the step") == 2
    assert f"requeueing job {leader} (restart 1 of 1)" in log
    assert "1 restarts reached MAX_REQUEUES=1, not requeueing" in log
    row = submitted.rows(leader)[0]
    assert (row["ExitCode"], row["Restarts"]) == (f"{exitcodes.EXIT_CHECKPOINTED}:0", "1"), row


@cluster
def test_term_after_usr1_counts_as_checkpointed(submitted: Submitted) -> None:
    """Rank 0 saves and exits 75 first; srun (--kill-on-bad-exit) then TERMs rank 1, which heard
    USR1 but has no TERM handler: the step ends 'Terminated', and the job is still requeued."""
    leader = submitted.ids["terminated"]
    submitted.wait_ready("terminated", 2)
    submitted.usr1("terminated")
    start_requeued_now(submitted.runner, leader, 1)
    submitted.runner.run(["scancel", str(leader)], check=False)
    out = submitted.out("terminated")
    assert [p.read_text() for p in sorted(out.glob("*.signals"))] == ["SIGUSR1\n", "SIGUSR1\n"]
    log = submitted.log(f"terminated-{leader}.out")
    assert "step ended by SIGTERM after SIGUSR1; taken as checkpointed" in log
    assert f"requeueing job {leader} (restart 1 of 3)" in log


@cluster
def test_drill_spares_a_node_it_may_not_touch(submitted: Submitted) -> None:
    """drills.allowed_nodes = node99: the target rank says where it runs and trains as usual."""
    leader = submitted.ids["drill"]
    submitted.wait_gone(leader)
    log = submitted.log(f"drill-{leader}.out")
    drill_lines = re.findall(r"omni drill: .*", log)
    assert len(drill_lines) == 1, log                          # only the target rank looks
    assert re.fullmatch(r"omni drill: rank 1 runs on node\d, outside drills.allowed_nodes: no fault", drill_lines[0])
    assert "step finished: training done" in log
    assert sorted(p.name for p in submitted.out("drill").glob("*.json")) == ["drill-0-0.json", "drill-0-1.json"]


def test_drill_refused_without_allowed_nodes(job: JobFile, site: SiteConfig) -> None:
    site = replace(site, drills=replace(site.drills, allowed_nodes=""))
    with pytest.raises(ConfigError, match="drills.allowed_nodes is empty"):
        DrillRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0", rank=0, after_s=1).materialize()


def test_drill_rank_checked(job: JobFile, site: SiteConfig) -> None:
    with pytest.raises(ConfigError, match="expected 0 <= rank < 4"):
        DrillRequest(job=job, site=site, job_file=Path("/j.toml"), job_sha256="0", rank=4, after_s=1).materialize()
