"""When a run evaluates (--eval-every auto's rule, on a fake clock) and where its wall clock went."""

from __future__ import annotations

import pytest

from streamnmt.training.cadence import COST_RATIO, Cadence
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.runs import read_csv
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_auto_rule_waits_nine_times_the_last_cost():
    c = Cadence(None, first_after_s=60.0, min_interval_s=10.0)
    assert not c.due(1, epoch_end=False)
    c.trained(59.0)
    assert not c.due(2, epoch_end=False) and c.due(2, epoch_end=True)  # no cost known: the first epoch end
    c.trained(1.0)
    assert c.due(3, epoch_end=False)  # ... or a minute of training, whichever comes first
    c.done(2.0)
    c.trained(2.0 * COST_RATIO - 0.5)
    assert not c.due(4, epoch_end=True) and not c.due(4, epoch_end=False)
    c.trained(0.5)
    assert c.due(5, epoch_end=True) and c.due(5, epoch_end=False)
    c.done(0.01)  # a near-free evaluation: mid-epoch no closer than min_interval_s, epoch ends by the rule
    c.trained(1.0)
    assert c.due(6, epoch_end=True) and not c.due(6, epoch_end=False)


def test_a_pass_beside_training_is_paced_by_its_estimate_until_its_cost_is_known():
    """The first evaluation holds its graphs' captures (here 6 s); a pass launched beside training
    then paces the next by what it is expected to cost (validation now + the last BLEU pass), not by
    the first's cost, until it is collected (done, restart=False) and its own cost counts."""
    c = Cadence(None, first_after_s=60.0, min_interval_s=10.0)
    c.done(6.0)
    c.trained(6.0 * COST_RATIO)
    assert c.due(1, epoch_end=False)
    c.started(estimate_s=0.05 + 0.95)
    c.trained(1.0 * COST_RATIO - 0.1)
    assert not c.due(2, epoch_end=True)
    c.trained(0.1)
    assert c.due(2, epoch_end=True) and not c.due(2, epoch_end=False)  # mid-epoch: min_interval_s first
    c.trained(10.0 - 1.0 * COST_RATIO)
    assert c.due(3, epoch_end=False)
    c.done(2.0, restart=False)  # collected: its own cost paces from now, the training since still counted
    assert not c.due(4, epoch_end=False) and c.since_s == pytest.approx(10.0)
    c.started()  # no estimate: the last cost stands
    assert c.cost_s == 2.0 and c.since_s == 0.0


def test_the_end_keeps_time_for_the_longest_of_the_last_evaluations():
    """A BLEU pass's cost moves from one evaluation to the next: the end of a time-limited run keeps
    the longest of the last END_COST_WINDOW, not the last alone (which may be the shortest); a
    process's first evaluation (its graphs' captures) is left out once another has ended."""
    c = Cadence(None)
    assert c.end_cost_s is None
    c.started(estimate_s=1.5)
    assert c.end_cost_s == 1.5  # none ended yet: the estimate
    c.done(20.0)  # the first: its graphs' captures
    assert c.end_cost_s == 20.0  # no other yet
    for cost in (7.8, 7.4, 7.1):
        c.done(cost)
    assert c.cost_s == 7.1 and c.end_cost_s == 7.8
    c.done(6.0)
    assert c.end_cost_s == 7.4  # 7.8 left the window
    again = Cadence(None)
    again.load_state_dict(c.state_dict())
    assert again.end_cost_s == 7.4 and again.costs == [7.4, 7.1, 6.0]
    again.done(9.0)  # a resumed process's first: captures again, not in the window
    assert again.end_cost_s == 7.4
    again.load_state_dict({"since_s": 0.0, "cost_s": 3.0})  # a checkpoint from before the window
    assert again.end_cost_s == 3.0


def test_fixed_cadences_keep_their_meaning():
    every = Cadence(5)
    assert every.due(10, epoch_end=False) and not every.due(11, epoch_end=False) and every.due(11, epoch_end=True)
    ends = Cadence(0)
    assert not ends.due(10, epoch_end=False) and ends.due(10, epoch_end=True)


def test_a_run_evaluates_when_the_rule_says_on_a_fake_clock(tmp_path, monkeypatch):
    """One second of training per step, five seconds per evaluation: after the first epoch end
    (no cost known yet) the next evaluation waits for 9 x 5 = 45 s of training, then the end."""
    t = make_trainer(tmp_path, "--name", "a", "--epochs", "50", "--max-steps", "100", "--best-metric", "val_loss",
                     "--average-last", "0")  # the end's evaluation only (tests/training/test_averaging.py)
    n = len(t.train_loader)
    assert 5 < n < 45
    extra = [0.0]
    t.clock = lambda: float(t.global_step) + extra[0]
    real_validate = Evaluator.validate

    def costly_validate(self):
        extra[0] += 5.0
        return real_validate(self)

    monkeypatch.setattr(Evaluator, "validate", costly_validate)
    t.train()
    steps = [int(r["step"]) for r in read_csv(tmp_path / "a" / "evals.csv")]
    first = n
    second = next(s for s in range(first + 45, 101) if s % n == 0 or s - first >= 45)
    assert steps == ([first, second, 100] if second < 100 else [first, 100])
    assert [float(r["eval_s"]) for r in read_csv(tmp_path / "a" / "evals.csv")] == [5.0] * len(steps)
    rows = read_csv(tmp_path / "a" / "results.csv")
    assert {"eval_s", "save_s"} <= set(rows[0]) and float(rows[0]["eval_s"]) == 5.0
    # an epoch row shows its end's evaluation (mid-epoch ones are in evals.csv); the others leave it blank
    assert sum(r["val_loss"] != "" for r in rows) == len([s for s in steps if s % n == 0 or s == 100])


