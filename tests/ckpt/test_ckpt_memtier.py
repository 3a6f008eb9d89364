"""The memory tier on a real /dev/shm: restore from the node's own memory, bitwise; a bad or missing
copy falls back to the file system with one line; the fence, the cap and a full tmpfs; nothing left."""

from __future__ import annotations

import errno
import logging
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckpt.states import assert_same, engine, modules, optimizer_state, shard_state
from slurm_omni.checkpoint import fileio, memtier
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.fence import raise_fence
from slurm_omni.checkpoint.memtier import MemoryTier, free_job, job_dir

SHM = Path("/dev/shm")

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


@pytest.fixture
def job() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    shutil.rmtree(job_dir(SHM, name), ignore_errors=True)


def copies(job: str) -> list[str]:
    path = job_dir(SHM, job)
    return sorted(os.listdir(path)) if path.exists() else []


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_restore_reads_this_nodes_memory_bitwise(tmp_path: Path, job: str) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
        eng.save(300, shard_state(300), sync=True)
    assert copies(job) == [f"step-{s}.rank-00000.{eng.incarnation}.h5" for s in (200, 300)]   # keeps two
    folder = job_dir(SHM, job)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    for name in copies(job):
        st = os.lstat(folder / name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    # the file system's shard is gone: only the node's memory can give the bytes back
    (fmt.step_dir(tmp_path, 300) / "rank-00000.h5").unlink()
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 300 and r.source == "memory"
        assert r.read_bytes["direct"] == 0
        for name, want in modules(300).items():
            assert_same(r.module(name), want, name)
        assert_same(r.optimizer("text_decoder"), optimizer_state(300))
        assert r.state == shard_state(300).state


def test_without_the_tier_nothing_goes_to_memory(tmp_path: Path, job: str) -> None:
    with engine(tmp_path) as eng:
        eng.save(100, shard_state(100), sync=True)
    with engine(tmp_path) as eng, eng.restore() as r:
        assert r.source == "file system"
    assert copies(job) == []


def test_a_corrupted_copy_falls_back_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    manifest = fmt.read_manifest(fmt.step_dir(tmp_path, 200))
    piece = manifest.units["text_decoder/model"].tensors["lm_head.weight"].pieces[0]
    copy = job_dir(SHM, job) / f"step-200.rank-00000.{manifest.incarnation}.h5"
    with open(copy, "r+b") as f:
        f.seek(piece.offset + 7)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"   # the same step, from the files
        assert_same(r.module("text_decoder"), modules(200)["text_decoder"])
    (line,) = warnings(caplog)
    assert "step-200" in line and "lm_head.weight" in line and "memory" in line and "file system" in line
    assert sorted(e.step for e in fmt.complete(tmp_path)) == [100, 200]   # the checkpoint itself is sound
    assert not copy.exists()                                       # no second try of a bad copy
    caplog.clear()
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"
    assert warnings(caplog) == []


def test_a_copy_another_rank_dropped_after_the_check_falls_back_to_the_file_system(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one node share its copies: one that finds a copy bad drops it, and another rank that
    checked it just before opens nothing. That is a bad copy too (one line, the files), not a failed
    restore (which would relaunch the job: the cluster drill's second relaunch)."""
    from slurm_omni.checkpoint import restore as restore_mod

    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    real = restore_mod._check_files

    def checked_then_dropped(path: Path, manifest: fmt.Manifest, sources: dict[str, Path] | None = None) -> None:
        real(path, manifest, sources)
        for copy in (sources or {}).values():
            copy.unlink()   # what the other rank's drop does, between this rank's check and its read

    monkeypatch.setattr(restore_mod, "_check_files", checked_then_dropped)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        for name, want in modules(100).items():
            assert_same(r.module(name), want, name)
    (line,) = warnings(caplog)
    assert "copy in memory" in line and "file system" in line, line


def test_a_copy_of_another_incarnation_or_size_is_not_read(tmp_path: Path, job: str) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job, incarnation="run.1") as eng:
        eng.save(100, shard_state(100), sync=True)
    folder = job_dir(SHM, job)
    # an older life's copy of the same step (it did not commit it) is not what the manifest describes
    os.rename(folder / "step-100.rank-00000.run.1.h5", folder / "step-100.rank-00000.run.0.h5")
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.source == "file system"
    os.rename(folder / "step-100.rank-00000.run.0.h5", folder / "step-100.rank-00000.run.1.h5")
    with open(folder / "step-100.rank-00000.run.1.h5", "ab") as f:
        f.write(b"x")
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.source == "file system"
        assert_same(r.module("projector"), modules(100)["projector"])


def test_an_older_incarnation_cannot_publish_after_a_newer_one_started(tmp_path: Path, job: str) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job, incarnation="j.1", incarnation_number=1) as old:
        old.save(100, shard_state(100), sync=True)
        raise_fence(tmp_path, 2, "j.2")   # the next life started on the root
        result = old.save(200, shard_state(200), sync=True)
        assert result.fenced
    assert copies(job) == ["step-100.rank-00000.j.1.h5"]
    # and a copy it had written just before the raise is not renamed into place after it
    shard = fmt.step_dir(tmp_path, 100) / "rank-00000.h5"
    tier = MemoryTier(job, base=SHM)
    assert tier.publish(shard, step=300, rank=0, incarnation="j.1", root=tmp_path, number=1) is None
    assert tier.publish(shard, step=300, rank=0, incarnation="j.2", root=tmp_path, number=2) is not None
    assert copies(job) == ["step-100.rank-00000.j.1.h5", "step-300.rank-00000.j.2.h5"]


def test_the_cap_leaves_the_step_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job, memory_cap_bytes=4096) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert copies(job) == []
    (line,) = warnings(caplog)
    assert "cap" in line and "memory_gib" in line and "file system" in line
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"


