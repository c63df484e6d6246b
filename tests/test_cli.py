"""End-to-end CLI runs on CPU with a tiny model on a small built-in corpus."""

from __future__ import annotations

import math
import os

import pytest
import torch
import yaml

from streamnmt.cli import main
from streamnmt.training.runs import read_csv

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest.single_thread)

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "2000", "--bleu-samples", "0",
        "--batch-size", "16", "--max-len", "32"]


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    # one built-in corpus + tokenizers for the whole session
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def train(tmp_path, *extra: str, name: str = "exp") -> int:
    return main(["train", *TINY, "--project", str(tmp_path / "runs"), "--name", name, *extra])


@pytest.mark.plots
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
    done = [line for line in out.splitlines() if line.startswith("done: 20 steps")]
    # TINY computes no BLEU: val_loss chose best.pt, at the one evaluation (the end)
    assert len(done) == 1 and f"best val_loss {float(res['val_loss']):.4f} at step 20;" in done[0]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["model"]["d_model"] == 64 and cfg["run"]["device"] == "cpu" and cfg["optim"]["amp"] == "off"
    # a second run takes the next free name
    assert train(tmp_path, "--max-steps", "2") == 0
    assert (tmp_path / "runs" / "exp2" / "steps.csv").is_file()


def test_a_run_patience_stops_says_where_its_results_are(tmp_path, capsys):
    # a stop by --patience (or --time-limit) is a run's normal end: its done and best lines, and its
    # epoch's row (the first epoch, cut: none was written)
    assert train(tmp_path, "--lr", "1e-12", "--eval-every", "2", "--patience", "1", "--max-steps", "40",
                 "--best-metric", "val_loss", name="pat") == 0
    out = capsys.readouterr().out
    rows = read_csv(tmp_path / "runs" / "pat" / "results.csv")
    assert len(rows) == 1 and int(rows[0]["steps"]) < 40
    assert [line for line in out.splitlines() if line.startswith("done: ")]
    assert [line for line in out.splitlines() if line.startswith("best: val_loss")]


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
    assert train(tmp_path, "--max-steps", "5", "--ema", "0.9") == 0
    weights = tmp_path / "runs" / "exp" / "weights"
    assert (weights / "ema.pt").exists()
    assert train(tmp_path, "--max-steps", "3", "--exist-ok", "--ema", "0") == 0
    steps = read_csv(tmp_path / "runs" / "exp" / "steps.csv")
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    assert len(read_csv(tmp_path / "runs" / "exp" / "results.csv")) == 1
    assert not (weights / "ema.pt").exists()  # the earlier run's averaged weights are not this run's


def test_tokenizer_sample_is_validated(tmp_path, capsys):
    assert train(tmp_path, "--tokenizer-sample", "5") == 2
    assert "--tokenizer-sample" in capsys.readouterr().err


# -- flags: no abbreviations, --nproc's children, a broken subcommand, help -----------------------

def _train_parser():
    from streamnmt.cli import build_parser, command_parsers

    return command_parsers(build_parser())["train"]


@pytest.mark.parametrize("argv, full", [(["train", "--np", "2"], "--nproc"),
                                        (["train", "--max-tok", "10"], "--max-tokens"),
                                        (["train", "--epoch=3"], "--epochs")])
def test_abbreviated_flag_exits_2_naming_the_full_flag(argv, full, monkeypatch, capsys):
    from streamnmt import cli

    monkeypatch.setattr(cli, "_train", lambda args, **kw: 0)  # were the flag taken, nothing would run
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert argv[1].split("=")[0] in err[0] and full in err[0]


def test_nproc_resume_checks_the_checkpoints_device(tmp_path, monkeypatch):
    """`train --nproc 2 --resume` of a CPU run on a host with one GPU: the ranks run on the
    checkpoint's device (the CPU, gloo), so the one-GPU-per-process check does not apply."""
    import torch

    from streamnmt import dist

    assert train(tmp_path, "--max-steps", "2", "--device", "cpu") == 0
    children: list[list[str]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "run_torchrun", lambda n, argv: children.append(argv) or 0)
    last = str(tmp_path / "runs" / "exp" / "weights" / "last.pt")
    assert main(["train", "--resume", last, "--nproc", "2"]) == 0 and len(children) == 1
    assert main(["train", "--resume", last, "--nproc", "2", "--device", "cuda"]) == 2  # 2 ranks, 1 GPU


@pytest.mark.parametrize("flags", [["--nproc=2", "--epochs", "1"], ["--nproc", "2", "--epochs", "1"],
                                   ["--epochs", "1", "--nproc", "3", "--no-pack", "--compile", "--nproc", "2"],
                                   ["--config", "CFG", "--nproc", "2", "--project=-p", "--name=--nproc", "--seed=3"],
                                   ["--npr", "2", "--epochs", "1"]])
