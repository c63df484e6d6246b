"""End-to-end CLI runs on CPU with a tiny model on a small built-in corpus."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from streamnmt.cli import main
from streamnmt.training.runs import read_csv

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "2000", "--bleu-samples", "0",
        "--batch-size", "16", "--max-len", "32"]


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    # one built-in corpus + tokenizers for the whole session
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def train(tmp_path, *extra: str, name: str = "exp") -> int:
    return main(["train", *TINY, "--project", str(tmp_path / "runs"), "--name", name, *extra])


def test_train_writes_the_run_dir(tmp_path, capsys):
    assert train(tmp_path, "--max-steps", "20") == 0
    run = tmp_path / "runs" / "exp"
    for f in ("config.yaml", "weights/best.pt", "weights/last.pt", "weights/best.safetensors", "results.csv",
              "steps.csv", "sync_stats.json", "results.png"):
        assert (run / f).is_file(), f
    steps = read_csv(run / "steps.csv")
    assert [int(r["step"]) for r in steps] == list(range(1, 21))
    assert all(float(r["loss"]) > 0 and float(r["lr"]) > 0 and int(r["tokens"]) > 0 for r in steps)
    results = read_csv(run / "results.csv")
    assert len(results) == 1 and float(results[0]["val_loss"]) > 0
    # the plain NLL beside the smoothed loss (label smoothing 0.1 by default): per step and per epoch
    assert all(float(r["nll"]) > 0 and float(r["nll"]) != float(r["loss"]) for r in steps)
    res = results[0]
    assert float(res["train_nll"]) == pytest.approx(sum(float(r["nll"]) for r in steps) / len(steps))
    assert float(res["train_ppl"]) == pytest.approx(math.exp(float(res["train_nll"])))
    out = capsys.readouterr().out
    assert "train_nll" in out and f"{float(res['train_nll']):.4f}" in out
    assert "training pairs over --max-len 32 dropped (--overlong drop)" in out  # the default, counted
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["d_model"] == 64 and cfg["run"]["device"] == "cpu" and cfg["optim"]["amp"] == "off"
    # a second run takes the next free name
    assert train(tmp_path, "--max-steps", "2") == 0
    assert (tmp_path / "runs" / "exp2" / "steps.csv").is_file()


@pytest.mark.parametrize("flag,value", [("--batch-size", "0"), ("--dropout", "1.5"), ("--n-heads", "3"),
                                        ("--device", "quantum"), ("--sync-strategy", "nope")])
def test_invalid_flag_exits_2_naming_it(tmp_path, capsys, flag, value):
    assert train(tmp_path, flag, value) == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_requested_without_cuda(tmp_path, capsys):
    assert main(["train", "--device", "cuda", "--project", str(tmp_path / "r")]) == 2
    assert "--device" in capsys.readouterr().err


def test_bad_config_file(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("optim:\n  lr: [\n")
    assert train(tmp_path, "--config", str(bad)) == 2
    assert "c.yaml" in capsys.readouterr().err
    bad.write_text("engine:\n  sync_stratgy: full\n")
    assert train(tmp_path, "--config", str(bad)) == 2
    assert "sync_stratgy" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_strategies_log_identical_losses_and_weights(tmp_path):
    """All seed strategies (and graph, which falls back on CPU) compute the same training."""
    ref_steps = ref_weights = None
    for s in ("baseline", "event", "interval", "deep", "full", "graph"):
        assert train(tmp_path, "--max-steps", "25", "--seed", "3", "--sync-strategy", s, name=s) == 0
        run = tmp_path / "runs" / s
        steps = [(r["step"], r["loss"]) for r in read_csv(run / "steps.csv")]
        assert [int(st) for st, _ in steps] == list(range(1, 26))  # none missing or duplicated
        weights = torch.load(run / "weights" / "last.pt", weights_only=True)["model"]
        if ref_steps is None:
            ref_steps, ref_weights = steps, weights
            continue
        assert steps == ref_steps, s
        assert all(torch.equal(weights[k], ref_weights[k]) for k in weights), s
    other = tmp_path / "runs" / "other"
    assert train(tmp_path, "--max-steps", "25", "--seed", "4", name="other") == 0
    assert [(r["step"], r["loss"]) for r in read_csv(other / "steps.csv")] != ref_steps


def test_exist_ok_starts_fresh_logs(tmp_path):
    assert train(tmp_path, "--max-steps", "5") == 0
    assert train(tmp_path, "--max-steps", "3", "--exist-ok") == 0
    steps = read_csv(tmp_path / "runs" / "exp" / "steps.csv")
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    assert len(read_csv(tmp_path / "runs" / "exp" / "results.csv")) == 1


def test_tokenizer_sample_is_validated(tmp_path, capsys):
    assert train(tmp_path, "--tokenizer-sample", "5") == 2
    assert "--tokenizer-sample" in capsys.readouterr().err
