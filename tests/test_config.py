from __future__ import annotations

import pytest
import yaml

from streamnmt.config import build_job, job_from_dict, load_yaml
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


@pytest.mark.parametrize("flags,named", [
    ({"batch_size": "0"}, "--batch-size"),
    ({"batch_size": "-3"}, "--batch-size"),
    ({"batch_size": "many"}, "--batch-size"),
    ({"d_model": "64", "n_heads": "5"}, "--n-heads"),
    ({"dropout": "1.0"}, "--dropout"),
    ({"dropout": "-0.1"}, "--dropout"),
    ({"device": "tpu"}, "--device"),
    ({"sync_strategy": "magic"}, "--sync-strategy"),
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


@pytest.mark.parametrize("key", ["attention_dropout", "activation_dropout"])
def test_attention_and_activation_dropout_default_off_and_are_checked(key):
    assert getattr(build_job({}).model, key) == 0.0
    assert getattr(build_job({key: "0.1"}).model, key) == 0.1
    with pytest.raises(ConfigError, match="--" + key.replace("_", "-")):
        build_job({key: "1.0"})