def test_nproc_children_get_every_flag_but_nproc(flags, tmp_path, monkeypatch, capsys):
    """The ranks that ``train --nproc N`` starts get the flags argparse parsed, less --nproc: none
    of its forms (nor an abbreviation of it, which is refused) reaches them, every other flag does."""
    from streamnmt import dist

    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  lr: 0.001\n")
    flags = [str(cfg) if f == "CFG" else f for f in flags]
    children: list[list[str]] = []
    started: list[str | None] = []
    monkeypatch.delenv("STREAMNMT_COMMAND_START", raising=False)
    monkeypatch.setattr(dist, "run_torchrun", lambda n, argv: children.append([str(n), *argv])
                        or started.append(os.environ.get("STREAMNMT_COMMAND_START")) or 0)
    argv = ["train", "--device", "cpu", *flags]
    try:
        assert main(argv) == 0
    except SystemExit as e:  # an abbreviation: refused before anything starts
        assert e.code == 2 and "--npr" in capsys.readouterr().err and not children
        assert "--npr" in flags
        return
    (child,) = children
    assert child[:4] == ["2", "-m", "streamnmt", "train"]
    # the ranks learn the command's start; this process's later commands do not inherit it
    assert started[0] is not None and "STREAMNMT_COMMAND_START" not in os.environ
    parser = _train_parser()
    expected = vars(parser.parse_args(argv[1:]))
    del expected["nproc"]
    assert vars(parser.parse_args(child[4:])) == expected
    assert not any(a.startswith("--np") for a in child[4:])


def _broken_bench(kind: str, monkeypatch) -> None:
    """Make ``import streamnmt.bench`` fail: not importable at all, or a bug raising inside it."""
    import sys
    import types

    if kind == "import":
        monkeypatch.setitem(sys.modules, "streamnmt.bench", None)  # import raises ModuleNotFoundError
        return
    module = types.ModuleType("streamnmt.bench")

    def raising(name: str):
        raise RuntimeError(f"a bug in bench while looking up {name}")

    module.__getattr__ = raising
    monkeypatch.setitem(sys.modules, "streamnmt.bench", module)


@pytest.mark.parametrize("kind, error", [("import", "ModuleNotFoundError"), ("bug", "RuntimeError: a bug in bench")])
def test_a_subcommand_that_fails_to_import_shows_why(kind, error, monkeypatch, capsys):
    _broken_bench(kind, monkeypatch)
    for argv in (["bench"], ["bench", "--steps", "3", "--out", "x"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and error in err and "streamnmt.bench" in err
        assert "invalid choice" not in err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # the other commands are untouched
        main(["average", "--help"])
    assert e.value.code == 0 and "--out" in capsys.readouterr().out


def test_help_shows_the_dist_timeout_default_in_seconds():
    text = " ".join(_train_parser().format_help().split())
    start = text.rindex("--dist-timeout")  # its entry, after the usage line
    entry = text[start:text.index(" --", start + 2)]
    assert "(default: 600)" in entry and "PyTorch's default" not in entry


def test_a_percent_sign_in_a_flag_help_is_printed_as_is():
    import argparse
    from dataclasses import dataclass

    from streamnmt.configbase import add_args, opt

    @dataclass(kw_only=True)
    class Cfg:
        share: int = opt(10, "checks under ~10 % of the run")

    parser = argparse.ArgumentParser()
    add_args(parser, Cfg)
    assert "under ~10 % of the run (default: 10)" in " ".join(parser.format_help().split())


def test_a_set_up_error_under_torchrun_is_not_taken_for_a_lost_peer(tmp_path, monkeypatch, capsys):
    """Under torchrun a ConfigError that mentions nccl is the one line of a bad flag (exit 2), not
    "a collective failed, another rank died"."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert train(tmp_path, "--dist-backend", "nccl") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dist-backend" in err[0] and "collective failed" not in err[0]


@pytest.mark.parametrize("argv", [["train", "--batch-size", "-3"], ["train", "--bogus-flag", "1"]])
def test_a_rank_other_than_0_leaves_a_set_up_error_to_rank_0(argv, monkeypatch, capsys):
    # under torchrun every rank meets the same bad flag: one line (rank 0's), and the others wait
    # before exiting, since torchrun SIGTERMs the rest when the first exits (rank 0 died unheard)
    import streamnmt.cli as cli_module
    slept: list[float] = []
    monkeypatch.setattr(cli_module.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:  # argparse's exit, or main's return code below
        raise SystemExit(main(argv))
    assert exit_.value.code == 2 and slept == [cli_module.SILENT_RANK_WAIT_S]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        raise SystemExit(main(argv))
    assert "error" in capsys.readouterr().err and len(slept) == 1
    # a RANK left in a plain command's environment (no torchrun, no world), or not a number: rank 0
    monkeypatch.delenv("WORLD_SIZE")
    for rank in ("1", "abc", ""):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit):
            raise SystemExit(main(argv))
        assert "error" in capsys.readouterr().err and len(slept) == 1
