"""--async-eval: the BLEU pass on a thread beside training (streamnmt.training.async_bleu).

On the CPU ``--async-eval on`` runs the same machinery as a GPU's ``auto`` (a thread, a separate
decoding copy, a snapshot for best.pt), without streams: the run must train, evaluate and choose
best.pt exactly as the run whose loop waits for each pass."""

from __future__ import annotations

import threading

import pytest
import torch

from streamnmt.syncstats import STATS, host_sync
from streamnmt.training.async_bleu import Beside, Snapshot
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.runs import read_csv
from tests.test_recipe import home, make_trainer, step_losses  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")

EVALS = ["--epochs", "2", "--eval-every", "7", "--bleu-samples", "12", "--beam-size", "2", "--dropout", "0.1"]


def test_a_run_with_passes_beside_training_equals_the_run_that_waits(tmp_path):
    lines: list[str] = []
    runs = {}
    for mode in ("off", "on"):
        t = make_trainer(tmp_path, "--name", mode, *EVALS, "--async-eval", mode, lines=lines if mode == "on" else None)
        t.train()
        runs[mode] = tmp_path / mode
    off, on = runs["off"], runs["on"]
    assert step_losses(off) == step_losses(on)  # training untouched by the thread (dropout too)
    cols = ("step", "epoch", "val_loss", "bleu", "bleu_n", "best")
    rows_off, rows_on = ([{c: r[c] for c in cols} for r in read_csv(d / "evals.csv")] for d in (off, on))
    assert len(rows_off) >= 4 and rows_off == rows_on  # the same steps evaluated, the same results
    assert any(line.startswith("eval: from now on the BLEU passes run beside training") for line in lines)
    best_off, best_on = (torch.load(d / "weights" / "best.pt", weights_only=True) for d in (off, on))
    assert best_off["step"] == best_on["step"] and best_off["best"] == best_on["best"]
    for name, w in best_off["model"].items():  # the evaluated step's weights, not the ones trained after it
        assert torch.equal(w, best_on["model"][name]), name


