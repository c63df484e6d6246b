"""The end of a run and its resume: what last.pt and best.pt hold when a run stops between its
saves and evaluations, and what a resume makes of them (tiny model, CPU, fake clocks)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from streamnmt.training.async_bleu import Deferred
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.runs import read_csv
from streamnmt.training.trainer import Trainer
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_step_saved_before_its_last_evaluation_is_saved_again(tmp_path, monkeypatch):
    """--save-every 1 saves every step; the time limit then stops the run and the end evaluates
    that step: last.pt must hold that evaluation's best metric and cadence, not the earlier ones."""
    t = make_trainer(tmp_path, "--name", "a", "--time-limit", "40s", "--save-every", "1", "--best-metric",
                     "val_loss", "--epochs", "50")
    extra = [0.0]
    t.clock = t.budget.clock = lambda: float(t.global_step) + extra[0]
    t.budget.t0 = 0.0
    real = Evaluator.validate

    def costly(self):
        extra[0] += 5.0
        return real(self)

    monkeypatch.setattr(Evaluator, "validate", costly)
    result = t.train()
    evals = read_csv(tmp_path / "a" / "evals.csv")
    assert int(evals[-1]["step"]) == result["steps"] and len(evals) >= 2
    ckpt = torch.load(tmp_path / "a" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == result["steps"] and ckpt["last_eval_step"] == result["steps"]
    assert ckpt["stopping"]["best"] == t.evaluator.stopper.best and ckpt["best_val"] == t.evaluator.best_val
    assert ckpt["stopping"]["cadence"] == t.evaluator.cadence.state_dict()


def test_a_stop_at_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path, monkeypatch):
    """Stopped on the epoch's last batch: last.pt points at the next epoch's start, and the resumed
    run evaluates no step twice and writes no empty epoch row."""
    t = make_trainer(tmp_path, "--name", "b", "--epochs", "3", "--eval-every", "0", "--best-metric", "val_loss",
                     "--patience", "5", "--average-last", "0")
    n = len(t.train_loader)
    real = Trainer._trained

    def trained(self, seconds):
        real(self, seconds)
        if self.global_step == n and not self.stop_requested:
            self.request_stop("a stop at the last step of epoch 1")

    monkeypatch.setattr(Trainer, "_trained", trained)
    t.train()
    monkeypatch.setattr(Trainer, "_trained", real)
    ckpt = torch.load(tmp_path / "b" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == n and (ckpt["sampler"]["epoch"], ckpt["sampler"]["position"]) == (1, 0)
    resumed = Trainer.from_checkpoint(str(tmp_path / "b" / "weights" / "last.pt"), log=lambda _: None,
                                      changes={"epochs": 2})
    resumed.train()
    evals = read_csv(tmp_path / "b" / "evals.csv")
    assert [(int(r["step"]), int(r["epoch"])) for r in evals] == [(n, 1), (2 * n, 2)]
    assert resumed.evaluator.stopper.bad == 0 or evals[-1]["best"] == "0"
    rows = read_csv(tmp_path / "b" / "results.csv")
    assert [(int(r["epoch"]), int(r["steps"])) for r in rows] == [(1, n), (2, 2 * n)]  # epoch 1's by the stop
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)


def test_a_stop_mid_epoch_writes_its_part_and_a_resume_replaces_it(tmp_path, monkeypatch):
    """A --time-limit, --patience or signal stop inside an epoch: the epoch's part gets its
    results.csv row and sync_stats.json entry (a run stopped in its first epoch wrote neither); the
    resume that finishes the epoch writes the whole epoch's row in its place."""
    t = make_trainer(tmp_path, "--name", "m", "--epochs", "1", "--eval-every", "0", "--best-metric", "val_loss",
                     "--average-last", "0")
    n, cut = len(t.train_loader), 3
    real = Trainer._trained

    def trained(self, seconds):
        real(self, seconds)
        if self.global_step == cut and not self.stop_requested:
            self.request_stop("a stop inside epoch 1")

    monkeypatch.setattr(Trainer, "_trained", trained)
    result = t.train()
    monkeypatch.setattr(Trainer, "_trained", real)
    assert n > cut and result["last"]["steps"] == cut
    rows = read_csv(tmp_path / "m" / "results.csv")
    assert [(int(r["epoch"]), int(r["steps"])) for r in rows] == [(1, cut)]
    assert rows[0]["val_loss"] != "" and float(rows[0]["train_loss"]) > 0  # the end's evaluation of its step
    stats = json.loads((tmp_path / "m" / "sync_stats.json").read_text())
    assert [e["epoch"] for e in stats] == [1]
    # a resume that ends before a step (here --max-steps at the step it stopped; a --patience stop resumed)
    # keeps the part's row and entry: it wrote none in their place
    Trainer.from_checkpoint(str(tmp_path / "m" / "weights" / "last.pt"), log=lambda _: None,
                            changes={"max_steps": cut}).train()
    assert read_csv(tmp_path / "m" / "results.csv") == rows
    assert json.loads((tmp_path / "m" / "sync_stats.json").read_text()) == stats
    Trainer.from_checkpoint(str(tmp_path / "m" / "weights" / "last.pt"), log=lambda _: None,
                            changes={"max_steps": 0}).train()
    rows = read_csv(tmp_path / "m" / "results.csv")
    assert [(int(r["epoch"]), int(r["steps"])) for r in rows] == [(1, n)]
    assert [e["epoch"] for e in json.loads((tmp_path / "m" / "sync_stats.json").read_text())] == [1]


