"""``[training] command`` and ``[training.env]``: what loads, what renders, and one line per error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omni_configs import job_toml, site_toml

from slurm_omni.cli.main import main
from slurm_omni.config.job import load_job
from slurm_omni.config.site import load_site
from slurm_omni.errors import ConfigError
from slurm_omni.render.request import HetJobRequest, check_command, omni_argv, training_command


def _files(tmp_path: Path, training: str, site_top: str = "") -> tuple[Path, Path]:
    job = tmp_path / "job.toml"
    job.write_text(job_toml("own", data_parallel_size=1, time_limit="00:30:00", training=training))
    site = tmp_path / "site.toml"
    site.write_text(site_top + site_toml(tmp_path))
    return job, site


def test_command_fields_are_filled_in_and_the_builtin_is_the_default(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    job, site = _files(tmp_path, '[training]\ncommand = ["{python}", "{job_dir}/train.py", "--n={job_name}"]\n'
                                  '[training.env]\nNOTE = "{job_file}"\n')
    loaded, s = load_job(job), load_site(site)
    argv = training_command(loaded, s, job)
    assert argv == (sys.executable, str(tmp_path / "train.py"), "--n=own")
    check_command(argv, "own")
    script = HetJobRequest(job=loaded, site=s, job_file=job, job_sha256="0" * 64).materialize()
    assert f"export NOTE={job}" in script and "export OMNI_MAX_STEPS=100" in script
    builtin, _ = _files(tmp_path, '[training.data]\nshard_dir = "shards"\n')
    assert training_command(load_job(builtin), s, builtin) == (*omni_argv(s), "train", "--config", str(builtin))
    assert omni_argv(s)[0] == sys.executable


def test_a_relative_script_is_looked_for_in_the_workdir(tmp_path: Path) -> None:
    """The ranks start in [job] workdir: a relative ``train.py`` is found there, or refused in one line."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.py").write_text("")
    job, _ = _files(tmp_path, '[training]\ncommand = ["{python}", "train.py"]\n')
    job.write_text(job.read_text().replace("[job]\n", '[job]\nworkdir = "run"\n', 1))
    loaded = load_job(job)
    check_command((sys.executable, "train.py", "--lr", "x.py-not-a-script"), "own", loaded.job.workdir)
    with pytest.raises(ConfigError) as e:
        check_command((sys.executable, "other.py"), "own", loaded.job.workdir)
    assert str(e.value) == (f"job own: couldn't find other.py named in [training] command in the job's working "
                            f"folder {tmp_path / 'run'} (the ranks start there: [job] workdir, default the job file's "
                            "folder)")


def test_site_python_is_what_scripts_run(tmp_path: Path) -> None:
    job, site = _files(tmp_path, '[training]\ncommand = ["{omni}", "train", "--config", "{job_file}"]\n',
                       'python = "/opt/omni/bin/python"\n')
    assert training_command(load_job(job), load_site(site), job)[:3] == ("/opt/omni/bin/python", "-m",
                                                                         "slurm_omni.cli.main")


@pytest.mark.parametrize("training,needle", [
    ('[training]\ncommand = ["{pyhton}", "x.py"]\n', "'{pyhton}' is not allowed"),
    ('[training]\ncommand = ["", "x.py"]\n', "first word is the program"),
    ('[training]\ncommand = ["python3"]\n[training.env]\nOMNI_DP_SIZE = "1"\n', "training.env.OMNI_DP_SIZE"),
    ('[training]\ncommand = ["python3"]\n[training.env]\nRANK = "1"\n', "training.env.RANK"),
    ('[training]\nmax_steps = 3\n', "missing [training.data]"),
    ('[training]\ncommand = ["python3"]\n[training.env]\nOMNI_METRICS_PER_NODE = "maybe"\n',
     "training.env.OMNI_METRICS_PER_NODE='maybe': allowed are 1, on, true, yes or unset"),
])
def test_bad_command_is_one_line(tmp_path: Path, training: str, needle: str) -> None:
    job, _ = _files(tmp_path, training)
    with pytest.raises(ConfigError) as e:
        load_job(job)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_training_apis_knobs_may_be_set_in_training_env(tmp_path: Path) -> None:
    job, _ = _files(tmp_path, '[training]\ncommand = ["python3"]\n[training.env]\nOMNI_STEP_DELAY_S = "0.3"\n'
                              'OMNI_TRACE_SAMPLES = "1"\nOMNI_METRICS_PER_NODE = "0"\n')
    assert load_job(job).training.env == {"OMNI_STEP_DELAY_S": "0.3", "OMNI_TRACE_SAMPLES": "1",
                                          "OMNI_METRICS_PER_NODE": "0"}


def test_config_check_names_the_missing_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job, site = _files(tmp_path, '[training]\ncommand = ["no-such-trainer", "--fast"]\n')
    assert main(["config", "check", str(job), "--site", str(site)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("omni: job own: couldn't find [training] command's program 'no-such-trainer' (give an "
                    "absolute path, or {python} for the Python with slurm-omni)")]
    job, site = _files(tmp_path, '[training]\ncommand = ["{python}", "{job_dir}/absent.py"]\n')
    assert main(["config", "check", str(job), "--site", str(site)]) == 2
    assert f"couldn't find {tmp_path}/absent.py" in capsys.readouterr().err
    (tmp_path / "absent.py").write_text("")
    assert main(["config", "check", str(job), "--site", str(site)]) == 0
    assert f"runs {sys.executable} {tmp_path}/absent.py" in capsys.readouterr().out
