"""--lr-cooldown: the schedule's linear fall to zero on the device, where it is planned (a step count
before the first step, a time limit from the measured rate), and the ranks' one agreement on it."""

from __future__ import annotations

import math

import pytest
import torch

from streamnmt.config import EPOCHS_UNLIMITED, OptimConfig, RunConfig
from streamnmt.errors import ConfigError
from streamnmt.training.cooldown import Cooldown, steps_of_run
from streamnmt.training.recipe import check_cooldown_end
from streamnmt.training.runs import read_csv
from streamnmt.training.step import NoamSchedule, cooldown_scale, noam_lr
from streamnmt.training.stopping import TimeBudget
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)


def schedule() -> NoamSchedule:
    return NoamSchedule(d_model=32, warmup=4, factor=1.0, device=torch.device("cpu"))


def test_the_device_rate_is_noam_then_falls_linearly_to_zero_at_the_plans_end():
    s = schedule()
    seen = []
    for step in range(1, 13):
        if step == 3:
            s.plan(5, 10)  # planned mid-run, as a time limit's cool-down is
        s.advance()
        seen.append(s.lr_t.item())
    for step, lr in enumerate(seen, 1):
        scale = 1.0 if step <= 5 else max((10 - step) / 5, 0.0)
        assert lr == pytest.approx(noam_lr(step, 32, 4, 1.0) * scale, rel=1e-6)
        assert lr == pytest.approx(s.lr_at(step), rel=1e-6, abs=1e-12)  # the host's copy, what steps.csv says
    assert seen[9] == 0.0 and seen[11] == 0.0 and seen[6] < seen[5]


def test_no_plan_keeps_noam_and_a_plan_must_end_after_it_starts():
    s = schedule()
    s.set_step(7)
    assert s.lr_t.item() == pytest.approx(noam_lr(7, 32, 4, 1.0)) and s.lr_at(7) == noam_lr(7, 32, 4, 1.0)
    assert math.isinf(s.end_t.item())
    with pytest.raises(ValueError, match="ends after it starts"):
        s.plan(10, 10)
    assert cooldown_scale(3, None) == 1.0 and cooldown_scale(8, (4, 12)) == 0.5 and cooldown_scale(20, (4, 12)) == 0.0


def test_a_resumed_step_continues_on_the_plan():
    s = schedule()
    s.plan(10, 20)
    s.set_step(15)  # a checkpoint of step 15: the next step is 16
    s.advance()
    assert s.lr_t.item() == pytest.approx(noam_lr(16, 32, 4, 1.0) * 0.4, rel=1e-6)


def test_the_steps_a_run_ends_at():
    assert steps_of_run(None, EPOCHS_UNLIMITED, 10, 1) is None
    assert steps_of_run(None, 3, 10, 1) == 30
    assert steps_of_run(None, 3, 10, 4) == 9  # 10 micro-batches: 3 steps an epoch, the last of 2
    assert steps_of_run(25, 3, 10, 1) == 25 and steps_of_run(40, 3, 10, 1) == 30
    assert steps_of_run(25, EPOCHS_UNLIMITED, 10, 1) == 25


def budget(limit_s: float | None, now: list[float]) -> TimeBudget:
    return TimeBudget(limit_s, clock=lambda: now[0], t0=0.0)


def test_a_step_count_is_planned_before_the_first_step():
    c = Cooldown(0.2, schedule(), budget(None, [3.0]), end_step=100, log=lambda _: None)
    c.begin(0)
    assert c.schedule.cooldown == (80, 101)  # the last step, 100, still trains (at 1/21 of the rate)
    c = Cooldown(0.2, schedule(), budget(60.0, [3.0]), end_step=100, log=lambda _: None)
    c.begin(0)
    assert not c.planned  # a time limit may come first: planned in the loop
    with pytest.raises(ValueError, match="needs the run's end"):
        Cooldown(0.2, schedule(), budget(None, [0.0]), end_step=None)


def test_a_time_limit_starts_the_cool_down_at_its_share_of_the_loops_time():
    """Limit 100 s, the loop from 10 s, the end keeping 0 s: share 0.2 of 90 s starts at 82 s; the end
    step is what is left at the rate so far (10 steps a second), capped by a step end."""
    now = [10.0]
    c = Cooldown(0.2, schedule(), budget(100.0, now), end_step=None, log=lambda _: None)
    c.begin(0)
    now[0] = 81.0
    assert not c.due(700, 0.0)
    now[0] = 82.0
    assert c.due(720, 0.0) and c.end_estimate(720, 0.0) == 900
    now[0] = 80.0
    assert c.due(700, 3.0) and not c.due(700, 0.0)  # what the end keeps brings it forward
    c.end_step = 850
    now[0] = 82.0
    assert c.end_estimate(720, 0.0) == 850
    c.end_step = 1000
    now[0] = 50.0
    assert c.due(800, 0.0) and not c.due(799, 0.0)  # the step count's share came first
    c.start(720, 900)
    now[0] = 90.0
    assert not c.due(730, 0.0)  # planned once


