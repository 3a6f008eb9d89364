"""``omni config check`` catches what cannot run: each mistake is one line naming it and a
non-zero exit; ``--cluster`` checks partitions, gres and node names against the real cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from omni_configs import job_toml, site_toml

from slurm_omni.cli.main import main
from slurm_omni.config.job import parse_slurm_time
from slurm_omni.errors import ConfigError

TRAINING = '[training.parallel]\nglobal_batch_size = 8\nmicro_batch_size = 2\n[training.data]\nshard_dir = "shards"\n'


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = _check(capsys, *argv)
    assert code != 0 and out == "" and len(err.splitlines()) == 1, (code, out, err)
    return err


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("90:30", 5430), ("02:00:00", 7200), ("25:00:00", 90000), ("1-00", 86400),
    ("1-02:30", 95400), ("1-23:59:59", 172799), ("0-00:00:59", 59)])
def test_slurm_time_formats_as_slurm_sums_them(text: str, seconds: int) -> None:
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text, why", [
    ("25:99:99", "minutes = 99 (expected below 60; Slurm would silently take it as 1-02:40:39)"),
    ("10:60", "seconds = 60"), ("1-24", "hours = 24"), ("1-02:60", "minutes = 60"),
    ("٣٠", "ASCII digits"), ("1:2:3:4", "expected a Slurm time"), ("UNLIMITED", "expected a Slurm time"),
    ("99999999:00:00", "more than Slurm can hold")])
def test_times_slurm_would_carry_over_or_refuse_are_refused(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match="is not allowed") as e:
        parse_slurm_time(text)
    assert why in str(e.value)


def _site(tmp_path: Path, **kw: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(site_toml(tmp_path, **kw))   # type: ignore[arg-type]
    return path


@pytest.mark.parametrize("job_keys, training, expected", [
    ('', TRAINING, None),
    ('', TRAINING.replace("global_batch_size = 8", "global_batch_size = 6"),
     "couldn't cut global_batch_size = 6 for 2 replicas of micro_batch_size = 2"),
    ('log_dir = "logs\\nevil"\n', TRAINING, "log_dir"),
    # the memory tier's cadence (issue 22): set only with the tier, counts 0 or more, one of two file cadences
    ('', TRAINING + "[training.checkpoint]\nmemory_tier = true\nmemory_every_steps = 1\nfiles_every = 20\n", None),
    ('', TRAINING + "[training.checkpoint]\nmemory_every_steps = 2\n",
     "memory_every_steps = 2 needs memory_tier = true"),
    ('', TRAINING + "[training.checkpoint]\nmemory_tier = true\nfiles_every = -3\n", "files_every = -3 (0 or more"),
    ('', TRAINING + "[training.checkpoint]\nmemory_tier = true\nfiles_every = 4\nfiles_every_s = 60.0\n",
     "files_every = 4 and files_every_s = 60: set one of them"),
])
def test_job_file_mistakes(capsys: pytest.CaptureFixture[str], tmp_path: Path, job_keys: str, training: str,
                           expected: str | None) -> None:
    site = _site(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(job_toml("omni-tiny", data_parallel_size=2, nodes=1, job_keys="signal_before_s = 60\n" + job_keys,
                            training=training))
    if expected is None:
        code, out, _ = _check(capsys, str(job), "--site", str(site))
        assert code == 0 and out.startswith("ok: ")
    else:
        assert expected in _one_error(capsys, str(job), "--site", str(site))


def test_a_time_limit_slurm_would_rewrite_is_refused_by_config_check(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(job_toml("omni-tiny", time_limit="25:99:99", training=TRAINING))
    assert "time '25:99:99' is not allowed: minutes = 99" in _one_error(capsys, str(job), "--site",
                                                                      str(_site(tmp_path)))


def test_a_newline_in_the_checkpoint_root_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    site = _site(tmp_path, ckpt_root=f"{tmp_path}/ckpt\nevil")
    err = _one_error(capsys, str(site))
    assert "checkpoint.root" in err and "control characters" in err


def test_a_file_that_is_not_utf8_or_a_folder_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes("cluster = 'caf\xe9'\n".encode("latin-1"))
    assert "is not UTF-8" in _one_error(capsys, str(bad))
    assert "not a regular file" in _one_error(capsys, str(tmp_path))
    assert "no such file" in _one_error(capsys, str(tmp_path / "absent.toml"))


@pytest.mark.cluster
def test_config_check_against_the_running_cluster(slurm_cluster, capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    good = _site(tmp_path, tables='[drills]\nallowed_nodes = "node[5-8]"\n')
    code, out, _ = _check(capsys, str(good), "--cluster")
    assert code == 0 and out.endswith("fits the running cluster\n"), out
    for text, expected in [
        (site_toml(tmp_path).replace('partition = "vision"', 'partition = "nosuch"'),
         "stages.vision: partition 'nosuch' is not in the cluster (it has: debug, text, vision)"),
        (site_toml(tmp_path).replace('gres = "gpu:h100:4"', 'gres = "gpu:h100:9"', 1),
         "no node of partition 'vision' has gres gpu:h100:9 per node (its nodes have: gpu:h100:4)"),
        (site_toml(tmp_path, tables='[drills]\nallowed_nodes = "node[8-9]"\n'),
         "drills.allowed_nodes: node 'node9' is not in the cluster"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        assert expected in _one_error(capsys, str(bad), "--cluster")
    job = tmp_path / "job.toml"
    job.write_text(job_toml("omni-tiny", job_keys="signal_before_s = 60\n",
                            training=TRAINING.replace("global_batch_size = 8", "global_batch_size = 2")).replace('nodes = 1\n[[stages]]', 'nodes = 1\npartition = "gone"\n[[stages]]'))
    assert "stages 'vision': partition 'gone' is not in the cluster" in _one_error(
        capsys, str(job), "--site", str(good), "--cluster")
