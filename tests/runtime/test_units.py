"""Fast checks of the runtime's pure parts: config, layout, data order, model, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_omni.config.training import (
    DataConfig,
    ModelConfig,
    ParallelConfig,
    SourceConfig,
    load_training_file,
)
from slurm_omni.elastic import codes as exitcodes
from slurm_omni.elastic.layout import Layout
from slurm_omni.errors import ConfigError, RuntimeLayoutError
from slurm_omni.runtime.data import DataError, DataPlan, ShardReader, open_sources
from slurm_omni.runtime.loop import DrillKnobs
from slurm_omni.runtime.model import (
    STAGE_NAMES,
    SampleMisalignedError,
    TextMicroBatch,
    build_stage,
    next_token_labels,
    parameter_count,
)
from slurm_omni.runtime.synth import SynthSpec, write_shards

JOB = """\
[training]
max_steps = 4
[training.model]
preset = "tiny"
{model_extra}
[training.data]
shard_dir = "shards"
[[training.data.sources]]
name = "pairs"
weight = 3
[[training.data.sources]]
name = "text"
weight = 1
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data") / "shards"
    write_shards(SynthSpec(out_dir=d, pairs=40, text=24, shard_size=16))
    return d


def test_training_file_loads_presets_and_overrides(tmp_path: Path) -> None:
    p = tmp_path / "job.toml"
    p.write_text(JOB.format(model_extra="text_depth = 3"))
    cfg = load_training_file(p)
    assert cfg.model.text_depth == 3 and cfg.model.vision_width == 32
    assert cfg.data.shard_dir == tmp_path / "shards"
    assert [s.weight for s in cfg.data.sources] == [3.0, 1.0]


@pytest.mark.parametrize("extra, needle", [
    ("patch_size = 5", "not a multiple of patch_size"),
    ("text_heads = 3", "does not divide"),
    ("preset = \"huge\"", "training.model.preset"),
    ("depth = 2", "unknown key 'training.model.depth'"),
])
def test_training_file_rejects_bad_model(tmp_path: Path, extra: str, needle: str) -> None:
    p = tmp_path / "job.toml"
    p.write_text(JOB.format(model_extra=extra).replace('preset = "tiny"\n', "") if "preset" in extra
                 else JOB.format(model_extra=extra))
    with pytest.raises(ConfigError, match=needle):
        load_training_file(p)


def test_micro_batches_keep_the_global_batch() -> None:
    p = ParallelConfig(global_batch_size=8, micro_batch_size=2)
    assert [p.micro_batches_for(dp) for dp in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(ConfigError, match="couldn't cut"):
        p.micro_batches_for(3)


def test_tiny_model_is_under_5m_parameters() -> None:
    assert parameter_count(ModelConfig(preset="tiny")) < 5_000_000


def test_builtin_layout_from_env_is_stage_major() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1", "OMNI_DP_SIZE": "2",
           "OMNI_CKPT_DIR": "/c", "OMNI_HEARTBEAT_DIR": "/h", "OMNI_METRICS_DIR": "/m", "OMNI_STAGES": "vision,text"}
    lay = Layout.from_env(STAGE_NAMES, env)
    assert (lay.stage, lay.stage_name, lay.data_parallel_rank, lay.data_parallel_size) == (1, "text", 1, 2)
    with pytest.raises(RuntimeLayoutError, match="must be rank"):
        Layout.from_env(STAGE_NAMES, {**env, "OMNI_STAGE": "0"})
    with pytest.raises(RuntimeLayoutError, match="couldn't match stages: the job file names enc,dec"):
        Layout.from_env(STAGE_NAMES, {**env, "OMNI_STAGES": "enc,dec"})


