"""The training recipe (CPU, tiny model, fp32): EMA, early stopping, time limit and exact resume,
--eval-every, --keep-last, best.pt by --best-metric, tied embeddings in a run, --tensorboard,
quieter output, the flag checks and help text."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from streamnmt.cli import build_parser, main
from streamnmt.config import EPOCHS_UNLIMITED, PLATEAU_PATIENCE, ModelConfig, RunConfig, build_job, parse_duration
from streamnmt.errors import ConfigError
from streamnmt.models.transformer import make_model
from streamnmt.training.runs import read_csv
from streamnmt.training.step import example_batch, make_step
from streamnmt.training.stopping import EarlyStopping
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "200", "--bleu-samples", "0", "--batch-size", "16",
        "--max-len", "32", "--dropout", "0", "--sync-strategy", "event", "--loss-interval", "1"]


@pytest.fixture(autouse=True)
def home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "home"
    monkeypatch.setenv("STREAMNMT_HOME", str(home))
    return home


def make_trainer(tmp_path: Path, *flags: str, lines: list[str] | None = None) -> Trainer:
    args = vars(build_parser().parse_args(["train", *TINY, "--project", str(tmp_path), *flags]))
    for key in ("_run", "command"):
        args.pop(key)
    return Trainer(build_job(args), log=(lines if lines is not None else []).append)


def step_losses(run: Path) -> list[tuple[str, str]]:
    return [(r["step"], r["loss"]) for r in read_csv(run / "steps.csv")]


# -- EMA -----------------------------------------------------------------------------------------

def test_ema_follows_the_recurrence_inside_the_step():
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10, ema=0.9)
    assert all(any(s is t for t in step.state_tensors()) for s in step.ema.shadow)  # graph warm-up restores it
    ref = [p.detach().clone() for p in step.params]
    for n in range(1, 9):
        loss = step.forward(example_batch((4, 8, 8), model.shape, n))
        step.backward(loss)
        step.optimizer_step()
        d = min(0.9, (1 + n) / (10 + n))
        ref = [d * r + (1 - d) * p.detach() for r, p in zip(ref, step.params)]
    for r, s in zip(ref, step.ema.shadow):
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6)
    assert not torch.equal(step.ema.shadow[0], step.params[0])  # an average, not the last weights
    # swapped(): the averaged weights inside, the trained ones restored after
    trained = [p.detach().clone() for p in step.params]
    with step.ema.swapped():
        assert all(torch.equal(p, s) for p, s in zip(step.params, step.ema.shadow))
    assert all(torch.equal(p, t) for p, t in zip(step.params, trained))


@pytest.mark.parametrize("every", [2, 4])
def test_ema_every_n_steps_compounds_the_decay(every):
    """--ema-every N: the average moves after the first update, then after every N-th only (steps 1,
    1 + N, ...), by the decay of N steps."""
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10, ema=0.9, ema_every=every)
    ref = [p.detach().clone() for p in step.params]
    for n in range(1, 10):
        assert step.ema_due() == ((n - 1) % every == 0)
        loss = step.forward(example_batch((4, 8, 8), model.shape, n))
        step.backward(loss)
        before = [s.clone() for s in step.ema.shadow]
        step.optimizer_step()
        if (n - 1) % every:
            assert all(torch.equal(a, b) for a, b in zip(before, step.ema.shadow))  # not due: untouched
            continue
        d = min(0.9, (1 + n) / (10 + n)) ** every
        ref = [d * r + (1 - d) * p.detach() for r, p in zip(ref, step.params)]
    assert step.updates == 9
    for r, s in zip(ref, step.ema.shadow):
        torch.testing.assert_close(s, r, rtol=1e-5, atol=1e-6)
    assert not torch.equal(step.ema.shadow[0], step.params[0])
    step.count_updates(every)  # a resume after N updates: the next is due, the one after it not
    assert step.ema_due() and step.count_updates() == every + 1 and not step.ema_due()


def test_eval_ema_writes_the_average_to_best_and_resume_restores_it(tmp_path):
    t = make_trainer(tmp_path, "--name", "ema", "--epochs", "1", "--ema", "0.99", "--eval-ema")
    t.train()
    best = torch.load(tmp_path / "ema" / "weights" / "best.pt", weights_only=True)
    last = torch.load(tmp_path / "ema" / "weights" / "last.pt", weights_only=True)
    names = [n for n, _ in t.model.named_parameters()]
    for name, shadow in zip(names, last["ema"]["shadow"]):
        assert torch.equal(best["model"][name], shadow)  # best.pt holds the EMA weights
    assert not torch.equal(last["model"][names[0]], last["ema"]["shadow"][0])  # last.pt the trained ones
    resumed = Trainer.from_checkpoint(str(tmp_path / "ema" / "weights" / "last.pt"), log=lambda _: None)
    assert all(torch.equal(a, b) for a, b in zip(resumed.train_step.ema.shadow, last["ema"]["shadow"]))
    assert resumed.train_step.updates == last["step"] > 0  # --ema-every counts on from the saved step
    assert resumed.train_step.ema.every == 4  # the default, recorded in config.yaml and the checkpoint
    # a checkpoint from before --ema-every: its average was updated at every step, and stays so
    old = tmp_path / "old" / "weights" / "last.pt"  # in a run directory, as --resume wants it
    old.parent.mkdir(parents=True)
    (tmp_path / "old" / "config.yaml").write_bytes((tmp_path / "ema" / "config.yaml").read_bytes())
    del last["config"]["run"]["ema_every"]
    torch.save(last, old)
    assert Trainer.from_checkpoint(str(old), log=lambda _: None).train_step.ema.every == 1


# -- early stopping, best metric, eval-every -------------------------------------------------------

def test_early_stopping_unit():
    es = EarlyStopping("bleu", patience=2)
    assert es.update(10.0, 1) and not es.update(10.0, 2) and not es.should_stop
    assert not es.update(9.0, 3) and es.should_stop and "not improved for 2" in es.reason()
    assert es.best == 10.0 and es.best_step == 1
    loss = EarlyStopping("val_loss", patience=1)
    assert loss.update(5.0, 1) and loss.update(4.0, 2) and not loss.update(math.nan, 3) and loss.should_stop
    again = EarlyStopping("val_loss", patience=1)
    again.load_state_dict(loss.state_dict())
    assert again.best == 4.0 and again.should_stop


def test_where_best_says_whether_the_run_was_still_improving_or_went_past_its_best():
    es = EarlyStopping("bleu")
    assert es.update(10.0, 100) and es.where_best(100) is None  # one evaluation says nothing of a trend
    assert es.update(12.0, 200)
    line = es.where_best(200)
    assert line.startswith("best: dev BLEU 12.0000 at step 200 of 200, the last of 2 evaluations: still improving")
    assert not es.update(11.0, 300) and not es.update(12.0, 400)  # equal is not better
    line = es.where_best(400)
    assert "at step 200 of 400, then 2 of 4 evaluations without a better one (the last 50% of the steps;" in line
    again = EarlyStopping("bleu")
    again.load_state_dict(es.state_dict())  # a resumed run goes on counting
    assert again.where_best(400) == line
    older = {k: v for k, v in es.state_dict().items() if k != "evaluations"}  # a checkpoint from before the count
    again.load_state_dict(older)
    assert again.evaluations == 3 and "then 2 of 3 evaluations" in again.where_best(400)
    assert EarlyStopping("val_loss").where_best(10) is None


def test_patience_stops_a_run_that_does_not_improve(tmp_path, monkeypatch):
    monkeypatch.setattr(Evaluator, "validate", lambda self: 5.0)  # a metric that never improves
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "p", "--epochs", "20", "--eval-every", "5", "--patience", "1",
                     "--best-metric", "val_loss", lines=lines)
    result = t.train()
    assert result["stopped"] and result["steps"] == 10  # the second evaluation did not improve
    why = [line for line in lines if line.startswith("early stop:")]
    assert len(why) == 1 and "validation loss has not improved for 1 evaluation" in why[0]
    assert torch.load(tmp_path / "p" / "weights" / "last.pt", weights_only=True)["step"] == 10
    assert [r["step"] for r in read_csv(tmp_path / "p" / "evals.csv") if not r["kind"]] == ["5", "10"]
    # resumed (a scheduler that resubmits with --resume): it ends again at once, no step trained
    assert main(["train", "--resume", str(tmp_path / "p" / "weights" / "last.pt")]) == 0
    assert int(read_csv(tmp_path / "p" / "steps.csv")[-1]["step"]) == 10
    assert [r["step"] for r in read_csv(tmp_path / "p" / "evals.csv") if not r["kind"]] == ["5", "10"]


def test_best_pt_follows_best_metric_and_eval_every(tmp_path, monkeypatch):
    values = iter([5.0, 4.0, 6.0, 4.5, 7.0, 8.0])
    monkeypatch.setattr(Evaluator, "validate", lambda self: next(values))
    t = make_trainer(tmp_path, "--name", "b", "--epochs", "2", "--eval-every", "6", "--best-metric", "val_loss",
                     "--average-last", "0")  # the evaluations' six values only (tests/training/test_averaging.py)
    n = len(t.train_loader)  # batches per epoch (14 here): evaluations every 6 steps and at each epoch end
    t.train()
    rows = read_csv(tmp_path / "b" / "evals.csv")
    expected = sorted(set(range(6, 2 * n + 1, 6)) | {n, 2 * n})
    assert len(expected) == 6
    assert [int(r["step"]) for r in rows] == expected
    assert [r["best"] for r in rows] == ["1", "1", "0", "0", "0", "0"]
    assert torch.load(tmp_path / "b" / "weights" / "best.pt", weights_only=True)["step"] == expected[1]


def test_eval_comes_before_a_save_of_the_same_step_and_max_steps_evaluates_once(tmp_path, monkeypatch):
    values = iter([5.0, 4.0, 3.0, 2.0])
    monkeypatch.setattr(Evaluator, "validate", lambda self: next(values))
    t = make_trainer(tmp_path, "--name", "o", "--epochs", "5", "--max-steps", "6", "--eval-every", "3",
                     "--save-every", "3", "--keep-last", "3", "--best-metric", "val_loss")
    assert len(t.train_loader) > 6  # step 6 ends the run mid-epoch
    t.train()
    # one evaluation per 3 steps; the run's last step is evaluated once (not again as an epoch end)
    assert [r["step"] for r in read_csv(tmp_path / "o" / "evals.csv") if not r["kind"]] == ["3", "6"]
    # the checkpoint of step 3 already holds the evaluation of step 3 (exact early stopping on resume)
    at3 = torch.load(tmp_path / "o" / "weights" / "step_000003.pt", weights_only=True)
    assert at3["stopping"]["best"] == 5.0 and at3["step"] == 3


def test_ema_weights_are_written_for_inference(tmp_path):
    t = make_trainer(tmp_path, "--name", "e", "--epochs", "1", "--ema", "0.9")
    t.train()
    ema = torch.load(tmp_path / "e" / "weights" / "ema.pt", weights_only=True)
    last = torch.load(tmp_path / "e" / "weights" / "last.pt", weights_only=True)
    names = [n for n, _ in t.model.named_parameters()]
    assert all(torch.equal(ema["model"][n], s) for n, s in zip(names, last["ema"]["shadow"]))
    assert "optimizer" not in ema  # weights only: translate/eval/--weights load it, --resume refuses it
    assert all(torch.equal(p.detach(), last["model"][n]) for n, p in t.model.named_parameters())  # swapped back


def test_best_metric_checks():
    assert RunConfig().best_metric == "auto"
    with pytest.raises(ConfigError, match="--best-metric.*--bleu-samples"):
        RunConfig(best_metric="bleu", bleu_samples=0)
    with pytest.raises(ConfigError, match="--keep-last.*--save-every"):
        RunConfig(keep_last=3)
    with pytest.raises(ConfigError, match="--eval-ema.*--ema"):
        RunConfig(eval_ema=True, ema=0.0)
    with pytest.raises(ConfigError, match="--ema"):
        RunConfig(ema=1.0)


@pytest.mark.parametrize("ema, eval_ema, want", [
    (None, None, (0.9999, True)),    # the default: kept and evaluated
    (None, False, (0.9999, False)),  # --no-eval-ema: kept (ema.pt), the trained weights evaluated
    (0.0, None, (0.0, False)),       # --ema 0: none
    (0.999, None, (0.999, True)),
])
def test_ema_is_kept_and_evaluated_by_default(ema, eval_ema, want):
    from streamnmt.training.recipe import resolve_ema

    kw = {"ema": ema} if ema is not None else {}
    run = resolve_ema(RunConfig(eval_ema=eval_ema, **kw))
    assert (run.ema, run.eval_ema) == want
    assert build_parser().parse_args(["train", "--no-eval-ema"]).eval_ema is False


# -- time limit and exact resume ------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("2h", 7200), ("90m", 5400), ("20s", 20), ("1h30m", 5400), ("45", 45)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "2d", "h", "-5s", "0s", "1.5.2h"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError, match="--time-limit"):
        parse_duration(text)


def test_time_limit_stops_saves_and_resume_is_exact(tmp_path):
    # --ema-every 3: the cut at step 20 falls between two updates of the average; resume counts on
    common = ["--epochs", "3", "--max-steps", "30", "--ema", "0.9", "--ema-every", "3", "--seed", "3"]
    ref = make_trainer(tmp_path, "--name", "ref", *common)
    ref.train()
    lines: list[str] = []
    cut = make_trainer(tmp_path, "--name", "cut", *common, "--time-limit", "20s", lines=lines)
    cut.budget.clock = lambda: float(cut.global_step)  # one second per step: the limit is reached at step 20
    cut.budget.t0 = 0.0
    result = cut.train()
    assert result["stopped"] and result["steps"] == 20
    assert any(line.startswith("time limit (20 s) reached after step 20; saved") for line in lines)
    last = tmp_path / "cut" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 20
    resumed = Trainer.from_checkpoint(str(last), log=lambda _: None, time_limit="1h")
    assert resumed.train()["steps"] == 30
    assert step_losses(tmp_path / "cut") == step_losses(tmp_path / "ref") and len(step_losses(tmp_path / "ref")) == 30
    a = torch.load(tmp_path / "ref" / "weights" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for x, y in zip(a["ema"]["shadow"], b["ema"]["shadow"]))


def created_on_monotonic_clock(pid: int) -> float:
    """When process ``pid`` was made, on this process's ``time.monotonic()`` clock: the kernel's
    record (/proc/PID/stat's start time, clock ticks since boot), not a guess of the test's."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22; fields after the name start at 3
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME") or not Path("/proc/self/stat").is_file(),
                    reason="reads the process's start from /proc")