def test_a_best_pt_newer_than_last_pt_is_replaced_only_by_a_better_model(tmp_path, monkeypatch):
    """best.pt may be newer than last.pt's record of the best (a kill after an evaluation wrote it,
    or a resume from an earlier step_*.pt). The resume keeps last.pt's early-stopping state (an exact
    replay), but an evaluation that beats only that record does not replace the better best.pt."""
    t = make_trainer(tmp_path, "--name", "c", "--epochs", "2", "--eval-every", "0", "--best-metric", "val_loss",
                     "--average-last", "0")
    t.train()
    weights = tmp_path / "c" / "weights"
    best = torch.load(weights / "best.pt", weights_only=True)["best"]
    assert best["metric"] == "val_loss" and best["value"] == t.evaluator.stopper.best
    ckpt = torch.load(weights / "last.pt", weights_only=True)
    ckpt["stopping"].update(best=best["value"] + 1.0, best_step=1, bad=3)  # as an older last.pt had it
    torch.save(ckpt, weights / "last.pt")
    resumed = Trainer.from_checkpoint(str(weights / "last.pt"), log=lambda _: None, changes={"epochs": 3})
    stopper = resumed.evaluator.stopper
    assert (stopper.best, stopper.best_step, stopper.bad) == (best["value"] + 1.0, 1, 3)  # as recorded
    assert resumed.checkpoints.best_on_disk == best["value"]
    monkeypatch.setattr(Evaluator, "validate", lambda self: best["value"] + 0.5)  # beats the record only
    resumed.train()
    evals = read_csv(tmp_path / "c" / "evals.csv")
    assert evals[-1]["best"] == "1"  # better than last.pt's record ...
    kept = torch.load(weights / "best.pt", weights_only=True)
    assert kept["best"] == best and kept["step"] == best["step"]  # ... but not than best.pt's model


def test_a_shared_vocabulary_run_resumes_whatever_files_it_named(tmp_path):
    """--shared-vocab with the model named by --tokenizer-tgt: the resume names the embedded shared
    model for both sides (two different names would be refused)."""
    first = make_trainer(tmp_path, "--name", "a", "--shared-vocab", "--max-steps", "2")
    first.train()
    shared = str(first.run.data.src_tok.path)
    named = make_trainer(tmp_path, "--name", "b", "--shared-vocab", "--tokenizer-tgt", shared, "--max-steps", "2")
    named.train()
    resumed = Trainer.from_checkpoint(str(tmp_path / "b" / "weights" / "last.pt"), log=lambda _: None,
                                      changes={"max_steps": 3})
    assert resumed.job.data.tokenizer_src == resumed.job.data.tokenizer_tgt
    assert resumed.run.data.src_tok.sha256 == resumed.run.data.tgt_tok.sha256 == named.run.data.src_tok.sha256


def test_a_checkpoint_from_before_the_tokenizer_rename_resumes(tmp_path):
    """A checkpoint whose config names its tokenizers by the seeds' keys (tokenizer_eng/tokenizer_chn)
    resumes with the models it embeds, which replace the files those keys named."""
    from streamnmt.training.build import resume_job

    first = make_trainer(tmp_path, "--name", "a", "--max-steps", "2")
    first.train()
    ckpt = torch.load(tmp_path / "a" / "weights" / "last.pt", weights_only=True)
    data = ckpt["config"]["data"]
    data["tokenizer_eng"], data["tokenizer_chn"] = str(tmp_path / "gone.model"), str(tmp_path / "gone2.model")
    del data["tokenizer_src"], data["tokenizer_tgt"]
    old = tmp_path / "old" / "weights" / "last.pt"  # in a run directory, as --resume wants it
    old.parent.mkdir(parents=True)
    (tmp_path / "old" / "config.yaml").write_bytes((tmp_path / "a" / "config.yaml").read_bytes())
    torch.save(ckpt, old)
    job, _ = resume_job(str(old), log=lambda _: None)
    assert Path(job.data.tokenizer_src).is_file() and Path(job.data.tokenizer_tgt).is_file()
    assert "gone" not in job.data.tokenizer_src + job.data.tokenizer_tgt


