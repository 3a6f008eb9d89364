"""Site config and job file: what loads, and one test per error, each naming file, key, value."""

from __future__ import annotations

from pathlib import Path

import pytest
from omni_configs import job_toml, site_toml

from slurm_omni.config.job import load_job, parse_slurm_time
from slurm_omni.config.site import load_site, parse_gres
from slurm_omni.errors import ConfigError
from slurm_omni.render import plan_stages

REPO = Path(__file__).resolve().parents[2]

SITE = site_toml(ckpt_root="/shared/ckpt", spool_dir="/var/spool/omni", registry_dir="/var/lib/omni/registry",
                 metrics_dir="/var/lib/node_exporter/textfile", tables="""\
[detection]
heartbeat_interval_s = 5
confirmation_window_s = 15
progress_window_s = 60
[elasticity]
min_data_parallel_size = 1
spare_policy = "same_switch"
spare_nodes = "node[7-8]"
[drills]
allowed_nodes = "node[5-8]"
""")

JOB = job_toml("omni-tiny", data_parallel_size=2, time_limit="01:00:00")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_site_loads(tmp_path: Path) -> None:
    site = load_site(_write(tmp_path, "omni.toml", SITE))
    assert site.stages["vision"].partition == "vision"
    assert site.drills.nodes == ("node5", "node6", "node7", "node8")
    assert site.detection.heartbeat_interval_s == 5.0
    assert site.manager.spool_dir == Path("/var/spool/omni")


def test_job_loads_with_paths_from_its_folder(tmp_path: Path) -> None:
    job = load_job(_write(tmp_path, "job.toml", JOB))
    assert [s.name for s in job.stages] == ["vision", "text"]
    assert job.job.log_dir == tmp_path / "logs"
    assert job.job.workdir == tmp_path                        # the default: the job file's folder
    (tmp_path / "run").mkdir()
    moved = load_job(_write(tmp_path, "job2.toml", JOB.replace("[job]\n", "[job]\nworkdir = \"run/../run\"\n", 1)))
    assert moved.job.workdir == tmp_path / "run"              # relative to the job file, normalised
    elsewhere = load_job(_write(tmp_path, "job3.toml", JOB.replace("[job]\n", f"[job]\nworkdir = \"{tmp_path / 'run'}\"\n", 1)))
    assert elsewhere.job.workdir == tmp_path / "run"
    assert job.training.data.shard_dir == tmp_path / "shards"
    assert job.job.time_limit_s == 3600


@pytest.mark.parametrize("path", ["site-config/omni.toml", "site-config/examples/job.toml"])
def test_shipped_files_load(path: str) -> None:
    full = REPO / path
    if full.name == "job.toml":
        plan_stages(load_job(full), load_site(REPO / "site-config/omni.toml"))
    else:
        load_site(full)


SITE_ERRORS = [
    ("unknown top-level key", ("cluster = \"omni\"", "cluster = \"omni\"\nclustre = 1"), "unknown key 'clustre'"),
    ("unknown nested key", ("root = \"/shared/ckpt\"", "root = \"/shared/ckpt\"\nrot = 1"),
     "unknown key 'checkpoint.rot'"),
    ("bad partition", ("partition = \"vision\"", "partition = \"vi sion\""), "partition 'vi sion' is not allowed"),
    ("bad gres", ("gres = \"gpu:h100:4\"\n[stages.text]", "gres = \"gpu:h100\"\n[stages.text]"),
     "gres 'gpu:h100' is not allowed"),
    ("relative ckpt root", ("root = \"/shared/ckpt\"", "root = \"shared/ckpt\""), "checkpoint.root 'shared/ckpt'"),
    ("relative spool", ("spool_dir = \"/var/spool/omni\"", "spool_dir = \"spool\""), "manager.spool_dir 'spool'"),
    ("heartbeat zero", ("heartbeat_interval_s = 5", "heartbeat_interval_s = 0"), "heartbeat_interval_s = 0.0"),
    ("confirmation shorter than heartbeat", ("confirmation_window_s = 15", "confirmation_window_s = 1"),
     "confirmation_window_s = 1.0 is not allowed"),
    ("progress window too short", ("progress_window_s = 60", "progress_window_s = 6"), "progress_window_s = 6.0"),
    ("min dp zero", ("min_data_parallel_size = 1", "min_data_parallel_size = 0"), "min_data_parallel_size = 0"),
    ("spare policy", ("spare_policy = \"same_switch\"", "spare_policy = \"nearby\""),
     "elasticity.spare_policy = 'nearby' is not allowed (expected one of 'same_switch', 'any_switch', 'none')"),
    ("bad hostlist", ("allowed_nodes = \"node[5-8]\"", "allowed_nodes = \"node[5-\""), "drills.allowed_nodes"),
    ("wrong type", ("heartbeat_interval_s = 5", "heartbeat_interval_s = \"5s\""),
     "detection.heartbeat_interval_s = '5s' is not allowed (expected a number)"),
    ("default spares above the cap", ("min_data_parallel_size = 1", "min_data_parallel_size = 1\ndefault_spares = 5"),
     "elasticity.default_spares = 5 is not allowed (expected 0 <= it <= elasticity.max_spares = 4)"),
    ("recovery path", ("min_data_parallel_size = 1", "min_data_parallel_size = 1\nrecovery = \"restart\""),
     "elasticity.recovery = 'restart' is not allowed (expected one of '', 'resubmit', 'in_allocation', 'allocation')"),
    ("allocation mode not allowed", ("min_data_parallel_size = 1", "min_data_parallel_size = 1\nrecovery = \"allocation\""),
     'elasticity.recovery = "allocation" is not allowed without elasticity.allow_allocation = true'),
    ("bad feature", ("gres = \"gpu:h100:4\"\n[stages.text]", "gres = \"gpu:h100:4\"\nfeature = \"a b\"\n[stages.text]"),
     "stages.feature 'a b' is not allowed"),
]


