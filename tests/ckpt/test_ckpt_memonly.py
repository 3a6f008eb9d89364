"""Memory-only steps (issue 22: the file system written less often than memory): the shard file only in
the memory tier, its record, manifest and marker on the file system; restored from memory bitwise; a
step no memory holds (a replacement node, a lost copy, a bad copy) is passed over without a mark and
every rank agrees on the newest step each can restore; retention counts the steps with files."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from ckpt.states import assert_same, engine, modules, shard_state
from ckpt.test_ckpt_ranks import layout, state_of, weights
from slurm_omni.checkpoint import CheckpointEngine, Restore
from slurm_omni.checkpoint import format as fmt
from slurm_omni.checkpoint.agree import Loaded, restore_agreed
from slurm_omni.checkpoint.memtier import job_dir

SHM = Path("/dev/shm")

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def tier(nodes: Path, node: str = "a") -> dict[str, object]:
    return {"memory_tier": True, "memory_job": "job-1", "memory_dir": nodes / node}


def copies(nodes: Path, node: str = "a") -> list[str]:
    path = job_dir(nodes / node, "job-1")
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def test_a_memory_only_step_is_restored_from_memory_bitwise_and_has_no_file(tmp_path: Path, nodes: Path) -> None:
    with engine(tmp_path, **tier(nodes)) as eng:
        eng.save(100, shard_state(100), sync=True)
        result = eng.save(101, shard_state(101), sync=True, files=False)
        assert result.persisted.result().memory_only and result.persisted.result().committed
    step = fmt.step_dir(tmp_path, 101)
    assert not (step / "rank-00000.h5").exists() and (step / fmt.MEMORY_ONLY).exists()
    assert (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").exists()
    manifest = fmt.read_manifest(step)
    assert manifest.shards["rank-00000"].memory_only and manifest.shards["rank-00000"].file == "rank-00000.h5"
    assert f"step-101.rank-00000.{manifest.incarnation}.h5" in copies(nodes)
    with engine(tmp_path, **tier(nodes)) as eng, eng.restore() as r:
        assert r.step == 101 and r.source == "memory"
        for name, want in modules(101).items():
            assert_same(r.module(name), want, name)
        assert r.state == shard_state(101).state


def test_a_memory_only_step_no_memory_holds_is_passed_over_unmarked(
        tmp_path: Path, nodes: Path, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, **tier(nodes)) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(101, shard_state(101), sync=True, files=False)
    # another node (a replacement): its memory holds nothing of the job, no peer is known
    with engine(tmp_path, **tier(nodes, "b")) as eng, eng.restore() as r:
        assert r.step == 100 and r.source == "file system"
        assert_same(r.module("text_decoder"), modules(100)["text_decoder"])
    (line,) = warnings(caplog)
    assert "step-101" in line and "rank-00000 is only in memory" in line and "previous checkpoint" in line
    assert [e.step for e in fmt.complete(tmp_path)] == [101, 100]   # not marked: the node that has it reads it
    with engine(tmp_path, **tier(nodes)) as eng, eng.restore() as r:
        assert r.step == 101 and r.source == "memory"


def test_a_bad_copy_of_a_memory_only_step_falls_back_a_step_unmarked(
        tmp_path: Path, nodes: Path, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, **tier(nodes)) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(101, shard_state(101), sync=True, files=False)
    manifest = fmt.read_manifest(fmt.step_dir(tmp_path, 101))
    piece = manifest.units["text_decoder/model"].tensors["lm_head.weight"].pieces[0]
    copy = job_dir(nodes / "a", "job-1") / f"step-101.rank-00000.{manifest.incarnation}.h5"
    with open(copy, "r+b") as f:
        f.seek(piece.offset + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with engine(tmp_path, **tier(nodes)) as eng, eng.restore() as r:
        assert r.step == 100
        assert_same(r.module("text_decoder"), modules(100)["text_decoder"])
    (line,) = warnings(caplog)
    assert "step-101" in line and "lm_head.weight" in line and "only in memory" in line
    assert not copy.exists()   # no second try of a bad copy
    assert [e.step for e in fmt.complete(tmp_path)] == [101, 100]


def test_without_room_in_memory_a_memory_only_step_goes_to_the_file_system(
        tmp_path: Path, nodes: Path, caplog: pytest.LogCaptureFixture) -> None:
    with engine(tmp_path, **tier(nodes), memory_cap_bytes=1024) as eng:
        eng.save(100, shard_state(100), sync=True, files=False)
    step = fmt.step_dir(tmp_path, 100)
    assert (step / "rank-00000.h5").exists() and not (step / fmt.MEMORY_ONLY).exists()
    assert not fmt.read_manifest(step).shards["rank-00000"].memory_only
    assert any("cap" in line for line in warnings(caplog))
    with engine(tmp_path) as eng, eng.restore() as r:   # no tier at all: the files hold it
        assert r.step == 100 and r.source == "file system"


def test_retention_counts_the_steps_with_files_and_keeps_the_newest_memory_only_ones(
        tmp_path: Path, nodes: Path) -> None:
    with engine(tmp_path, keep_last=2, **tier(nodes)) as eng:
        for step, files in ((10, True), (20, True), (30, True), (31, False), (32, False), (33, False)):
            eng.save(step, shard_state(step), sync=True, files=files)
        assert [e.step for e in fmt.complete(tmp_path)] == [33, 32, 30, 20]
        eng.save(40, shard_state(40), sync=True)
        assert [e.step for e in fmt.complete(tmp_path)] == [40, 30]   # older memory-only steps: never restored
    names = copies(nodes)
    assert not any(n.startswith("step-31.") for n in names)   # the tier keeps two steps per rank


def _restore_all(engines: list[CheckpointEngine]) -> list[Restore | None]:
    """Each rank's agreed restore (``agree.restore_agreed``), the ranks as threads, the all-reduce a barrier."""
    barrier = threading.Barrier(len(engines))
    values: list[int] = [0] * len(engines)
    lock = threading.Lock()
    out: list[Restore | None] = [None] * len(engines)
    opened: list[Restore] = []

    def run(rank: int) -> None:
        def reduce_min(value: int) -> int:
            values[rank] = value
            barrier.wait()
            low = min(values)
            barrier.wait()
            return low

        def load(bound: int | None) -> Loaded[Restore] | None:
            r = engines[rank].restore(max_step=bound)
            if r is None:
                return None
            with lock:
                opened.append(r)
            return Loaded(r.step, r, r.fallbacks)

        out[rank] = restore_agreed(load, reduce_min, rank=rank)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in opened:
        if r not in out:
            r.close()
    return out