def test_the_end_line_adds_up_to_the_wall_clock(tmp_path):
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "w", "--epochs", "2", lines=lines)
    result = t.train()
    times, wall = result["times"], result["wall_s"]
    assert set(times) == {"training", "evaluation", "checkpoints", "set-up", "other"}
    assert all(v >= 0 for v in times.values()) and times["training"] > 0 and times["evaluation"] > 0
    assert abs(sum(times.values()) - wall) <= 0.01 * wall, (times, wall)
    end = [line for line in lines if line.startswith("wall ")]
    assert len(end) == 1 and end[0].startswith(f"wall {wall:.0f} s: training ")
    # the set-up's parts, said once at the start; they add up to its total
    import re

    (setup,) = [line for line in lines if line.startswith("set-up ")]
    total, rest = re.fullmatch(r"set-up ([0-9.]+) s: (.*)", setup).groups()
    parts = {name: float(sec) for name, sec in re.findall(r"(?:^|, )([^,]+?) ([0-9.]+) s", rest)}
    assert {"data", "model", "loaders", "engine", "start-up (interpreter and imports)"} <= set(parts), parts
    assert abs(sum(parts.values()) - float(total)) <= 0.05 * len(parts)
    assert sum(t.run.setup_s.values()) <= times["set-up"] + 1e-6  # the rest of the set-up is train()'s start
    rows = read_csv(tmp_path / "w" / "evals.csv")
    assert rows and all(float(r["val_s"]) > 0 for r in rows)


def test_packed_validation_equals_the_bucketed_loss(tmp_path):
    """Where training packs, validation packs the dev set in the training's shape (one shape, one
    graph on CUDA); the loss is the bucketed one's (pairs never attend across each other)."""
    from streamnmt.data import make_loader
    from streamnmt.data.packing import PackSampler

    t = make_trainer(tmp_path, "--name", "p", "--max-tokens", "160", "--max-len", "32", "--epochs", "1",
                     "--max-steps", "3")
    t.train()
    ev = t.evaluator
    assert isinstance(ev.dev_loader.sampler, PackSampler)
    assert ev.dev_loader.shapes() == t.train_loader.shapes() and len(ev.dev_loader) < len(t.run.data.dev)
    packed = ev.validate()
    ev.dev_loader = make_loader(t.run.data.dev, t.job.data, train=False, seed=0, pin_memory=False)
    assert len(ev.dev_loader.shapes()) > 1  # length buckets
    assert packed == pytest.approx(ev.validate(), rel=1e-5)


def test_the_budget_counts_from_the_command_start(monkeypatch):
    """A rank of `train --nproc` counts from its launcher's start (STREAMNMT_COMMAND_START); a plain
    process from its own creation, so that the interpreter's start-up and the imports count too."""
    import time

    import psutil

    from streamnmt.training.stopping import TimeBudget, command_start

    monkeypatch.setenv("STREAMNMT_COMMAND_START", str(time.time() - 30.0))
    assert time.monotonic() - command_start() == pytest.approx(30.0, abs=1.0)
    monkeypatch.delenv("STREAMNMT_COMMAND_START")
    import streamnmt

    now = time.time()
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: now - 3.0)
    monkeypatch.setattr(streamnmt, "IMPORTED_AT", now - 2.5)  # the interpreter started, then imported
    assert time.monotonic() - command_start() == pytest.approx(3.0, abs=1.0)
    # a process made a minute before it imported streamnmt (a shell that exec'd the command last)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: now - 63.0)
    monkeypatch.setattr(streamnmt, "IMPORTED_AT", now - 3.0)
    assert time.monotonic() - command_start() == pytest.approx(3.0, abs=1.0)
    budget = TimeBudget(100.0, clock=lambda: 50.0, t0=0.0)
    assert not budget.expired() and not budget.expired(reserve_s=49.0) and budget.expired(reserve_s=50.0)


