"""On the embedded cluster: an in-allocation job with the memory tier; one rank crashes (its task
SIGKILLed), the supervisor relaunches the step in the same job, every rank restores from its node's
memory (its first metrics line says so: ``restore_source``), the loss equals a run that never failed, and nothing of the job is left in
/dev/shm once it ended (its standbys freed it). Several minutes on 2 shared cores (a 40-step job with a
relaunch, and the reference run beside it): behind ``OMNI_MEMTIER_CLUSTER=1``."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from support import wait_until

from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint import held
from slurm_omni.checkpoint.memtier import DEFAULT_DIR, job_dir
from slurm_omni.config.site import load_site
from slurm_omni.drill import story
from slurm_omni.drill.reference import finish_reference, start_reference
from slurm_omni.formats.metrics import read_folder
from slurm_omni.ownership import current_user
from slurm_omni.slurm.runner import CommandRunner

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(os.environ.get("OMNI_MEMTIER_CLUSTER") != "1",
                                 reason="OMNI_MEMTIER_CLUSTER=1 runs the memory tier on the cluster (minutes)")]

NAME = "omni-memtier"


def _a_rank_task(job_id: int) -> int | None:
    """The pid of a standby client that runs a rank of the job (its task: killing it kills the rank)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            # the client (through the warm standby), or the trainer it became (no standby yet: it execs it)
            rank = cmdline[1:2] == [b"-S"] and cmdline[2].endswith(b"client.py") or \
                cmdline[1:3] == [b"-m", b"slurm_omni.cli.main"]
            if not rank or b"train" not in cmdline:
                continue
            env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == str(job_id).encode() and b"SLURM_STEP_ID" in env:
            found.append(int(entry))
    return max(found) if found else None


def _held(job_id: int) -> list[tuple[int, held.HeldCopy]]:
    """(keeper pid, copy) for every copy the job's keepers hold in their memory (the embedded
    cluster's nodes share one /dev/shm: one socket per node in the job's folder)."""
    folder = job_dir(DEFAULT_DIR, str(job_id))
    found = []
    for sock in folder.glob("keeper.*.sock"):
        client = held.KeeperClient(folder, str(job_id), sock.name.removeprefix("keeper.").removesuffix(".sock"))
        try:
            reply = client.ask("where")
        except held.KeeperUnreachable:
            continue
        finally:
            client.close()
        found += [(reply.pid, held.HeldCopy(c.name, reply.pid, c.addr, c.size)) for c in reply.copies]
    return found


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _flip_byte(pid: int, addr: int) -> None:
    """Flip one byte of another process's memory (process_vm_readv, then _writev: the test runs as the
    job's user)."""
    libc = ctypes.CDLL(None, use_errno=True)
    byte = ctypes.create_string_buffer(1)
    mine, theirs = _IoVec(ctypes.addressof(byte), 1), _IoVec(addr, 1)
    assert libc.process_vm_readv(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0) == 1, ctypes.get_errno()
    byte[0] = bytes([byte.raw[0] ^ 0xFF])
    assert libc.process_vm_writev(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0) == 1, ctypes.get_errno()


def _logs(work: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in [*work.rglob("*.log"), *work.rglob("*.out")])


def _demo(cluster, tmp_path: Path, *, name: str = NAME, site_edits: dict[str, str] | None = None) -> story.DemoFiles:
    """The in-allocation demo with the memory tier on: 4 ranks, 40 steps, a checkpoint every 5."""
    files = story.DemoFiles(tmp_path / "demo")
    story.write_files(files, cluster)
    site = files.site.read_text()
    for key, value in {"use_spank_plugin = true": "use_spank_plugin = false",
                       "default_spares = 1": "default_spares = 0",    # the demo site's stages share one partition
                       "[elasticity]\n": '[elasticity]\nrecovery = "in_allocation"\n',
                       # one /dev/shm for every node, as the embedded cluster has (not the demo's per node)
                       f'memory_dir = "{files.shm}/%n"\n': "",
                       **(site_edits or {})}.items():
        assert key in site
        site = site.replace(key, value)
    files.site.write_text(site)
    job = files.job.read_text()
    for key, value in {'name = "omni-demo"': f'name = "{name}"', "max_steps = 80": "max_steps = 40",
                       # a snapshot every 5 steps, each to memory and the file system (the demo's: memory every step)
                       "every_steps = 10": "every_steps = 5",
                       "memory_every_steps = 1\nfiles_every = 10": "memory_every_steps = 5\nfiles_every = 1"}.items():
        assert key in job
        job = job.replace(key, value)
    files.job.write_text(job)
    story.synthesize(files)
    return files


