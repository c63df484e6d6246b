from __future__ import annotations

import pytest
import yaml

from streamnmt.config import PRESETS, ModelConfig, build_job, job_from_dict, load_yaml
from streamnmt.errors import ConfigError


def test_yaml_round_trip(tmp_path):
    job = build_job({"batch_size": "16", "d_model": "64", "sync_strategy": "deep", "amp": "off", "dropout": "0.2"})
    path = tmp_path / "c.yaml"
    path.write_text(job.to_yaml())
    again = job_from_dict(load_yaml(path))
    assert again == job
    assert again.data.batch_size == 16 and again.model.d_model == 64 and again.engine.sync_strategy == "deep"


def test_flags_override_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"batch_size": 8}, "lr": 2.0}))
    job = build_job({"batch_size": "4"}, str(path))
    assert job.data.batch_size == 4 and job.optim.lr == 2.0


def test_the_seeds_tokenizer_names_are_read_as_the_source_and_target_ones(tmp_path):
    """--tokenizer-eng/--tokenizer-chn and their config keys (config.yaml files, checkpoints written
    before the rename) are the same settings as --tokenizer-src/--tokenizer-tgt."""
    from streamnmt.cli import build_parser, parse

    args = parse(build_parser(), ["train", "--tokenizer-eng", "a.model", "--tokenizer-chn", "b.model"])
    assert args["tokenizer_src"] == "a.model" and args["tokenizer_tgt"] == "b.model"
    old = job_from_dict({"data": {"tokenizer_eng": "a.model", "tokenizer_chn": "b.model"}})
    assert (old.data.tokenizer_src, old.data.tokenizer_tgt) == ("a.model", "b.model")
    assert "tokenizer_eng" not in old.to_dict()["data"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"tokenizer_eng": "a.model"}, "tokenizer_chn": "b.model"}))
    job = build_job({"tokenizer_src": "c.model"}, str(path))  # a flag overrides the file's older key
    assert (job.data.tokenizer_src, job.data.tokenizer_tgt) == ("c.model", "b.model")
    assert build_job({"tokenizer_chn": "d.model"}, str(path)).data.tokenizer_tgt == "d.model"
    same = job_from_dict({"data": {"tokenizer_eng": None, "tokenizer_chn": "b.model", "tokenizer_tgt": "b.model",
                                   "tokenizer_src": "a.model"}})  # None: an older key not given
    assert (same.data.tokenizer_src, same.data.tokenizer_tgt) == ("a.model", "b.model")
    with pytest.raises(ConfigError, match="'tokenizer_eng' is the older name of 'tokenizer_src'"):
        job_from_dict({"data": {"tokenizer_eng": "a.model", "tokenizer_src": "c.model"}})


@pytest.mark.parametrize("flags,named", [
    ({"batch_size": "0"}, "--batch-size"),
    ({"batch_size": "-3"}, "--batch-size"),
    ({"batch_size": "many"}, "--batch-size"),
    ({"d_model": "64", "n_heads": "5"}, "--n-heads"),
    ({"dropout": "1.0"}, "--dropout"),
    ({"dropout": "-0.1"}, "--dropout"),
    ({"device": "tpu"}, "--device"),
    ({"sync_strategy": "magic"}, "--sync-strategy"),
    ({"name": "../../x"}, "--name"),
    ({"name": ".."}, "--name"),
    ({"name": ""}, "--name"),
    ({"seed": "-1"}, "--seed"),
    ({"seed": str(2**32)}, "--seed"),
    ({"lr": "inf"}, "--lr"),
    ({"tgt_lang": "en"}, "--tgt-lang .*must differ from --src-lang"),  # one key: each sentence with itself
    ({"src_lang": "zh"}, "--tgt-lang .*must differ from --src-lang"),  # zh and ch name one language's keys
])
def test_invalid_values_name_the_flag(flags, named):
    with pytest.raises(ConfigError, match=named):
        build_job(flags)


