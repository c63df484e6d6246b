"""``--lr-cooldown``: where the learning rate starts falling linearly to zero, and where it gets there.

The Noam schedule decays with the inverse square root of the step and never ends; a run that stops
at a step or a time still trains at a rate far from zero. A cool-down over the last share of the run
(the warm-up / stable / decay schedules of Hägele et al. 2024, "Scaling Laws and Compute-Optimal
Training Beyond Fixed Training Durations") lands the weights where a fixed budget ends instead.

Where the run's end is a step count (``--max-steps``, or ``--epochs`` on a known loader) the plan is
known before the first step, and a resumed run plans it again the same way. Where ``--time-limit``
ends it, the end is a time: the cool-down starts once what is left of the training time (the limit
less the end's reserve, :meth:`Trainer.reserve`) is the given share of the loop's time, and its end
step is what is left times the steps a second the loop has run so far. The rate is measured, so the
time limit may stop the run a little before the planned end (the rate is not yet zero there); where
the loop runs faster than measured, the run stops at the planned end, with time left (steps at rate
zero leave the weights as they are; only the moving average, ``--ema``, would still move toward
them). A plan whose end is the run's own last step (the step count came first) is a step-count
plan: the run ends there as it would have. A resumed time-limited run has a time slot of its own and
plans again in it. Several ranks: rank 0's clock decides, and every rank plans the same step
(:meth:`Trainer._after_step`), since each rank's Adam applies its own learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamnmt.config import EPOCHS_UNLIMITED
from streamnmt.training.step import NoamSchedule
from streamnmt.training.stopping import TimeBudget


class Cooldown:
    """The plan of ``share`` (``--lr-cooldown``) for a run that ends at its ``budget``'s time limit or
    at optimizer step ``end_step`` (``--max-steps`` or the epochs' steps; None: not a step count),
    whichever comes first; ``schedule`` carries it to the device."""

    def __init__(self, share: float, schedule: NoamSchedule, budget: TimeBudget, *, end_step: int | None,
                 log: Callable[[str], None] = print):
        if not 0.0 < share < 1.0:
            raise ValueError(f"a cool-down's share is in (0, 1); got {share}")
        if budget.limit_s is None and end_step is None:
            raise ValueError("a cool-down needs the run's end: a time limit or a step count")
        self.share, self.schedule, self.budget, self.log = share, schedule, budget, log
        self.end_step = end_step
        self.step0, self.e0 = 0, 0.0  # where the loop started (step, budget seconds)
        # planned by the time rule to end before the run's step count does (the run stops at its end);
        # a step-count plan ends where the run does
        self.timed = False

    @property
    def planned(self) -> bool:
        return self.schedule.cooldown is not None

    @property
    def step_start(self) -> int | None:
        """The step the cool-down starts at by the step count (None: no step end)."""
        if self.end_step is None:
            return None
        return min(int(self.end_step * (1.0 - self.share)), self.end_step - 1)

    def begin(self, step: int) -> None:
        """The loop starts after ``step`` optimizer steps. A run that ends at a step count alone is
        planned here."""
        self.step0, self.e0 = step, self.budget.elapsed()
        if self.budget.limit_s is None and not self.planned and self.end_step is not None and self.end_step >= 1:
            self.start(max(self.step_start, 0), self.end_step, f"the last {self.share:.0%} of {self.end_step} steps")

    def finished(self, step: int) -> bool:
        """Optimizer step ``step`` was a time plan's last, before the run's step count ends it: the
        rate is zero from the next, so a run the time limit would stop later stops here (the loop ran
        faster than the rate the plan was made from)."""
        return (self.timed and self.planned and step >= self.schedule.cooldown[1] - 1
                and (self.end_step is None or step < self.end_step))

    def retarget(self, last: int) -> None:
        """The run's last epoch starts and its length is known: the run's last step is ``last`` (packed
        epochs differ by a few batches from the first, which the plan was made from). Called before
        the epoch's first batch, after the previous epoch's drain: no step in flight reads the plan
        as it changes (:meth:`NoamSchedule.plan`). A plan by the step count keeps its start and moves
        its end; one by the time limit ends no later."""
        if self.end_step is None or last == self.end_step:
            return
        self.end_step = last
        if self.planned:
            start, end = self.schedule.cooldown
            if (not self.timed or last + 1 < end) and last + 1 > start:
                self.schedule.plan(start, last + 1)
                self.timed = False  # it ends where the run does now

    def due(self, step: int, reserve_s: float) -> bool:
        """After optimizer step ``step``, the end keeping ``reserve_s`` seconds: start cooling down now?
        (A run with a time limit; host arithmetic only.)"""
        limit = self.budget.limit_s
        if self.planned or limit is None or step <= self.step0:
            return False
        if self.step_start is not None and step >= self.step_start:
            return True
        span = limit - reserve_s - self.e0  # the loop's training time
        return limit - reserve_s - self.budget.elapsed() <= self.share * span

    def end_estimate(self, step: int, reserve_s: float) -> int:
        """The step the time limit will stop after, at the loop's rate so far (at most the step end)."""
        elapsed = self.budget.elapsed()
        left = max(self.budget.limit_s - reserve_s - elapsed, 0.0)
        rate = (step - self.step0) / max(elapsed - self.e0, 1e-9)  # steps a second, pauses included
        end = step + max(round(left * rate), 1)
        return min(end, self.end_step) if self.end_step is not None and self.end_step > step else end

    def agree(self, step: int, reserve_s: float, dist: Any) -> None:
        """Plan from ``step`` to rank 0's :meth:`end_estimate` on every rank of ``dist`` (all call this
        after the same step; one exchange)."""
        end = self.end_estimate(step, reserve_s) if dist.main else None
        # Needed: each rank's Adam applies its own learning rate, so every rank takes rank 0's end.
        end = dist.broadcast(end, "dist.cooldown") if dist.active else end
        self.timed = self.end_step is None or end < self.end_step  # else the step count ends the run there
        self.start(step, end, f"about {self.budget.limit_s - self.budget.elapsed():.0f} s of --time-limit left")

    def start(self, step: int, last: int, why: str = "") -> None:
        """Cool down from ``step`` so that the rate reaches zero just after step ``last``, the run's
        last (which still trains, at a rate one step above zero); every rank: the same two numbers."""
        self.schedule.plan(step, last + 1)
        lr = self.schedule.lr_at(step)
        self.log(f"lr: cool-down from step {step} (lr {lr:.2e}), linearly to 0 just after step {last} "
                 f"(--lr-cooldown {self.share:g}{': ' + why if why else ''})")


def steps_of_run(max_steps: int | None, epochs: int, batches_per_epoch: int, accum: int) -> int | None:
    """The optimizer steps a run ends at by its step count: ``max_steps``, or ``epochs`` epochs of
    ``batches_per_epoch`` micro-batches (``accum`` a step, the last of an epoch ending one), the
    smaller; None where neither bounds it (``epochs`` is ``EPOCHS_UNLIMITED``)."""
    by_epochs = None if epochs >= EPOCHS_UNLIMITED else epochs * -(-batches_per_epoch // max(accum, 1))
    ends = [n for n in (max_steps or None, by_epochs) if n is not None]
    return min(ends) if ends else None