def _first_lines(files: story.DemoFiles, name: str) -> dict[tuple[int, int], dict]:
    """Each rank's first metrics line of each life: (incarnation, rank) -> the line."""
    metrics = load_site(files.site).manager.metrics_for(current_user()) / name
    firsts: dict[tuple[int, int], dict] = {}
    for lines in read_folder(metrics).values():   # own files and node files
        for _, line in lines:
            doc = json.loads(line)
            firsts.setdefault((doc["incarnation"], doc["rank"]), doc)
    return firsts


def _freed(job_id: int) -> None:
    deadline = time.monotonic() + 30
    while job_dir(DEFAULT_DIR, str(job_id)).exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not job_dir(DEFAULT_DIR, str(job_id)).exists(), "the job's memory tier outlived it"


def _last_step(files: story.DemoFiles, name: str) -> int:
    """The last step any rank finished (40 for a job that trained to its end)."""
    metrics = load_site(files.site).manager.metrics_for(current_user()) / name
    return max((json.loads(line)["step"] for lines in read_folder(metrics).values() for _, line in lines),
               default=0)


def _lines_with(files: story.DemoFiles, text: str) -> list[str]:
    """``file: line`` for each line of the job's logs that holds ``text``."""
    return [f"{p.name}: {line}" for p in [*files.work.rglob("*.log"), *files.work.rglob("*.out")]
            for line in p.read_text(errors="replace").splitlines() if text in line]


def test_a_crashed_rank_restores_every_rank_from_its_nodes_memory(slurm_cluster, tmp_path: Path) -> None:
    files = _demo(slurm_cluster.cluster, tmp_path)
    env = story.job_environment(slurm_cluster.cluster)
    ckpt = tmp_path / "demo" / "ckpt" / current_user() / NAME
    runner = CommandRunner(slurm_cluster.env)
    job_id = 0
    try:
        job_id = story.submit(files, env)
        wait_until(lambda: any(e.step >= 5 for e in fmt.complete(ckpt)), 300, "a checkpoint at step 5")
        assert _held(job_id) and not list(job_dir(DEFAULT_DIR, str(job_id)).glob("step-*.rank-*.h5")), \
            f"nothing kept in memory: {[line for line in _logs(files.work).splitlines() if 'memory' in line][:5]}"
        pid = wait_until(lambda: _a_rank_task(job_id), 60, "a rank's task")
        os.kill(pid, signal.SIGKILL)
        reference = start_reference(files.job, files.reference)
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False)
                   .stdout.strip(), 400, "the job to finish")
        ref_metrics = finish_reference(reference, files.reference, 300)
    finally:
        if job_id:
            runner.run(["scancel", str(job_id)], check=False)
    metrics = load_site(files.site).manager.metrics_for(current_user()) / NAME
    firsts = _first_lines(files, NAME)
    relaunched = {rank: doc.get("restore_source") for (life, rank), doc in firsts.items() if life > 0}
    assert sorted(relaunched) == [0, 1, 2, 3], firsts.keys()
    assert set(relaunched.values()) == {"memory"}, relaunched
    # each relaunched trainer, forked by its node's standby (which holds the node's copies), read the
    # shards it needs (its stage's: 2 here) in its own memory, inherited at the fork
    inherited = {rank: doc.get("restore_inherited") for (life, rank), doc in firsts.items() if life > 0}
    assert sorted(inherited) == [0, 1, 2, 3] and all(n and n >= 1 for n in inherited.values()), inherited
    eq = story.compare(files, metrics, ref_metrics)
    assert eq.ok, eq.problems
    assert eq.loss.mode == "bitwise" and eq.loss.steps_compared == 40
    _freed(job_id)