def test_drill_knobs_from_env() -> None:
    assert DrillKnobs.from_env({}) == DrillKnobs()
    knobs = DrillKnobs.from_env({"OMNI_DATA_DELAY_S": "0.1@100", "OMNI_FAULT_MISALIGN_AT_STEP": "3"})
    assert knobs == DrillKnobs(misalign_at_step=3, data_delay_s=0.1, data_delay_from_step=100)
    for bad in ({"OMNI_DATA_DELAY_S": "-1"}, {"OMNI_DATA_DELAY_S": "x@2"}, {"OMNI_FAULT_MISALIGN_AT_STEP": "3.5"}):
        with pytest.raises(RuntimeLayoutError, match="couldn't read OMNI_"):
            DrillKnobs.from_env(bad)


def _plan(shards: Path) -> DataPlan:
    cfg = DataConfig(shard_dir=shards, sources=[SourceConfig(name="pairs", weight=3), SourceConfig(name="text")])
    return DataPlan(cfg, open_sources(cfg))


def test_data_order_is_deterministic_and_resumable(shards: Path) -> None:
    a = _plan(shards)
    straight = [a.next_global_batch(s, 8) for s in range(10)]
    b = _plan(shards)
    first = [b.next_global_batch(s, 8) for s in range(4)]
    c = _plan(shards)
    c.load_state(b.state())
    assert first + [c.next_global_batch(s, 8) for s in range(4, 10)] == straight


def test_each_source_is_a_sequence_of_epochs(shards: Path) -> None:
    plan = _plan(shards)
    refs = [r for s in range(20) for r in plan.next_global_batch(s, 8)]
    for src, size in ((0, 40), (1, 24)):
        rows = [r.row for r in refs if r.source == src]
        for e in range(len(rows) // size):
            assert sorted(rows[e * size:(e + 1) * size]) == list(range(size))


def test_changed_data_is_refused(shards: Path) -> None:
    plan = _plan(shards)
    state = plan.state()
    state["pairs"]["size"] = 41
    with pytest.raises(DataError, match="data changed"):
        plan.load_state(state)


def test_text_stage_refuses_misaligned_image_tokens(shards: Path) -> None:
    cfg = ModelConfig(preset="tiny")
    plan = _plan(shards)
    reader = ShardReader(cfg, plan.sources)
    refs = plan.next_global_batch(0, 2)
    vision, text = build_stage(cfg, 0, seed=0), build_stage(cfg, 1, seed=0)
    ids = reader.sample_ids(refs)
    image_tokens, sent_ids = vision(reader.images(refs), ids)
    tokens, has_image = reader.tokens(refs)
    text.feed.append(TextMicroBatch(ids, tokens, has_image))
    logits = text(image_tokens, sent_ids)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    text.feed.append(TextMicroBatch(ids.flip(0), tokens, has_image))
    with pytest.raises(SampleMisalignedError, match="couldn't pair"):
        text(image_tokens, sent_ids)


def test_labels_skip_padding() -> None:
    labels = next_token_labels(torch.tensor([[5, 6, 7, 0]]))
    assert labels.tolist() == [[6, 7, -100, -100]]


def test_exit_codes_are_distinct() -> None:
    codes = {exitcodes.EXIT_DONE, exitcodes.EXIT_CHECKPOINTED, exitcodes.EXIT_FAILED, exitcodes.EXIT_MISALIGNED}
    assert len(codes) == 4
    assert exitcodes.outcome(75) is exitcodes.Outcome.CHECKPOINTED
    assert exitcodes.outcome(-9) is exitcodes.Outcome.FAILED
    assert SampleMisalignedError.exit_code == exitcodes.EXIT_MISALIGNED


def test_data_synth_command_writes_readable_shards(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from slurm_omni.cli.data import data
    from slurm_omni.runtime.data import scan_shards

    result = CliRunner().invoke(data, ["synth", "--out", str(tmp_path), "--pairs", "10", "--text", "5",
                                       "--shard-size", "4"])
    assert result.exit_code == 0, result.output
    shards = scan_shards(tmp_path)
    assert [(s.source, s.kind, s.rows) for s in shards] == [("pairs", "pairs", 4), ("pairs", "pairs", 4),
                                                            ("pairs", "pairs", 2), ("text", "text", 4),
                                                            ("text", "text", 1)]