def test_bad_yaml_and_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        build_job({}, str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("data:\n  batch_sise: 3\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        build_job({}, str(unknown))


@pytest.mark.parametrize("text, message", [
    ("max_steps: 3\noptim:\n  lr: 2\nmax_steps: 5\n", r"dup.yaml:4:1: .*'max_steps' given twice, first on line 1"),
    ("run:\n  max_steps: 4\n  max_steps: 4\n", r"dup.yaml:3:3: .*'max_steps' given twice, first on line 2"),
    ("run:\n  max_steps: 4\nrun:\n  seed: 1\n", r"'run' given twice"),
    ("max_steps: 3\nrun:\n  max_steps: 4\n", r"'max_steps' is given flat and in section 'run'"),
    ("run:\n  max_steps: 4\nmax_steps: 3\n", r"'max_steps' is given flat and in section 'run'"),
])
def test_a_key_given_twice_is_refused(tmp_path, text, message):
    # PyYAML keeps the last of a repeated key: the run would silently train with one of the two values
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_job({}, str(path))


def test_keys_take_the_flags_spelling_and_unknown_ones_get_a_hint(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max-steps: 3\ndata:\n  batch-size: 8\n")  # as the flags are written
    job = build_job({}, str(path))
    assert (job.run.max_steps, job.data.batch_size) == (3, 8)
    for text, message in [("run:\n  batchsize: 2\n", r"'run.batchsize'; did you mean 'batch_size' \(section data\)"),
                          ("model:\n  warmup: 3\n", r"'model.warmup'; 'warmup' belongs in section 'optim'"),
                          ("max-steps: 3\nmax_steps: 4\n", r"'max-steps' and 'max_steps' are one key given twice"),
                          ("1: 5\n", r"unknown config key '1'"), ("yes: 1\n", r"unknown config key 'True'")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            build_job({}, str(path))


def test_yaml_merge_keys_still_load(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("run:\n  <<: {max_steps: 5, epochs: 9}\n  epochs: 2\n")  # the explicit key wins
    job = build_job({}, str(path))
    assert (job.run.max_steps, job.run.epochs) == (5, 2)


def test_one_key_in_each_section_and_flat_keys_of_other_sections_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("max_steps: 3\noptim:\n  lr: 2\nmodel: tiny\n")
    job = build_job({}, str(path))
    assert (job.run.max_steps, job.optim.lr, job.model.model) == (3, 2.0, "tiny")


@pytest.mark.parametrize("key", ["attention_dropout", "activation_dropout"])
def test_attention_and_activation_dropout_default_off_and_are_checked(key):
    assert getattr(build_job({}).model, key) == 0.0
    assert getattr(build_job({key: "0.1"}).model, key) == 0.1
    with pytest.raises(ConfigError, match="--" + key.replace("_", "-")):
        build_job({key: "1.0"})


# -- the big preset ------------------------------------------------------------------------------

def test_big_preset_sizes_and_dropout():
    big = ModelConfig().resolve("big")
    assert (big.d_model, big.n_layers, big.n_heads, big.d_ff, big.dropout) == (1024, 6, 16, 4096, 0.3)
    assert ModelConfig().resolve("base").dropout == 0.1 and ModelConfig().resolve("tiny").dropout == 0.1
    # an explicit --dropout wins over the preset's, 0.1 included
    assert build_job({"model": "big", "dropout": "0.1"}).model.resolve("big").dropout == 0.1
    assert build_job({"model": "big", "dropout": "0"}).model.resolve("big").dropout == 0.0


def test_iwslt_preset_is_fairseqs_iwslt_model_between_small_and_base():
    m = ModelConfig().resolve("iwslt")
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.dropout) == (512, 6, 4, 1024, 0.3)
    assert build_job({"model": "iwslt", "dropout": "0.1"}).model.resolve("iwslt").dropout == 0.1
    assert build_job({"model": "iwslt", "n_heads": "8"}).model.resolve("iwslt").n_heads == 8

    def weights(preset):  # parameters besides the embeddings and the output layer
        d, n, _, f = PRESETS[preset]
        return n * (4 * d * d + 2 * d * f) + n * (8 * d * d + 2 * d * f)
    assert weights("small") < weights("iwslt") < weights("base")


def test_model_big_resolves_to_a_job(tmp_path):
    import torch

    from streamnmt.training.recipe import resolve_job
    job = resolve_job(build_job({"model": "big", "device": "cpu"}), torch.device("cpu"), 1, lambda _: None)
    m = job.model
    assert (m.model, m.d_model, m.n_layers, m.n_heads, m.d_ff, m.dropout) == ("big", 1024, 6, 16, 4096, 0.3)
    assert job.optim.warmup == 4000 and job.data.builtin_size == 40000  # sentence batches: base's recipe
    path = tmp_path / "config.yaml"  # what config.yaml records loads back as the same job
    path.write_text(job.to_yaml())
    assert job_from_dict(load_yaml(path)) == job


def test_config_yaml_from_before_the_big_preset_loads(tmp_path):
    """A run's config.yaml written before the preset-dependent dropout (its model section as it
    was) loads with the dropout it recorded; a resume of it resolves nothing again."""
    path = tmp_path / "config.yaml"
    path.write_text("model:\n  model: base\n  d_model: 512\n  n_layers: 6\n  n_heads: 8\n  d_ff: 2048\n"
                    "  dropout: 0.1\n  attention_dropout: 0.0\n  activation_dropout: 0.0\n  label_smoothing: 0.1\n"
                    "  tie_embeddings: none\n  attention: auto\noptim:\n  lr: 1.0\n  warmup: 600\n  amp: bf16\n")
    job = build_job({}, str(path))
    assert job.model.dropout == 0.1 and job.model.d_model == 512 and job.optim.warmup == 600
    assert build_job({"dropout": "0.2"}, str(path)).model.dropout == 0.2
    assert build_job({}).model.dropout is None  # unset until a preset resolves it


def test_bench_accepts_model_big():
    import torch

    from streamnmt.bench.config import BenchConfig
    from streamnmt.bench.flops import forward_flops
    from streamnmt.cli import build_parser
    from streamnmt.models.transformer import ModelShape

    args = vars(build_parser().parse_args(["bench", "--model", "big"]))
    assert args["model"] == "big"
    cfg = BenchConfig(model="big").resolve(torch.device("cpu"))
    assert cfg.model == "big" and cfg.dropout == 0.3
    assert BenchConfig(model="big", dropout=0.1).resolve(torch.device("cpu")).dropout == 0.1
    assert BenchConfig().resolve(torch.device("cpu")).dropout == 0.1
    # MFU counts FLOPs from the shape: the big model's matrix products are ~4x base's per token
    # (twice the width squared), less the output layer's 2x
    base = ModelShape(32000, 32000, 512, 6, 8, 2048, 0.1)
    big = ModelShape(32000, 32000, 1024, 6, 16, 4096, 0.3)
    ratio = forward_flops(big, 64, 128, 128) / forward_flops(base, 64, 128, 128)
    assert 3.0 < ratio < 4.0


def test_time_limit_none_is_no_limit_and_plain_numbers_are_seconds():
    assert build_job({"time_limit": "none"}).run.time_limit_s() is None
    assert build_job({"time_limit": "90"}).run.time_limit_s() == 90.0


def test_a_config_file_may_name_the_preset_flat_but_not_resume(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: tiny\nlr: 3\n")
    job = build_job({}, str(flat))
    assert job.model.model == "tiny" and job.optim.lr == 3
    resume = tmp_path / "resume.yaml"
    resume.write_text("run:\n  resume: runs/train/exp/weights/last.pt\n")
    with pytest.raises(ConfigError, match=r"resume.yaml: run.resume continues a run: give it as --resume"):
        build_job({}, str(resume))
    own = tmp_path / "own.yaml"  # a run's own config.yaml says resume: null
    own.write_text(build_job({}).to_yaml())
    assert build_job({}, str(own)).run.resume is None


def test_a_bad_value_from_a_config_file_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  max_steps: 3.7\n")
    with pytest.raises(ConfigError, match=r"^--config: .*c\.yaml: --max-steps \(config key 'max_steps'\)"):
        build_job({}, str(path))
    with pytest.raises(ConfigError, match=r"^--max-steps"):  # the flag's own bad value: the flag only
        build_job({"max_steps": "-2"}, str(path))