def test_the_ranks_agree_on_the_newest_step_every_rank_can_restore(tmp_path: Path, nodes: Path) -> None:
    """Two ranks on two nodes save steps 10 (files) and 11 (memory only); rank 1's node is replaced by
    one whose memory is empty (no peer holds its copy): rank 0 could read 11 from its own memory, but
    both restore 10 together, rank 1 from the files; a step only one rank has is never taken."""
    lays = [layout(rank, dp=1) for rank in range(2)]

    def save(rank: int) -> None:
        with engine(tmp_path, layout=lays[rank], incarnation="run-1", **tier(nodes, f"n{rank}")) as eng:
            eng.save(10, state_of(lays[rank], 10), sync=True)
            eng.save(11, state_of(lays[rank], 11), sync=True, files=False)

    threads = [threading.Thread(target=save, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [e.step for e in fmt.complete(tmp_path)] == [11, 10]
    engines = [engine(tmp_path, layout=lays[0], incarnation="run-2", **tier(nodes, "n0")),
               engine(tmp_path, layout=lays[1], incarnation="run-2", **tier(nodes, "replacement"))]
    try:
        got = _restore_all(engines)
        assert [r.step if r else None for r in got] == [10, 10]
        # rank 0 reads step 10 from its node's memory too (a file system step is copied there as well)
        assert [r.source if r else None for r in got] == ["memory", "file system"]
        assert got[1] is not None and set(got[1].module("text_decoder")) == set(weights("text", 10)["text_decoder"])
        for r in got:
            if r is not None:
                r.close()
        # both nodes still have their memory: both restore 11 from it
        engines.append(engine(tmp_path, layout=lays[1], incarnation="run-3", **tier(nodes, "n1")))
        got = _restore_all([engines[0], engines[2]])
        assert [r.step if r else None for r in got] == [11, 11]
        assert [r.source if r else None for r in got] == ["memory", "memory"]
        for r in got:
            if r is not None:
                r.close()
    finally:
        for eng in engines:
            eng.close()


def test_the_jobs_cadence_reaches_the_ranks_environment(tmp_path: Path) -> None:
    from slurm_omni.config.job import load_job
    from slurm_omni.config.site import load_site
    from slurm_omni.elastic.run import _cadence_env
    from slurm_omni.render import HetJobRequest

    data = Path(__file__).resolve().parents[1] / "templates" / "data"
    site = load_site(data / "site.toml")
    job_file = tmp_path / "job.toml"

    def env_of(checkpoint: str) -> dict[str, str]:
        job_file.write_text((data / "job.toml").read_text() + f"\n[training.checkpoint]\n{checkpoint}")
        script = HetJobRequest(job=load_job(job_file), site=site, job_file=job_file,
                               job_sha256="0" * 64).materialize()
        return {k: v for line in script.splitlines() if line.startswith("export OMNI_")
                for k, _, v in [line.removeprefix("export ").partition("=")]}

    env = env_of("memory_tier = true\nmemory_every_steps = 1\nfiles_every_s = 90.0\n")
    assert env["OMNI_MEMORY_EVERY_STEPS"] == "1" and env["OMNI_FILES_EVERY_S"] == "90" and "OMNI_FILES_EVERY" not in env
    assert _cadence_env(env) == (1, 0, 90.0)
    env = env_of("memory_tier = true\n")   # chosen by the run from what it measures
    assert not {"OMNI_MEMORY_EVERY_STEPS", "OMNI_FILES_EVERY", "OMNI_FILES_EVERY_S"} & set(env)
    assert _cadence_env(env) == (0, 0, 0.0)
    assert _cadence_env({}) is None   # no tier: every checkpoint to the file system, as before


def test_omni_ckpt_ls_and_verify_tell_a_memory_only_step(tmp_path: Path, nodes: Path) -> None:
    from click.testing import CliRunner

    from slurm_omni.cli.main import cli

    with engine(tmp_path, **tier(nodes)) as eng:
        eng.save(100, shard_state(100), sync=True)
        eng.save(101, shard_state(101), sync=True, files=False)
    runner = CliRunner()
    ls = runner.invoke(cli, ["ckpt", "ls", str(tmp_path)])
    assert ls.exit_code == 0 and "shard files only in the memory tier" in ls.output.splitlines()[-1]
    verify = runner.invoke(cli, ["ckpt", "verify", "--no-progress", str(tmp_path)])
    assert verify.exit_code == 0, verify.output
    assert "step-101: ok (0 datasets" in verify.output and "1 shard(s) only in the memory tier" in verify.output
    # a shard file that should be there and is not is still a problem
    (fmt.step_dir(tmp_path, 100) / "rank-00000.h5").unlink()
    assert runner.invoke(cli, ["ckpt", "verify", "--no-progress", str(fmt.step_dir(tmp_path, 100))]).exit_code != 0


@pytest.mark.parametrize("env", [{"OMNI_MEMORY_EVERY_STEPS": "x"}, {"OMNI_FILES_EVERY": "-1"},
                                 {"OMNI_FILES_EVERY": "2", "OMNI_FILES_EVERY_S": "30"}])
def test_a_bad_cadence_in_the_environment_is_one_line(env: dict[str, str]) -> None:
    from slurm_omni.elastic.run import _cadence_env
    from slurm_omni.errors import CheckpointError

    with pytest.raises(CheckpointError, match="memory tier's cadence") as e:
        _cadence_env({"OMNI_MEMORY_TIER": "1", **env})
    assert "\n" not in str(e.value)


def test_a_tmpfs_that_fills_while_writing_leaves_the_step_to_the_file_system_with_one_line(
        tmp_path: Path, nodes: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from slurm_omni.checkpoint import persist

    real = persist._write_file

    def full_in_memory(path: Path, *args: object, **kw: object) -> int:
        if str(path).startswith(str(nodes)):
            with open(path, "wb") as f:
                f.write(b"x" * 4096)   # a partial copy, which must not stay behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(persist, "_write_file", full_in_memory)
    with engine(tmp_path, **tier(nodes)) as eng:
        eng.save(100, shard_state(100), sync=True, files=False)
        eng.save(101, shard_state(101), sync=True, files=False)
    for step in (100, 101):
        assert (fmt.step_dir(tmp_path, step) / "rank-00000.h5").exists()
        assert not fmt.read_manifest(fmt.step_dir(tmp_path, step)).shards["rank-00000"].memory_only
    assert not any(n.endswith(".partial") for n in copies(nodes))
    (line,) = warnings(caplog)   # once, not every step
    assert "is full" in line and "file system" in line