def test_safetensors_round_trip_scalars_and_empty_tensors(tmp_path):
    from streamnmt.checkpoint import load_safetensors, save_safetensors

    tensors = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "m": torch.arange(6.0).view(2, 3),
               "h": torch.ones(3, dtype=torch.bfloat16)}
    save_safetensors(tmp_path / "x.safetensors", tensors)
    back = load_safetensors(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    assert all(back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
               for k, v in tensors.items())


def test_agreements_after_rank0s_own_work_wait_on_the_long_group(tmp_path):
    """Between epochs and at the end rank 0 may still evaluate or wait for a checkpoint write alone:
    those stop agreements wait on the long control group; the loop's own, taken right after a step
    that all ranks ran together, are bounded by --dist-timeout."""
    t = make_trainer(tmp_path, "--name", "g", "--max-steps", "2")
    calls: list[tuple[str, bool]] = []

    class Ranks:
        active, main, world, rank = True, True, 2, 0

        def agree(self, flag, site="dist.stop", long_wait=False):
            calls.append((site, long_wait))
            return flag

        def agree_any(self, flags, site="dist.stop", long_wait=False):
            calls.append((site, long_wait))
            return tuple(flags)

    t.dist = Ranks()
    t._done()  # between epochs
    t.global_step = t.job.engine.sync_interval
    t._after_step()  # in the loop, after a step
    assert calls == [("dist.stop", True), ("dist.step", False)]


def test_the_trainer_and_its_graphs_are_gone_before_the_process_group_is(tmp_path, monkeypatch):
    """``streamnmt train`` frees the trainer (its CUDA graphs hold captured NCCL collectives) before
    destroy_process_group, which otherwise hangs every rank on 2 GPUs; checked where close runs."""
    import gc

    from streamnmt import cli, dist
    from tests.test_accum import TINY

    alive: list[int] = []
    real = dist.Dist.close

    def close(self):
        alive.append(sum(isinstance(o, Trainer) for o in gc.get_objects()))
        real(self)

    monkeypatch.setattr(dist.Dist, "close", close)
    assert cli.main(["train", *TINY, "--max-steps", "2", "--project", str(tmp_path), "--name", "g"]) == 0
    assert alive == [0]


def test_evals_say_the_runs_wall_clock_at_each_evaluation_summed_over_resumes(tmp_path):
    """evals.csv's wall_s: the run's seconds from the command's start to the evaluated step (a fake
    budget clock: 10 s a step); a resume adds the checkpoint's seconds to its own."""
    t = make_trainer(tmp_path, "--name", "w", "--epochs", "2", "--eval-every", "0", "--average-last", "0")
    t.budget.clock = lambda: 10.0 * t.global_step
    t.budget.t0 = -5.0  # 5 s of set-up before the first step
    n = len(t.train_loader)
    t.train()
    evals = read_csv(tmp_path / "w" / "evals.csv")
    assert [float(r["wall_s"]) for r in evals] == [10.0 * n + 5, 20.0 * n + 5]
    ckpt = torch.load(tmp_path / "w" / "weights" / "last.pt", weights_only=True)
    assert ckpt["wall_s"] == 20.0 * n + 5
    resumed = Trainer.from_checkpoint(str(tmp_path / "w" / "weights" / "last.pt"), log=lambda _: None,
                                      changes={"epochs": 3})
    resumed.budget.clock = lambda: 10.0 * (resumed.global_step - 2 * n)
    resumed.budget.t0 = -3.0
    resumed.train()
    evals = read_csv(tmp_path / "w" / "evals.csv")
    assert [float(r["wall_s"]) for r in evals] == [10.0 * n + 5, 20.0 * n + 5, (20.0 * n + 5) + 10.0 * n + 3]
    # a checkpoint from before it recorded wall_s: the run's earlier seconds are unknown, not zero
    last = tmp_path / "w" / "weights" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    del ckpt["wall_s"]
    torch.save(ckpt, last)
    older = Trainer.from_checkpoint(str(last), log=lambda _: None, changes={"epochs": 4})
    older.train()
    evals = read_csv(tmp_path / "w" / "evals.csv")
    assert len(evals) == 4 and evals[-1]["wall_s"] == "" and evals[-2]["wall_s"] != ""


def test_the_last_write_runs_while_the_plots_are_drawn_and_ends_before_the_run_does(tmp_path, monkeypatch):
    """The end of the run draws its plots while the last last.pt is written, then waits for the
    write: the plots start before the write ends, and the run returns with last.pt of its last step."""
    import time as _time

    from streamnmt.training import checkpointer, metrics

    events: list[tuple[str, float]] = []
    real_save, real_plot = checkpointer.save_checkpoint, metrics.plot_results

    def slow_save(path, state):
        events.append(("write", _time.monotonic()))
        _time.sleep(0.5)
        real_save(path, state)
        events.append(("written", _time.monotonic()))

    def plot(run_dir):
        events.append(("plot", _time.monotonic()))
        return real_plot(run_dir)

    monkeypatch.setattr(checkpointer, "save_checkpoint", slow_save)
    monkeypatch.setattr(metrics, "plot_results", plot)
    t = make_trainer(tmp_path, "--name", "p", "--max-steps", "3", "--epochs", "50",
                     "--ema", "0")  # no ema.pt written after the plots: the last write is last.pt's
    result = t.train()
    last_write = max(ts for name, ts in events if name == "write")
    plotted = max(ts for name, ts in events if name == "plot")
    written = max(ts for name, ts in events if name == "written")
    assert last_write < plotted < written  # drawn while the last write was in flight
    ckpt = torch.load(tmp_path / "p" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == result["steps"] == 3
    assert result["times"]["checkpoints"] >= 0.3  # the wait for that write counted as checkpoints


@pytest.mark.parametrize("main", [True, False])
def test_after_a_step_one_agreement_carries_the_stop_and_rank0s_evaluation(tmp_path, main):
    """Several ranks, the time rule: every --sync-interval steps one all-reduce of (stop, rank 0's
    due, rank 0's cool-down due); a rank other than 0 contributes no due of its own; between those steps nothing is asked."""
    t = make_trainer(tmp_path, "--name", "s", "--max-steps", "2")
    k = t.job.engine.sync_interval
    sent: list[tuple] = []

    class Ranks:
        active, world = True, 2
        rank = 0 if main else 1

        def agree_any(self, flags, site="dist.stop", long_wait=False):
            sent.append(tuple(flags))
            return (flags[0] or not main, True, False)  # the other rank asked to stop; rank 0's rule: due

    Ranks.main = main
    t.dist = Ranks()
    t.evaluator.cadence.due = lambda step, epoch_end: True  # this rank's own clock says due
    t.global_step = k + 1
    assert t._after_step() is False and sent == [] and t.stopped is False  # not an agreement step
    t.global_step = 2 * k
    assert t._after_step() is True  # rank 0's answer, on every rank
    assert sent == [(False, main, False)]  # only rank 0 puts its rule in (no --lr-cooldown: none due)
    assert t.stopped is (not main)  # any rank's stop request stops all


def test_the_end_reserve_keeps_a_best_pt_write_for_a_pass_not_yet_collected(tmp_path):
    """A pass beside training (finished or not) is collected at the end and may write best.pt, which
    the end's last.pt waits for: the reserve counts that write, and a pass still to decode (running,
    or a resumed run's, decoded on the loop) its cost too; the pass's own stop rule
    (``evaluation=False``) counts neither. A write in flight counts what it has left."""
    t = make_trainer(tmp_path, "--name", "r", "--time-limit", "60s", "--epochs", "1")
    t.checkpointer.write_s = {"last": 2.0, "best": 1.5}
    t.evaluator.cadence.done(4.0)
    t.evaluator.cadence.done(3.0)  # the first evaluation's cost (its captures) is left out
    cost = t.evaluator.cadence.end_cost_s
    assert cost == 3.0
    none = t.reserve()
    t.evaluator.pending = (None, None, SimpleNamespace(done=True))  # finished, not yet collected
    finished = t.reserve()
    t.evaluator.pending = (None, None, SimpleNamespace(done=False))  # still decoding
    running = t.reserve()
    assert finished["evaluation"] == pytest.approx(none["evaluation"] + 1.5)
    assert running["evaluation"] == pytest.approx(none["evaluation"] + 1.5 + cost)
    t.evaluator.pending = (None, None, Deferred(lambda stop: (None, 0.0, 0)))  # a resumed run's
    assert t.reserve()["evaluation"] == pytest.approx(running["evaluation"])
    assert finished["writes"] == none["writes"] == 2.0  # no write in flight
    assert t.reserve(evaluation=False)["evaluation"] == 0.0
    t.evaluator.pending = None
    t.checkpointer.in_flight_s = lambda: 0.7
    assert t.reserve()["writes"] == pytest.approx(2.7)