def test_time_limit_in_a_real_process_counts_from_the_command_start(tmp_path, home):
    """The clock of --time-limit starts when the OS made the process, so that the interpreter's
    start and the imports count. Each output line is timed as it arrives: the set-up line says how
    long after the clock's start it was written, which places the clock's start on the test's
    clock. A clock started late (at the imports' end, at the trainer's build) lags the process's
    creation by the start-up it no longer counts; the set-up line's own start-up part is then
    about 0. No bound on the run's length: load lengthens set-up, steps and the end alike."""
    env = dict(os.environ, STREAMNMT_HOME=str(home), PYTHONPATH=os.pathsep.join(sys.path), PYTHONUNBUFFERED="1")
    env.pop("STREAMNMT_COMMAND_START", None)  # the launcher's start: not this command's
    cmd = [sys.executable, "-m", "streamnmt", "train", *TINY, "--epochs", "1000", "--time-limit", "8s",
           "--project", str(tmp_path), "--name", "t"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        created = created_on_monotonic_clock(proc.pid)
        lines = [(time.monotonic(), line.rstrip("\n")) for line in proc.stdout]
    finally:
        watchdog.cancel()
    out = "\n".join(line for _, line in lines)
    assert proc.wait() == 0, out[-2000:]
    assert "time limit (8 s) reached after step" in out
    step = int(out.split("reached after step ")[1].split(";")[0])
    assert torch.load(tmp_path / "t" / "weights" / "last.pt", weights_only=True)["step"] == step > 0
    assert len(read_csv(tmp_path / "t" / "steps.csv")) == step
    evals = read_csv(tmp_path / "t" / "evals.csv")
    assert evals and int(evals[-1]["step"]) == step  # the end of the run was evaluated
    end = [x for _, x in lines if x.startswith("wall ")]
    assert len(end) == 1 and "training" in end[0] and "set-up" in end[0]
    kept = float(end[0].split("the loop stopped with ")[1].split()[0])  # the reserve it stopped with
    parts = end[0].split("kept for the end (")[1].rstrip(")").split(", ")  # "evaluation 0.2", ...
    assert 0 < kept < 8 and sum(float(x.rsplit(" ", 1)[1]) for x in parts) == pytest.approx(kept, abs=0.2)
    # "set-up S s: start-up (interpreter and imports) U s, ...": written S s after the clock's start
    arrived, setup = next((t, x) for t, x in lines if x.startswith("set-up "))
    total = float(setup.split()[1])
    startup = float(setup.split("start-up (interpreter and imports) ")[1].split()[0])
    lag = (arrived - total) - created  # the clock's start after the process's creation (+ the pipe's delay)
    # psutil dates a process to whole seconds of the boot time: the clock may start up to 1 s early
    assert -1.2 < lag < startup / 3, f"the clock started {lag:.2f} s after the process; start-up {startup} s"


def test_resume_takes_a_new_time_limit_but_not_a_new_lr(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "x.pt"), "--time-limit", "1h", "--lr", "2"]) == 2
    err = capsys.readouterr().err
    assert "drop --lr" in err and "--time-limit" not in err.split("drop")[1]