def test_best_pt_holds_the_evaluated_step_not_the_weights_trained_on(tmp_path, monkeypatch):
    """A pass that ends several steps after its launch: best.pt still holds the launch's weights."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    real_launch, real_decode = Evaluator.launch, Evaluator._decode
    go = threading.Event()

    def launch(self, step, ema=None, stop=None):
        seen[step] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        go.clear()
        return real_launch(self, step, ema, stop)

    def slow_decode(self, stop):
        if threading.current_thread() is not threading.main_thread():
            go.wait(timeout=20)  # until the loop has trained on (below)
        return real_decode(self, stop)

    monkeypatch.setattr(Evaluator, "launch", launch)
    monkeypatch.setattr(Evaluator, "_decode", slow_decode)
    t = make_trainer(tmp_path, "--name", "late", *EVALS, "--async-eval", "on", "--best-metric", "val_loss",
                     "--ema", "0")  # best.pt then holds the launch's trained weights, which the test compares
    real_trained = t._trained

    def trained(seconds):  # two steps after a launch, let the pass go on
        real_trained(seconds)
        if t.evaluations.launched is not None and t.global_step >= t.evaluations.launched["step"] + 2:
            go.set()

    t._trained = trained
    checked = []
    real_write = t.evaluations.write_best

    def write_best(loop, weights=None, step=None):
        waited = real_write(loop, weights, step)
        if weights is not None:  # a collected pass: the file holds its launch's weights
            t.checkpointer.wait()
            best = torch.load(tmp_path / "late" / "weights" / "best.pt", weights_only=True)
            assert best["step"] == step and t.global_step >= step + 2
            for name, w in seen[step].items():
                assert torch.equal(best["model"][name], w), name
            assert not all(torch.equal(best["model"][n], w) for n, w in t.model.state_dict().items())  # trained on
            checked.append(step)
        return waited

    t.evaluations.write_best = write_best
    t.train()
    assert checked, "no pass beside training wrote best.pt"


def test_an_error_in_the_pass_is_raised_on_the_loop(tmp_path, monkeypatch):
    real = Evaluator._decode

    def failing(self, stop):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("decoding failed beside training")
        return real(self, stop)

    monkeypatch.setattr(Evaluator, "_decode", failing)
    t = make_trainer(tmp_path, "--name", "err", *EVALS, "--async-eval", "on")
    with pytest.raises(RuntimeError, match="decoding failed beside training"):
        t.train()


def test_a_thread_counts_its_host_waits_apart_and_the_snapshot_keeps_ties():
    STATS.reset()
    task = Beside(lambda: host_sync("beside.site", lambda: 3), torch.device("cpu"), None)
    assert task.join() == 3 and "beside.site" in task.stats and "beside.site" not in STATS.snapshot()
    host_sync("loop.site", lambda: None)
    assert "loop.site" in STATS.reset()
    shared = torch.arange(6.0)
    snap = Snapshot()
    first = snap.take({"a": shared, "b": shared, "c": torch.ones(2)})
    assert first["a"] is first["b"] and first["a"] is not shared and torch.equal(first["a"], shared)
    shared.add_(1.0)
    again = snap.take({"a": shared, "b": shared, "c": torch.ones(2)})
    assert again["a"] is first["a"] and torch.equal(again["a"], shared)  # the same buffers, refilled


# --lr 80: the validation loss stops improving at the fourth evaluation (step 28), well within the 8 epochs
@pytest.mark.parametrize("flags", [("--ema", "0.99", "--eval-ema"), ("--patience", "1", "--best-metric", "val_loss",
                                                                    "--epochs", "8", "--lr", "80")])
def test_ema_and_patience_decide_beside_training_as_on_the_loop(tmp_path, flags):
    """--eval-ema: the passes decode the averaged weights of their step; --patience: a run whose
    evaluations stop improving ends (a pass's verdict comes in at the next evaluation, so one
    evaluation more), with the evaluations up to its stop those of the run that waits."""
    lines: list[str] = []
    for mode in ("off", "on"):
        make_trainer(tmp_path, "--name", mode, *EVALS, *flags, "--async-eval", mode,
                     lines=lines if mode == "on" else None).train()
    cols = ("step", "val_loss", "bleu", "best")
    off, on = ([{c: r[c] for c in cols} for r in read_csv(tmp_path / m / "evals.csv") if not r["kind"]]
               for m in ("off", "on"))  # the evaluations (not the end's --average-last row)
    assert len(on) >= 3 and on[:-1] == off[:len(on) - 1]
    if "--patience" in flags:
        assert any(line.startswith("early stop: validation loss has not improved") for line in lines)
        assert len(on) == len(off) + 1
    else:
        assert on == off
        best_off, best_on = (torch.load(tmp_path / m / "weights" / "best.pt", weights_only=True) for m in ("off", "on"))
        assert all(torch.equal(w, best_on["model"][k]) for k, w in best_off["model"].items())


def test_last_pt_holds_a_pass_that_ends_after_the_last_step(tmp_path):
    """An epoch end launches a pass, saves last.pt, and the run stops there (as a time limit or
    --patience would ask): the end of the run collects the pass, then writes last.pt again with
    its early-stopping state."""
    t = make_trainer(tmp_path, "--name", "end", *EVALS, "--async-eval", "on", "--best-metric", "val_loss")
    real_save = t._save_last

    def save_then_stop(keep=0):
        real_save(keep)
        if t.evaluations.launched is not None and t.evaluations.launched["step"] == t.global_step:  # the pass still runs
            t.request_stop("stopped by the test after an epoch end's save")

    t._save_last = save_then_stop
    t.train()
    rows = read_csv(tmp_path / "end" / "evals.csv")
    assert rows[-1]["step"] == str(t.global_step) and rows[-1]["bleu"] != "" and len(rows) >= 2
    last = torch.load(tmp_path / "end" / "weights" / "last.pt", weights_only=True)
    assert last["step"] == t.global_step and last["last_eval_step"] == t.global_step
    stopper = t.evaluator.stopper.state_dict()
    assert {k: last["stopping"][k] for k in stopper} == stopper and stopper["best_step"] == t.global_step


def test_a_launched_pass_paces_the_cadence_by_validation_and_the_last_bleu_pass(tmp_path, monkeypatch):
    """Until a pass beside training is collected, the auto cadence counts what the launch cost on the
    loop plus the newest finished BLEU pass's seconds (not the first evaluation's, captures included)."""
    from streamnmt.training.cadence import Cadence

    estimates, real_started = [], Cadence.started

    def started(self, estimate_s=None):
        estimates.append((estimate_s, t.evaluations.launched["eval_s"], t.evaluations.last_bleu_s))
        real_started(self, estimate_s)

    monkeypatch.setattr(Cadence, "started", started)
    t = make_trainer(tmp_path, "--name", "pace", *EVALS, "--async-eval", "on")
    t.train()
    assert len(estimates) >= 2
    assert all(e == pytest.approx(launch + bleu) and bleu > 0 for e, launch, bleu in estimates)