def _corrupt_copies_of(job_id: int, shard: str, until: threading.Event, done: set[tuple[int, str]]) -> None:
    """Flip bytes in the middle of every copy of ``shard`` that a keeper of the job holds (its tensor
    bytes: the HDF5 metadata is a few KiB at the start), until ``until`` is set."""
    while not until.wait(0.02):
        for pid, copy in _held(job_id):
            if f".{shard}." not in copy.name or (pid, copy.name) in done:
                continue
            try:
                for at in (copy.size // 2, copy.size * 3 // 4):
                    _flip_byte(pid, copy.addr + at)
            except AssertionError:
                continue
            done.add((pid, copy.name))


def test_a_corrupted_copy_in_memory_falls_back_to_the_file_system_once(slurm_cluster, tmp_path: Path) -> None:
    """Drill: every copy of rank 0's shard in memory corrupted, then a rank's task killed. The relaunch's
    rank 0 finds the mismatch, says so in one line, drops the copy and reads the same step from the file
    system (so does any rank that reads a piece of that shard); the other ranks restore from memory; no
    further relaunch (no restart loop); the job trains to its end; nothing left in /dev/shm."""
    name = "omni-memtier-bad"
    files = _demo(slurm_cluster.cluster, tmp_path, name=name)
    env = story.job_environment(slurm_cluster.cluster)
    ckpt = tmp_path / "demo" / "ckpt" / current_user() / name
    runner = CommandRunner(slurm_cluster.env)
    job_id = 0
    stop = threading.Event()
    corrupted: set[tuple[int, str]] = set()
    try:
        job_id = story.submit(files, env)
        wait_until(lambda: any(e.step >= 5 for e in fmt.complete(ckpt)), 300, "a checkpoint at step 5")
        corrupter = threading.Thread(target=_corrupt_copies_of, args=(job_id, "rank-00000", stop, corrupted),
                                     daemon=True)
        corrupter.start()
        wait_until(lambda: corrupted, 60, "a copy of rank 0's shard in memory")
        pid = wait_until(lambda: _a_rank_task(job_id), 60, "a rank's task")
        os.kill(pid, signal.SIGKILL)
        # corrupt what the old life still publishes on its way out, until the new life has restored
        wait_until(lambda: any(life > 0 for life, _ in _first_lines(files, name)), 400, "the relaunch's first step")
        stop.set()
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False)
                   .stdout.strip(), 400, "the job to finish")
    finally:
        stop.set()
        if job_id:
            runner.run(["scancel", str(job_id)], check=False)
    firsts = _first_lines(files, name)
    lives = sorted({life for life, _ in firsts})
    assert lives == [0, 1], f"lives {lives}: a bad copy must not cause another relaunch"
    relaunched = {rank: doc.get("restore_source") for (life, rank), doc in firsts.items() if life == 1}
    said = _lines_with(files, "dropped the copy")
    # rank 0, and every rank that reads a piece of rank 0's shard, falls back; the others restore from memory
    fell_back = sorted(rank for rank, source in relaunched.items() if source == "file system")
    # a rank of rank 0's node that looks for rank 0's shard after rank 0 dropped the bad copy fetches it
    # from the ring peer's keeper, whose copy is sound ("peer memory"): a valid source too
    assert sorted(relaunched) == [0, 1, 2, 3] and 0 in fell_back and "memory" in relaunched.values() and \
        set(relaunched.values()) <= {"file system", "memory", "peer memory"}, (relaunched, said)
    # the rank that found the mismatch; another that opened the copy after that rank dropped it says so
    assert any("checksum mismatch" in line for line in said), said
    assert all("rank-00000" in line and "from the file system" in line for line in said), said
    # one line per rank that found the bad copy; a rank that needed it after rank 0 dropped it reads the
    # file system without one
    assert 1 <= len(said) <= len(fell_back), said
    assert _last_step(files, name) == 40
    _freed(job_id)


def test_over_the_sites_cap_the_file_system_has_every_step(slurm_cluster, tmp_path: Path) -> None:
    """Drill: the site's cap ([checkpoint] memory_gib) below one shard. Each rank says so in one line
    (naming memory_gib), nothing is kept in memory, a killed rank's relaunch restores every rank from the
    file system, and the job completes; nothing left in /dev/shm."""
    name = "omni-memtier-cap"
    files = _demo(slurm_cluster.cluster, tmp_path, name=name,
                  site_edits={"[checkpoint]\n": "[checkpoint]\nmemory_gib = 0.00001\n"})
    env = story.job_environment(slurm_cluster.cluster)
    ckpt = tmp_path / "demo" / "ckpt" / current_user() / name
    runner = CommandRunner(slurm_cluster.env)
    job_id = 0
    try:
        job_id = story.submit(files, env)
        wait_until(lambda: any(e.step >= 5 for e in fmt.complete(ckpt)), 300, "a checkpoint at step 5")
        assert not list(job_dir(DEFAULT_DIR, str(job_id)).glob("step-*.h5")) and not _held(job_id), \
            "kept in memory over the cap"
        pid = wait_until(lambda: _a_rank_task(job_id), 60, "a rank's task")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not runner.run(["squeue", "-h", "-j", str(job_id)], check=False)
                   .stdout.strip(), 400, "the job to finish")
    finally:
        if job_id:
            runner.run(["scancel", str(job_id)], check=False)
    firsts = _first_lines(files, name)
    relaunched = {rank: doc.get("restore_source") for (life, rank), doc in firsts.items() if life == 1}
    assert relaunched == dict.fromkeys(range(4), "file system"), relaunched
    lines = _lines_with(files, "would pass the cap")
    assert all("memory_gib" in line and "the file system has it" in line for line in lines), lines
    lives = {life for life, _ in firsts}
    assert len(lines) == 4 * len(lives), lines   # once per rank and life, not once per step
    assert _last_step(files, name) == 40
    _freed(job_id)