@pytest.mark.parametrize(("case", "edit", "message"), SITE_ERRORS, ids=[c[0] for c in SITE_ERRORS])
def test_site_error(tmp_path: Path, case: str, edit: tuple[str, str], message: str) -> None:
    assert edit[0] in SITE, case
    path = _write(tmp_path, "omni.toml", SITE.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError) as e:
        load_site(path)
    assert str(path) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


JOB_ERRORS = [
    ("unknown key", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\ntimelimit = 1"),
     "unknown key 'job.timelimit'"),
    ("missing name", ("name = \"omni-tiny\"\n", ""), "missing required key 'job.name'"),
    ("bad name", ("name = \"omni-tiny\"", "name = \"omni tiny\""), "job.name 'omni tiny' is not allowed"),
    ("dp zero", ("data_parallel_size = 2", "data_parallel_size = 0"), "job.data_parallel_size = 0"),
    ("bad time", ("time_limit = \"01:00:00\"", "time_limit = \"1h\""), "time '1h' is not allowed"),
    ("signal after limit", ("time_limit = \"01:00:00\"", "time_limit = \"2\""), "job.signal_before_s = 300"),
    ("bad requeue signal", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\nrequeue_signal = \"KILL\""),
     "job.requeue_signal = 'KILL' is not allowed (expected one of 'USR1', 'USR2')"),
    ("no stages", [("[[stages]]\nname = \"vision\"\nnodes = 1\n[[stages]]\nname = \"text\"\nnodes = 1\n", ""),
                   ("[job]\n", "stages = []\n[job]\n")], "stages is empty"),
    ("duplicate stage", ("name = \"text\"", "name = \"vision\""), "expected distinct names"),
    ("nodes do not divide dp", ("name = \"text\"\nnodes = 1", "name = \"text\"\nnodes = 3"),
     "nodes = 3 x tasks_per_node = derived is not allowed"),
    ("bad switch wait", ("name = \"text\"\nnodes = 1", "name = \"text\"\nnodes = 1\nswitch_wait = \"soon\""),
     "time 'soon' is not allowed"),
    ("bad stage gres", ("name = \"text\"\nnodes = 1", "name = \"text\"\nnodes = 1\ngres = \"gpu:-1\""),
     "gres 'gpu:-1' is not allowed"),
    ("training error passes through", ("shard_dir = \"shards\"", "shard_dir = \"shards\"\nshuffle = 1"),
     "unknown key 'training.data.shuffle'"),
    ("missing training", ("[training.data]\nshard_dir = \"shards\"\n", ""), "missing required key 'training'"),
    ("negative spares", ("name = \"text\"\nnodes = 1", "name = \"text\"\nnodes = 1\nspares = -2"),
     "stages.spares = -2 is not allowed"),
    ("recovery path", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\nrecovery = \"hot\""),
     "job.recovery = 'hot' is not allowed"),
    ("workdir missing", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\nworkdir = \"nowhere\""),
     "job.workdir = 'nowhere' is not allowed: "),
    ("workdir a file", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\nworkdir = \"job.toml\""),
     "job.toml is not a folder (expected a folder every node sees; relative to the job file's folder)"),
    ("workdir newline", ("time_limit = \"01:00:00\"", "time_limit = \"01:00:00\"\nworkdir = \"a\\nb\""),
     "a path without control characters"),
]


