"""Deferred losses with named values: several device scalars per step, one buffer, one copy."""

from __future__ import annotations

import pytest
import torch

from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from tests.engine.test_engine import Regression, make_batches, run_collect


def test_named_values_travel_with_the_loss():
    losses = DeferredLosses("cpu", interval=3, values=("nll", "other"))
    got = []
    for step in range(1, 8):
        extra = {"other": torch.tensor(-float(step))} if step % 2 else {}  # left out: counts 0
        losses.push(step, torch.tensor(float(step)), nll=torch.tensor(step / 10), **extra)
        got += losses.poll()
    got += losses.flush()
    assert got == [(s, float(s)) for s in range(1, 8)]  # still (step, loss) pairs
    for rec, s in zip(got, range(1, 8)):
        assert rec.values == pytest.approx({"loss": s, "nll": s / 10, "other": -s if s % 2 else 0.0})


def test_named_values_add_over_micro_batches_and_are_reduced_with_the_loss():
    calls = []

    def reduce(t):
        calls.append(tuple(t.shape))
        t.mul_(2)  # two ranks holding the same values

    losses = DeferredLosses("cpu", interval=2, group=2, reduce=reduce, values=("nll",))
    for step in (1, 2, 3):
        for part in (1.0, 0.5):
            losses.push(step, torch.tensor(step * part), nll=torch.tensor(step * part / 4))
    got = losses.flush()
    assert [r.values for r in got] == [{"loss": 3.0 * s, "nll": 0.75 * s} for s in (1, 2, 3)]
    assert calls == [(2, 2), (1, 2)]  # every column in the one collective of an extraction


def test_only_the_named_values_asked_for_are_kept():
    losses = DeferredLosses("cpu", 2, values=("nll",))
    losses.push(1, torch.tensor(1.0), nll=torch.tensor(0.5), grad_norm=torch.tensor(3.0))
    assert [r.values for r in losses.flush()] == [{"loss": 1.0, "nll": 0.5}]
    plain = DeferredLosses("cpu", 2)
    plain.push(1, torch.tensor(1.0), nll=torch.tensor(0.5))
    assert [r.values for r in plain.flush()] == [{"loss": 1.0}]


def test_clashing_names_are_refused():
    with pytest.raises(ValueError, match="not 'loss'"):
        DeferredLosses("cpu", 2, values=("loss",))


class HalfLoss(Regression):
    """A step that reports a named value (half its loss), updated in place as NMTStep's NLL is."""

    def __init__(self, device):
        super().__init__(device)
        self.values = {"half": torch.zeros((), device=device)}

    def forward(self, batch):
        loss = super().forward(batch)
        self.values["half"].copy_(loss.detach() / 2)
        return loss


@pytest.mark.parametrize("strategy", ["baseline", "event", "interval", "deep", "full", "graph"])
def test_every_strategy_pushes_the_steps_named_values(strategy):
    dev = torch.device("cpu")
    step = HalfLoss(dev)
    losses = DeferredLosses(dev, 4, values=("half",))
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy, sync_interval=4, loss_interval=4),
                          log=lambda s: None)
    got = run_collect(strat, make_batches(9), step, losses)
    assert [s for s, _ in got] == list(range(1, 10))
    for rec in got:
        assert rec.values["half"] == pytest.approx(rec[1] / 2)