def test_a_run_with_no_end_refuses_a_cool_down():
    run = RunConfig(epochs=EPOCHS_UNLIMITED)
    with pytest.raises(ConfigError, match="--lr-cooldown 0.2: the run has no end"):
        check_cooldown_end(OptimConfig(lr_cooldown=0.2), run)
    check_cooldown_end(OptimConfig(lr_cooldown=0.2), RunConfig(epochs=EPOCHS_UNLIMITED, time_limit="10m"))
    check_cooldown_end(OptimConfig(), run)
    with pytest.raises(ConfigError, match="--lr-cooldown"):
        OptimConfig(lr_cooldown=1.0)


def test_a_max_steps_run_trains_its_last_steps_on_the_fall(tmp_path, monkeypatch):
    """--max-steps 10, share 0.5: from step 5 the rate falls by a sixth a step, the last step at a
    sixth of Noam's; the rate the optimizer read (the device's, recorded at each step) and steps.csv's."""
    device_lr: dict[int, float] = {}
    advance = NoamSchedule.advance

    def record(self):
        advance(self)
        device_lr[int(self.step_t.item())] = self.lr_t.item()

    monkeypatch.setattr(NoamSchedule, "advance", record)
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "m", "--max-steps", "10", "--lr-cooldown", "0.5", "--eval-every", "0",
                     lines=lines)
    t.train()
    lr = {int(r["step"]): float(r["lr"]) for r in read_csv(tmp_path / "m" / "steps.csv")}
    s = t.train_step.schedule
    assert s.cooldown == (5, 11) and sorted(lr) == list(range(1, 11))
    for step, scale in ((4, 1.0), (5, 1.0), (8, 0.5), (10, 1 / 6)):
        want = noam_lr(step, s.d_model, s.warmup, s.factor) * scale
        assert lr[step] == pytest.approx(want) and device_lr[step] == pytest.approx(want, rel=1e-6)
    assert any(line.startswith("lr: cool-down from step 5") for line in lines)


def test_the_last_epoch_moves_the_end_to_its_own_length():
    """Packed epochs differ a little in length: the plan from the first epoch's count keeps its start
    and ends after the last epoch's last step; a time limit's plan only ends sooner."""
    c = Cooldown(0.2, schedule(), budget(None, [0.0]), end_step=100, log=lambda _: None)
    c.begin(0)
    c.retarget(97)
    assert c.schedule.cooldown == (80, 98) and c.end_step == 97
    t = Cooldown(0.2, schedule(), budget(60.0, [0.0]), end_step=130, log=lambda _: None)
    t.start(70, 110)
    t.timed = True  # as agree() marks a time plan that ends before the step count
    t.retarget(120)
    assert t.schedule.cooldown == (70, 111) and t.timed  # the time limit comes first
    t.retarget(105)
    assert t.schedule.cooldown == (70, 106) and t.end_step == 105 and not t.timed  # the run's own end now


def test_a_time_limited_run_cools_down_to_about_its_last_step(tmp_path):
    """A fake clock of 1 s a step and a 40-s limit: the cool-down starts in the last quarter of the
    loop's time and its planned end is within a few steps of the step the limit stops after."""
    t = make_trainer(tmp_path, "--name", "t", "--time-limit", "40s", "--lr-cooldown", "0.25", "--eval-every", "0",
                     "--epochs", "100")
    t.clock = t.budget.clock = lambda: float(t.global_step)
    t.budget.t0 = 0.0
    result = t.train()
    plan = t.train_step.schedule.cooldown
    assert plan is not None
    start, end = plan
    assert 25 <= start <= 34 and abs(end - 1 - result["steps"]) <= 3
    assert t.train_step.schedule.lr_at(result["steps"]) < 0.25 * t.train_step.schedule.lr_at(start)