def _slow_decoding_run(tmp_path, monkeypatch, name: str, limit: str, batch_s, lines: list[str]):
    """A trainer on a fake clock (one second per step) whose dev BLEU pass decodes 12 sentences in
    batches of 4, each taking ``batch_s(step)`` seconds of that clock."""
    import streamnmt.inference.search as search_module
    import streamnmt.training.evaluator as evaluator_module

    t = make_trainer(tmp_path, "--name", name, "--time-limit", limit, "--bleu-samples", "12", "--average-last", "0",
                     lines=lines)  # the end keeps time for its one evaluation
    monkeypatch.setattr(evaluator_module, "EVAL_BATCH", 4)
    extra = [0.0]
    t.clock = t.budget.clock = lambda: float(t.global_step) + extra[0]
    t.budget.t0 = 0.0
    real_search = search_module.search

    def slow_search(*args, **kwargs):
        extra[0] += batch_s(t.global_step)
        return real_search(*args, **kwargs)

    monkeypatch.setattr(search_module, "search", slow_search)
    return t


def test_the_time_limit_cuts_a_bleu_pass_that_would_overrun(tmp_path, monkeypatch):
    """Each decoding batch takes 10 s early in the run, 25 s later (a half-trained model decodes
    longer). The last evaluation's BLEU pass stops between batches once the run's end would no
    longer fit the limit; that BLEU names its sentence count and is not compared for best.pt."""
    lines: list[str] = []
    t = _slow_decoding_run(tmp_path, monkeypatch, "c", "100s", lambda step: 10.0 if step < 30 else 25.0, lines)
    result = t.train()
    rows = read_csv(tmp_path / "c" / "evals.csv")
    assert len(rows) == 2 and int(rows[-1]["step"]) == result["steps"]
    assert rows[0]["bleu_n"] == "12" and rows[0]["best"] == "1"  # the first pass fitted
    assert rows[1]["bleu_n"] == "8" and rows[1]["best"] == "0"  # cut after its second batch
    assert any(line.startswith("eval: the end of the run (time limit or signal) cut the BLEU pass at 8 of 12 dev")
               and line.endswith("not compared for best.pt") for line in lines)
    assert result["wall_s"] >= 0 and t.clock() < 100 + 25 + 5  # at most one batch past the limit


def test_a_cut_first_pass_still_leaves_a_best_pt(tmp_path, monkeypatch):
    """The run's only evaluation is cut: best.pt holds its weights (a run that evaluated has a
    best.pt), but its BLEU is not kept as the best to beat."""
    lines: list[str] = []
    t = _slow_decoding_run(tmp_path, monkeypatch, "f", "30s", lambda step: 20.0, lines)
    t.train()
    rows = read_csv(tmp_path / "f" / "evals.csv")
    assert len(rows) == 1 and rows[0]["bleu_n"] == "8" and rows[0]["best"] == "1"  # at 3 s (a tenth): 3 + 2 x 20 > 30
    assert (tmp_path / "f" / "weights" / "best.pt").exists() and t.evaluator.stopper.best is None
    assert any(line.endswith("best.pt until a full pass sets a best") for line in lines)


def test_a_failed_pass_cut_by_a_signal_is_said_and_stays_pending():
    """Evaluator.interrupt: the cut pass's error is not the run's to raise, but one line says it, and
    the evaluation stays pending as a pass on the loop for the resumed run."""
    import types

    import torch

    from streamnmt.training.async_bleu import Beside

    def fails():
        raise RuntimeError("CUDA out of memory\nmore")

    lines: list[str] = []
    host = types.SimpleNamespace(pending=("launched", {"w": 1}, Beside(fails, torch.device("cpu"), None)),
                                 log=lines.append, _deferred=lambda weights: ("deferred", weights))
    Evaluator.interrupt(host)
    assert lines == ["eval: the BLEU pass beside training failed as the run stopped (RuntimeError: CUDA out of "
                     "memory); its evaluation stays pending for the resumed run"]
    assert host.pending == ("launched", {"w": 1}, ("deferred", {"w": 1}))


def test_a_pass_decoded_on_the_loop_at_collection_obeys_the_loops_stop_rule():
    """A resumed run's pending evaluation (or one a signal cut) is decoded on the loop when collected:
    with the loop's stop rule (a signal, --time-limit), not to its end however long it takes."""
    import types

    from streamnmt.training.async_bleu import Deferred
    from streamnmt.training.evaluator import Evaluation

    seen = []

    def decode(stop):
        seen.append(stop)
        return 30.0, 1.0, 2 if stop is not None and stop() else 3  # cut at 2 of 3 sentences

    decided = []
    host = types.SimpleNamespace(pending=(Evaluation(2.0, None, 0.0, False, step=7), {}, Deferred(decode)),
                                 running=False, _pairs=[1, 2, 3],
                                 _decide=lambda step, val, bleu, n, asked: decided.append((step, bleu, n, asked)))
    rule = lambda: True  # noqa: E731 - the time limit says stop
    done, _ = Evaluator.collect(host, wait=True, stop=rule)
    assert seen == [rule] and decided == [(7, 30.0, 2, 3)] and done.bleu_n == 2 and host.pending is None