# -- keep-last, tied run, output ------------------------------------------------------------------

def test_keep_last_tied_run_and_quiet_output(tmp_path):
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "k", "--epochs", "2", "--save-every", "4", "--keep-last", "3",
                     "--tie-embeddings", "all", "--shared-vocab", lines=lines)
    t.train()
    weights = tmp_path / "k" / "weights"
    kept = sorted(p.name for p in weights.glob("step_*.pt"))
    saved = list(range(4, t.global_step + 1, 4))  # every 4th step; the newest 3 kept
    assert len(saved) > 3 and kept == [f"step_{k:06d}.pt" for k in saved[-3:]]
    assert torch.load(weights / kept[0], weights_only=True)["step"] == saved[-3]
    assert t.run.data.src_tok.path == t.run.data.tgt_tok.path and t.run.data.src_tok.path.name == "shared.model"
    from streamnmt.inference.translate import load_for_inference
    model, *_ = load_for_inference(weights / "best.pt", "cpu")
    assert model.generator.weight is model.tgt_embed.weight is model.src_embed.weight
    # one line per epoch; the host-sync table once, at the end
    assert sum("host sync" in line for line in lines) == 1
    assert sum(line.lstrip().startswith(("1/2", "2/2")) for line in lines) == 2


def test_verbose_prints_the_table_every_epoch(tmp_path):
    lines: list[str] = []
    make_trainer(tmp_path, "--name", "v", "--epochs", "2", "--verbose", lines=lines).train()
    assert sum("host sync" in line for line in lines) == 3  # after each epoch, and the run's at the end