@pytest.mark.parametrize(("case", "edit", "message"), JOB_ERRORS, ids=[c[0] for c in JOB_ERRORS])
def test_job_error(tmp_path: Path, case: str, edit: tuple[str, str] | list[tuple[str, str]],
                   message: str) -> None:
    text = JOB
    for old, new in edit if isinstance(edit, list) else [edit]:
        assert old in text, case
        text = text.replace(old, new, 1)
    path = _write(tmp_path, "job.toml", text)
    with pytest.raises(ConfigError) as e:
        load_job(path)
    assert str(path) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize(("edit", "message"), [
    # (a stage the built-in trainer does not run: the job's own script)
    ([("name = \"text\"\nnodes = 1", "name = \"audio\"\nnodes = 1"),
      ("[training.data]", "[training]\ncommand = [\"{python}\", \"train.py\"]\n[training.data]")],
     "stage 'audio' is not in the site config"),
    ([("data_parallel_size = 2", "data_parallel_size = 16"),   # with a global batch that cuts for 16
      ("[training.data]", "[training.parallel]\nglobal_batch_size = 32\n[training.data]")],
     "has 16 tasks per node but gres 'gpu:h100:4' gives 4"),
    (("name = \"text\"\nnodes = 1", "name = \"text\"\nnodes = 1\nspares = 5"),
     "stage 'text' spares = 5 is not allowed \\(the site allows at most elasticity.max_spares = 4 per stage\\)"),
])
def test_job_against_site_error(tmp_path: Path, edit: tuple[str, str] | list[tuple[str, str]], message: str) -> None:
    site = load_site(_write(tmp_path, "omni.toml", SITE))
    text = JOB
    for old, new in edit if isinstance(edit, list) else [edit]:
        text = text.replace(old, new, 1)
    job = load_job(_write(tmp_path, "job.toml", text))
    with pytest.raises(ConfigError, match=message):
        plan_stages(job, site)


def test_job_below_site_minimum(tmp_path: Path) -> None:
    site = load_site(_write(tmp_path, "omni.toml", SITE.replace("min_data_parallel_size = 1",
                                                                "min_data_parallel_size = 4")))
    job = load_job(_write(tmp_path, "job.toml", JOB))
    with pytest.raises(ConfigError, match="site minimum is elasticity.min_data_parallel_size = 4"):
        plan_stages(job, site)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("01:00:00", 3600), ("2-0", 172800), ("1-02:03", 93780), ("1-02:03:04", 93784),
])
def test_slurm_time(text: str, seconds: int) -> None:
    assert parse_slurm_time(text) == seconds


@pytest.mark.parametrize("text", ["", "1h", "1:2:3:4", "-5", "1-", "a-1"])
def test_slurm_time_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="is not allowed"):
        parse_slurm_time(text)


@pytest.mark.parametrize(("text", "shown"), [("gpu:h100:4", "gpu:h100:4"), ("gpu:2", "gpu:2")])
def test_gres(text: str, shown: str) -> None:
    assert str(parse_gres(text)) == shown


def test_spares_default_from_the_site_and_in_allocation_falls_back_when_partitions_differ(tmp_path: Path) -> None:
    from slurm_omni.render import HetJobRequest

    site = load_site(_write(tmp_path, "omni.toml", SITE.replace(
        "min_data_parallel_size = 1", "min_data_parallel_size = 1\ndefault_spares = 2\nrecovery = \"in_allocation\"")))
    job = load_job(_write(tmp_path, "job.toml", JOB.replace("name = \"text\"\nnodes = 1",
                                                            "name = \"text\"\nnodes = 1\nspares = 0", 1)))
    assert [p.spares for p in plan_stages(job, site)] == [2, 0]
    request = HetJobRequest(job=job, site=site, job_file=tmp_path / "job.toml", job_sha256="0" * 64)
    shape, why = request.in_allocation()
    assert shape is None and "partitions ['text', 'vision']" in why      # vision and text partitions differ
    assert "#SBATCH hetjob" in request.materialize()