def test_a_full_tmpfs_leaves_the_step_to_the_file_system(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(src: int, dst: int, size: int) -> None:
        os.write(dst, b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memtier, "_copy", full)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert copies(job) == []   # the partial copy is gone too
    (line,) = warnings(caplog)
    assert "full" in line and "/dev/shm" in line
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"


def test_a_folder_others_can_write_is_not_used(tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture) -> None:
    folder = job_dir(SHM, job)
    folder.parent.mkdir(mode=0o700, exist_ok=True)
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o777)
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        assert eng.memory is None
        eng.save(100, shard_state(100), sync=True)
    assert copies(job) == []
    assert any("memory tier" in w and "file system only" in w for w in warnings(caplog))


def test_another_user_cannot_read_the_copies(tmp_path: Path, job: str) -> None:
    try:
        pwd.getpwnam("alice")
    except KeyError:
        pytest.skip("no user alice")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser to act as alice")
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    (name,) = copies(job)
    target = job_dir(SHM, job) / name
    read = subprocess.run(["runuser", "-u", "alice", "--", "cat", str(target)], capture_output=True, timeout=60,
                          check=False)
    assert read.returncode != 0 and b"Permission denied" in read.stderr
    replace = subprocess.run(["runuser", "-u", "alice", "--", "cp", "/dev/null", str(target)], capture_output=True,
                             timeout=60, check=False)
    assert replace.returncode != 0


def test_free_job_leaves_nothing(tmp_path: Path, job: str) -> None:
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert len(copies(job)) == 2
    assert free_job(job, base=SHM) > 0
    assert not job_dir(SHM, job).exists()
    assert job_dir(SHM, job).parent.is_dir()   # the user's omni-<uid>/ stays (memtier's doc says why)
    assert free_job(job, base=SHM) == 0