def test_a_loop_faster_than_measured_stops_at_the_plans_end_with_time_left(tmp_path):
    """The plan's end comes from the rate measured so far; where the loop then runs faster (here 1 s a
    step until the plan, 0.5 s after), the run stops after the plan's last step, not at the limit:
    steps at rate zero would leave the weights as they are."""
    t = make_trainer(tmp_path, "--name", "f", "--time-limit", "40s", "--lr-cooldown", "0.25", "--eval-every", "0",
                     "--epochs", "100")
    at: list[int] = []

    def clock() -> float:
        plan = t.train_step.schedule.cooldown
        if plan is None:
            return float(t.global_step)
        if not at:
            at.append(t.global_step)
        return at[0] + 0.5 * (t.global_step - at[0])

    t.clock = t.budget.clock = clock
    t.budget.t0 = 0.0
    result = t.train()
    start, end = t.train_step.schedule.cooldown
    assert start == at[0] and result["steps"] == end - 1 and t.budget.elapsed() < 40 - 3
    assert t.stop_reason(result["steps"]) == f"--lr-cooldown: the learning rate reached 0 after step {end - 1}"


@pytest.mark.parametrize("end", [["--epochs", "3"], ["--epochs", "100", "--max-steps", "20"]])
def test_a_time_limited_run_that_its_step_count_ends_first_ends_as_it_would_have(tmp_path, end):
    """A time limit far off and a step count that ends the run first: the time rule plans at the
    step count's start, its end capped at the run's last step; the run is not stopped early by the
    plan's end but ends at its step count, its last epoch's row written."""
    t = make_trainer(tmp_path, "--name", "e", "--time-limit", "1000s", "--lr-cooldown", "0.25", "--eval-every", "0",
                     *end)
    t.clock = t.budget.clock = lambda: float(t.global_step)
    t.budget.t0 = 0.0
    result = t.train()
    steps = 20 if "--max-steps" in end else 3 * len(t.train_loader)
    assert result["steps"] == steps and not result["stopped"]
    assert t.train_step.schedule.cooldown[1] == steps + 1 and not t.cooldown.timed
    rows = read_csv(tmp_path / "e" / "results.csv")
    assert int(rows[-1]["steps"]) == steps and ("--max-steps" in end or int(rows[-1]["epoch"]) == 3)


@pytest.mark.parametrize("main", [True, False])
def test_several_ranks_plan_rank0s_end_at_the_same_agreed_step(tmp_path, main):
    """Rank 0's clock decides: its due goes into the step's one agreement, and every rank plans the
    end rank 0 sends (one exchange); the other rank's own clock puts nothing in."""
    t = make_trainer(tmp_path, "--name", "r", "--time-limit", "100s", "--lr-cooldown", "0.2")
    k = t.job.engine.sync_interval
    sent: list[tuple] = []

    class Ranks:
        active, world = True, 2

        def agree_any(self, flags, site="dist.stop", long_wait=False):
            sent.append(tuple(flags))
            return (False, False, True)  # rank 0 said: cool down

        def broadcast(self, obj, site="dist.broadcast"):
            assert site == "dist.cooldown" and (obj is not None) is main
            return 5 * k  # rank 0's end

    Ranks.main = main
    t.dist = Ranks()
    t.evaluator.cadence.due = lambda step, epoch_end: False
    t.cooldown.due = lambda step, reserve_s: True  # this rank's own clock says due
    t.global_step = k + 1
    t._after_step()
    assert sent == [] and not t.cooldown.planned  # not an agreement step
    t.global_step = 2 * k
    t._after_step()
    assert sent == [(False, False, main)]
    assert t.train_step.schedule.cooldown == (2 * k, 5 * k + 1)  # rank 0's last step, then zero


@pytest.mark.gpu
def test_a_captured_step_reads_a_plan_made_after_its_capture(tmp_path, monkeypatch):
    """On CUDA the step is a CUDA graph captured before the loop plans the cool-down: the graph's
    learning rate must follow the plan (the plan is written into the tensors it reads)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine: pytest -m gpu)")
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    t = make_trainer(tmp_path, "--name", "g", "--device", "cuda", "--max-steps", "12", "--lr-cooldown", "0.5",
                     "--eval-every", "0", "--sync-strategy", "graph")
    assert t.strategy.name == "graph"
    t.train()
    s = t.train_step.schedule
    assert s.cooldown == (6, 13) and s.step_t.item() == 12.0
    # the rate the replayed graph computed for its last step: a seventh of Noam's, as the plan says
    assert s.lr_t.item() == pytest.approx(noam_lr(12, s.d_model, s.warmup, s.factor) / 7, rel=1e-5)