def test_a_per_user_registry_fills_in_the_user(tmp_path: Path) -> None:
    from slurm_omni.manager.daemon import default_state_dir
    path = tmp_path / "site.toml"
    path.write_text(SITE.replace("registry_dir = \"/var/lib/omni/registry\"", "registry_dir = \"/var/lib/omni/registry/{user}\""))
    site = load_site(path)
    assert site.manager.registry_for("alice") == Path("/var/lib/omni/registry/alice")
    assert default_state_dir(site, "alice") == Path("/var/lib/omni/registry/alice/manager")
    assert load_site(REPO / "site-config/omni.toml").manager.registry_for("bob") == \
        Path("/var/lib/slurm-omni/registry/bob")


def test_a_per_user_metrics_dir_fills_in_the_user(tmp_path: Path) -> None:
    from slurm_omni.drill.job import JobHandle
    from slurm_omni.render import HetJobRequest
    site = load_site(_write(tmp_path, "site.toml", SITE.replace(
        'metrics_dir = "/var/lib/node_exporter/textfile"', 'metrics_dir = "/var/lib/node_exporter/textfile/{user}"')))
    assert site.manager.metrics_for("alice") == Path("/var/lib/node_exporter/textfile/alice")
    job_file = _write(tmp_path, "job.toml", JOB)
    script = {user: HetJobRequest(job=load_job(job_file), site=site, job_file=job_file, job_sha256="0" * 64,
                                  user=user).materialize() for user in ("alice", "bob")}
    assert "OMNI_METRICS_DIR=/var/lib/node_exporter/textfile/alice/omni-tiny" in script["alice"]
    assert "OMNI_METRICS_DIR=/var/lib/node_exporter/textfile/bob/omni-tiny" in script["bob"]
    record = {"name": "omni-tiny", "job_id": 7, "ckpt_dir": "/shared/ckpt/bob/omni-tiny", "stages": [],
              "job_file": str(job_file), "user": "bob"}
    assert JobHandle.from_registration(record, site).metrics_dir == Path("/var/lib/node_exporter/textfile/bob/omni-tiny")
    assert load_site(REPO / "site-config/omni.toml").manager.metrics_for("bob") == \
        Path("/var/lib/node_exporter/textfile/bob")
    # without {user} every user's jobs share the one folder, as before
    assert load_site(_write(tmp_path, "plain.toml", SITE)).manager.metrics_for("bob") == \
        Path("/var/lib/node_exporter/textfile")



@pytest.mark.parametrize("renames", [
    [('name = "vision"', 'name = "encoder"')],                                                  # another name
    [('name = "vision"', 'name = "x"'), ('name = "text"', 'name = "vision"'), ('name = "x"', 'name = "text"')],
], ids=["other-name", "other-order"])
def test_the_built_in_trainer_runs_its_own_stages_only(tmp_path: Path, renames: list[tuple[str, str]]) -> None:
    """Without [training] command the built-in trainer runs: its two stages, named and ordered so
    (before: a job of other stages was submitted and its ranks exited 1 before any heartbeat)."""
    text = JOB
    for old, new in renames:
        text = text.replace(old, new, 1)
    with pytest.raises(ConfigError, match=r"are not allowed for the built-in trainer \(it runs \[\[stages\]\] "
                                          r"vision then text: name them so, or give \[training\] command"):
        load_job(_write(tmp_path, "job.toml", text))


@pytest.mark.parametrize(("lines", "job_line", "path"), [
    ("", "", "resubmit"),                                                    # no spares held, no allocation mode
    ("default_spares = 1", "", "in_allocation"),                             # spares held in allocations
    ("allow_allocation = true", "", "allocation"),                           # no batch host where allowed
    ("allow_allocation = true\ndefault_spares = 1", "", "allocation"),
    ("allow_allocation = true\nrecovery = \"resubmit\"", "", "resubmit"),     # the site's own default wins
    ("default_spares = 1", "recovery = \"resubmit\"", "resubmit"),          # the job file's wins
    ("", "recovery = \"allocation\"", "in_allocation"),                      # not allowed: its fallback
])
def test_a_job_file_that_names_no_path_gets_the_fastest_the_site_allows(tmp_path: Path, lines: str, job_line: str,
                                                                        path: str) -> None:
    from slurm_omni.render import HetJobRequest

    site = load_site(_write(tmp_path, "omni.toml", SITE.replace(
        "min_data_parallel_size = 1", f"min_data_parallel_size = 1\n{lines}")))
    job_text = JOB.replace("[job]\n", f"[job]\n{job_line}\n", 1)
    assert job_line in job_text
    job = load_job(_write(tmp_path, "job.toml", job_text))
    request = HetJobRequest(job=job, site=site, job_file=tmp_path / "job.toml", job_sha256="0" * 64)
    assert request.recovery == path