def test_the_standby_frees_the_jobs_memory_when_stopped(tmp_path: Path, job: str) -> None:
    """The keeper: ``omni standby serve`` (what the supervisor runs on every node) removes the job's
    objects from the tmpfs when it is stopped at the job's end."""
    with engine(tmp_path, memory_tier=True, memory_job=job) as eng:
        eng.save(100, shard_state(100), sync=True)
    assert copies(job)
    short = Path(tempfile.mkdtemp(prefix="sb", dir="/tmp"))   # a socket's path has at most 107 bytes
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURMD_NODENAME": "n1", "TMPDIR": str(short)}
    server = subprocess.Popen([sys.executable, "-m", "slurm_omni.cli.main", "standby", "serve"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sock = short / f"omni-standby-{os.geteuid()}-{job}" / f"omni-standby-{job}-n1.sock"
        deadline = time.monotonic() + 180
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sock.exists(), "the standby server never listened"
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        shutil.rmtree(short, ignore_errors=True)
    assert not job_dir(SHM, job).exists()


def test_from_env_needs_a_keeper(caplog: pytest.LogCaptureFixture) -> None:
    assert memtier.from_env({}) == {}
    assert memtier.from_env({"OMNI_MEMORY_TIER": "1"}) == {}
    assert "memory tier off" in warnings(caplog)[0]
    got = memtier.from_env({"OMNI_MEMORY_TIER": "1", "OMNI_MEMORY_KEEPER": "42", "OMNI_MEMORY_GIB": "0.5"})
    assert got == {"memory_tier": True, "memory_cap_bytes": 2**29}


def test_the_job_and_site_settings_reach_the_ranks_environment(tmp_path: Path) -> None:
    from slurm_omni.config.job import load_job
    from slurm_omni.config.site import load_site
    from slurm_omni.errors import ConfigError
    from slurm_omni.render import HetJobRequest

    def write(path: Path, text: str) -> Path:
        path.write_text(text)
        return path

    data = Path(__file__).resolve().parents[1] / "templates" / "data"
    job_file = tmp_path / "job.toml"
    job_file.write_text((data / "job.toml").read_text() + "\n[training.checkpoint]\nmemory_tier = true\n")
    site_file = tmp_path / "site.toml"
    site_file.write_text((data / "site.toml").read_text().replace("[checkpoint]\n", "[checkpoint]\nmemory_gib = 1.5\n"))
    job, site = load_job(job_file), load_site(site_file)
    assert job.training.checkpoint.memory_tier and site.checkpoint.memory_gib == 1.5

    def script(job_: object, site_: object) -> str:
        return HetJobRequest(job=job_, site=site_, job_file=job_file, job_sha256="0" * 64).materialize()  # type: ignore[arg-type]

    on = script(job, site)
    assert "OMNI_MEMORY_TIER=1" in on and "OMNI_MEMORY_GIB=1.5" in on and "OMNI_MEMORY_DIR" not in on
    huge = load_site(write(tmp_path / "huge.toml", site_file.read_text().replace(
        "[checkpoint]\n", "[checkpoint]\nmemory_dir = \"/dev/hugeshm\"\n")))
    assert "OMNI_MEMORY_DIR=/dev/hugeshm" in script(job, huge)
    with pytest.raises(ConfigError, match="memory_dir"):
        load_site(write(tmp_path / "rel.toml", site_file.read_text().replace(
            "[checkpoint]\n", "[checkpoint]\nmemory_dir = \"shm\"\n")))
    off = script(load_job(data / "job.toml"), site)
    assert "OMNI_MEMORY" not in off


@pytest.fixture
def mounted_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """A tmpfs of this test's own, mounted with the options given (skipped where mounting is not
    allowed: not root, or no CAP_SYS_ADMIN); unmounted after."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        where = tmp_path / f"tmpfs-{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True, timeout=60, check=False)
        if proc.returncode != 0:
            pytest.skip(f"couldn't mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60, check=False)


def test_a_tmpfs_too_full_for_the_shard_leaves_it_to_the_file_system_with_one_line(
        tmp_path: Path, job: str, caplog: pytest.LogCaptureFixture, mounted_tmpfs: Callable[[str], Path]) -> None:
    small = mounted_tmpfs("size=64k,mode=1777")
    with engine(tmp_path, memory_tier=True, memory_job=job, memory_dir=small) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(200, shard_state(200), sync=True)
    assert [p.name for p in job_dir(small, job).iterdir()] == []   # nothing, not even a partial copy
    (line,) = warnings(caplog)
    assert str(small) in line and "free" in line and "the file system has it" in line, line
    with engine(tmp_path, memory_tier=True, memory_job=job, memory_dir=small) as eng, eng.restore() as r:
        assert r.step == 200 and r.source == "file system"
    assert free_job(job, base=small) == 0 and not job_dir(small, job).exists()


def test_copies_on_a_huge_page_tmpfs_restore_bitwise(
        tmp_path: Path, job: str, mounted_tmpfs: Callable[[str], Path]) -> None:
    huge = mounted_tmpfs("size=256m,huge=within_size,mode=1777")
    with engine(tmp_path, memory_tier=True, memory_job=job, memory_dir=huge) as eng:
        eng.save(100, shard_state(100), sync=True)
    (copy,) = job_dir(huge, job).iterdir()
    if os.stat(copy).st_blksize < fileio.HUGE_PAGE:
        pytest.skip("this kernel's tmpfs gives no huge pages with huge=within_size")
    (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").unlink()   # only the memory can give the bytes back
    with engine(tmp_path, memory_tier=True, memory_job=job, memory_dir=huge) as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "memory" and r.read_bytes["memory"] > 0
        for name, want in modules(100).items():
            assert_same(r.module(name), want, name)
        assert_same(r.optimizer("text_decoder"), optimizer_state(100))
    assert free_job(job, base=huge) > 0
