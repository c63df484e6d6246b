"""When a run evaluates (``--eval-every``; its time rule keeps evaluation a bounded share of the
run) and how long the end of a time-limited run keeps for its last evaluation."""

from __future__ import annotations

from typing import Any

COST_RATIO = 9.0  # training seconds per second of evaluation: evaluation at most 1 / (1 + COST_RATIO) of the run
FIRST_EVAL_S = 60.0  # the first evaluation, when no epoch has ended sooner (its cost is not known yet)
MIN_INTERVAL_S = 10.0  # mid-epoch: never closer than this (a near-free evaluation would run every step)
END_COST_WINDOW = 3  # the end keeps time for the longest of this many last evaluations (Cadence.end_cost_s)


class Cadence:
    """When the next evaluation is due. ``every``: None = the time rule (``auto``), 0 = epoch
    ends only, N = every N optimizer steps and at epoch ends. Training time is added by the loop
    (:meth:`trained`); :meth:`done` records what an evaluation cost."""

    @classmethod
    def of_run(cls, run: Any) -> Cadence:
        """``--eval-every`` of ``run`` (a RunConfig). With ``--time-limit`` the first evaluation
        comes early enough that the end of the run can keep time for the last one (its cost is
        then known)."""
        limit = run.time_limit_s()
        return cls(run.eval_steps(), first_after_s=min(FIRST_EVAL_S, 0.1 * limit) if limit else FIRST_EVAL_S)

    @property
    def counted(self) -> bool:
        """Due by step count (``--eval-every N`` or 0): every rank decides alike, without a collective."""
        return self.every is not None

    def __init__(self, every: int | None, ratio: float = COST_RATIO, first_after_s: float = FIRST_EVAL_S,
                 min_interval_s: float = MIN_INTERVAL_S):
        self.every, self.ratio = every, ratio
        self.first_after_s, self.min_interval_s = first_after_s, min_interval_s
        self.since_s = 0.0  # training seconds since the last evaluation
        self.cost_s: float | None = None  # what the last evaluation cost
        self.costs: list[float] = []  # the last END_COST_WINDOW evaluations' costs, this process's first left out
        self.ended = 0  # evaluations this process has ended

    def trained(self, seconds: float) -> None:
        self.since_s += seconds

    def due(self, step: int, epoch_end: bool) -> bool:
        if self.every is not None:
            return epoch_end or (self.every > 0 and step % self.every == 0)
        if self.cost_s is None:
            return epoch_end or self.since_s >= self.first_after_s
        wait = self.ratio * self.cost_s
        return self.since_s >= (wait if epoch_end else max(wait, self.min_interval_s))

    def due_mid_epoch(self, step: int, dist: Any) -> tuple[bool, bool]:
        """After a step mid-epoch: (due, ask). ``due``: evaluate now, where every rank decides alike
        (one process, or a step count); ``ask``: rank 0's time rule, which several ranks must agree
        on (the ranks' clocks differ a little) before it counts. ``dist``: the loop's process group."""
        if not dist.active:
            return self.due(step, epoch_end=False), False
        return (self.counted and self.due(step, epoch_end=False),
                dist.main and not self.counted and self.due(step, epoch_end=False))

    def due_at_epoch_end(self, step: int, dist: Any) -> bool:
        """Evaluate at this epoch end? Several ranks and the time rule: rank 0's clock decides (the
        ranks' clocks differ a little and they must agree). ``dist``: the loop's process group."""
        due = self.due(step, epoch_end=True)
        if not dist.active or self.counted:
            return due
        return dist.broadcast(due, "dist.cadence")

    def done(self, cost_s: float, restart: bool = True) -> None:
        """An evaluation cost ``cost_s``; ``restart``: count the training since from now (a pass
        beside training restarted the count when it started: :meth:`started`)."""
        self.cost_s = cost_s
        if self.ended:  # not this process's first: that one paid for its graphs' captures
            self.costs = [*self.costs, cost_s][-END_COST_WINDOW:]
        self.ended += 1
        if restart:
            self.since_s = 0.0

    @property
    def end_cost_s(self) -> float | None:
        """What the end of a time-limited run keeps for its last evaluation: the longest of the last
        ``END_COST_WINDOW`` (a BLEU pass's cost moves with what the model decodes, and a pass that
        outlasts its reserve is cut and not compared for best.pt), the process's first left out (it
        captured its graphs), else the last cost or the pacing estimate."""
        return max(self.costs) if self.costs else self.cost_s

    def started(self, estimate_s: float | None = None) -> None:
        """An evaluation started beside training: its cost is known when it ends (:meth:`done`);
        ``estimate_s``, what it is expected to cost, paces the next one until then."""
        self.since_s = 0.0
        if estimate_s is not None:
            self.cost_s = estimate_s

    def state_dict(self) -> dict[str, Any]:
        return {"since_s": self.since_s, "cost_s": self.cost_s, "costs": list(self.costs)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.since_s, self.cost_s = state["since_s"], state["cost_s"]
            # a checkpoint written before the window: its last cost alone
            self.costs = list(state.get("costs", [] if self.cost_s is None else [self.cost_s]))