def test_tied_all_needs_shared_vocab():
    with pytest.raises(ConfigError, match="--tie-embeddings.*--shared-vocab"):
        build_job({"tie_embeddings": "all"})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    make_trainer(tmp_path, "--name", "tb", "--epochs", "1", "--tensorboard").train()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "dev/val_loss", "epoch/tokens_per_s", "sync/count"} <= tags
    assert len(acc.Scalars("train/loss")) == len(read_csv(tmp_path / "tb" / "steps.csv"))


def test_tensorboard_missing_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["train", *TINY, "--tensorboard", "--project", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensorboard" in err[0] and "pip install tensorboard" in err[0]
    assert not (tmp_path / "p").exists()  # nothing written


# -- defaults, help, start line ------------------------------------------------------------------

def test_label_smoothing_is_left_to_the_corpus_rule_and_0_is_allowed():
    assert ModelConfig().label_smoothing is None  # streamnmt.config.corpus_label_smoothing chooses it
    assert ModelConfig(label_smoothing=0.0).label_smoothing == 0.0
    with pytest.raises(Exception, match="label_smoothing"):
        ModelConfig(label_smoothing=1.0)


def test_help_shows_no_none_defaults():
    text = build_parser()._subparsers._group_actions[0].choices["translate"].format_help()
    assert "(required)" in text and "(default: None)" not in " ".join(text.split())
    train = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "(default: None)" not in train and "(default: 1.0)" in train


@pytest.mark.parametrize("cuda, own, flags, epochs, patience, says", [
    (True, True, {}, EPOCHS_UNLIMITED, PLATEAU_PATIENCE, "auto"),  # a --data run on a GPU, no end given
    (True, True, {"patience": 7}, EPOCHS_UNLIMITED, 7, "--patience 7:"),  # its own patience, still until it
    (True, True, {"patience": 0}, 10, 0, None),  # --patience 0: never stop early, so the fixed epochs
    (True, True, {"time_limit": "2m"}, EPOCHS_UNLIMITED, 0, None),  # the slot ends it
    (True, True, {"max_steps": 500}, EPOCHS_UNLIMITED, 0, None),  # the step count ends it (fairseq's --max-update)
    (False, False, {"max_steps": 500}, EPOCHS_UNLIMITED, 0, None),
    (True, True, {"epochs": 3}, 3, 0, None),
    (True, False, {}, 10, 0, None),  # the built-in corpus's demo
    (False, True, {}, 2, 0, None),  # a CPU run stays short
    (False, True, {"patience": 4}, 2, 4, None),
])
def test_a_data_run_on_a_gpu_given_no_end_trains_until_its_plateau(cuda, own, flags, epochs, patience, says):
    from streamnmt.training.recipe import resolve_end

    lines: list[str] = []
    run = resolve_end(RunConfig(**flags), cuda, own, lines.append)
    assert (run.epochs, run.patience) == (epochs, patience)
    assert len(lines) == (says is not None) and (says is None or says in lines[0] and "plateau" in lines[0])
    if says:
        assert "dev BLEU has not improved" in lines[0]
        resolve_end(RunConfig(bleu_samples=0), cuda, own, lines.append)
        assert "the validation loss has not improved" in lines[-1]


def test_cpu_start_line_names_the_builtin_corpus_only_without_data(tmp_path):
    from streamnmt.training.recipe import resolve_job

    lines: list[str] = []
    resolve_job(build_job({"data": str(tmp_path)}), torch.device("cpu"), 1, lines.append)
    resolve_job(build_job({}), torch.device("cpu"), 1, lines.append)
    lines = [line for line in lines if "preset" in line]  # the strategy choice is logged here too
    assert len(lines) == 2 and "built-in" not in lines[0] and "16000-pair built-in corpus" in lines[1]


@pytest.mark.plots
def test_results_png_curves_are_per_step_and_per_evaluation(tmp_path):
    from streamnmt.training.plots import plot_results, results_series

    (tmp_path / "steps.csv").write_text("step,epoch,loss,lr,tokens\n1,1,5.0,0.1,10\n2,1,4.0,0.1,10\n3,1,inf,0.1,10\n"
                                        "4,1,3.5,0.1,10\n")
    (tmp_path / "evals.csv").write_text("step,epoch,val_loss,bleu,bleu_s,best\n2,1,4.5,1.5,0.1,1\n4,1,4.2,,0.1,0\n")
    (tmp_path / "results.csv").write_text("epoch,train_loss,val_loss,bleu,tokens_per_s,epoch_s\n1,4.2,4.2,,100,1\n")
    axis, s = results_series(tmp_path)
    assert axis == "optimizer step"
    assert s["train_loss"] == ([1.0, 2.0, 4.0], [5.0, 4.0, 3.5])  # the non-finite step is left out
    assert s["val_loss"] == ([2.0, 4.0], [4.5, 4.2]) and s["bleu"] == ([2.0], [1.5])
    assert s["tokens_per_s"] == ([1.0], [100.0])
    assert plot_results(tmp_path).read_bytes()[:4] == b"\x89PNG"
    for name in ("steps.csv", "evals.csv"):  # an older run directory: per-epoch curves
        (tmp_path / name).unlink()
    axis, s = results_series(tmp_path)
    assert axis == "epoch" and s["val_loss"] == ([1.0], [4.2])


def test_validation_loss_is_plain_nll_whatever_the_smoothing():
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    batch = example_batch((4, 8, 8), model.shape, 0)
    smooth = make_step(model, torch.device("cpu"), d_model=32, label_smoothing=0.1)
    plain = make_step(model, torch.device("cpu"), d_model=32, label_smoothing=0.0)
    assert not torch.equal(smooth.loss_sum(batch).loss, plain.loss_sum(batch).loss)
    assert torch.equal(smooth.loss_sum(batch).nll, plain.loss_sum(batch).loss)
