"""Engine tests on a small non-NMT model: the engine drives any step function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from streamnmt.engine import (STATS, STRATEGIES, DeferredLosses, EngineConfig, StreamManager, host_sync,
                              make_strategy)


class Regression:
    """A StepFunction for an MLP regression: proves the engine is not tied to NMT."""

    def __init__(self, device: torch.device, seed: int = 0):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1)).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.micro: list[bool] = []  # begin_micro's flags, in order
        self.opt_steps = 0

    def begin_micro(self, last):
        self.micro.append(last)

    def forward(self, batch):
        x, y = batch
        return ((self.model(x).squeeze(-1) - y) ** 2).mean()

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        self.opt_steps += 1
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=g)
        out.append((x, x.sum(-1).sin()))
    return out


def run_collect(strat, batches, step, losses) -> list[tuple[int, float]]:
    """Run ``strat`` over ``batches`` and return every (step, loss), as a trainer would."""
    got = []
    for _ in strat.run(batches, step, losses):
        got += losses.poll()
    strat.drain("test.drain")
    return got + losses.flush()


def run_without_host_syncs(strat, batches, step, losses) -> list[tuple[int, float]]:
    """``run_collect`` with any host sync outside ``host_sync`` raising (CUDA only)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run_collect(strat, batches, step, losses)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def train(strategy: str, device: str, n: int = 23, interval: int = 10, seed: int = 0, accum: int = 1,
          step_out: list | None = None, streams: int | None = None):
    dev = torch.device(device)
    step = Regression(dev, seed)
    losses = DeferredLosses(dev, interval, group=accum)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy, sync_interval=interval, streams=streams,
                                                      loss_interval=interval, accum_steps=accum), log=lambda s: None)
    got = run_collect(strat, make_batches(n), step, losses)
    if step_out is not None:
        step_out.append(step)
    return got, [p.detach().cpu().clone() for p in step.model.parameters()]


SEED_STRATEGIES = ["baseline", "event", "interval", "deep", "full"]
# (strategy, --streams): every seed strategy, and deep and full with the 3-stream layout too
SCHEDULES = [(s, None) for s in SEED_STRATEGIES] + [("deep", 3), ("full", 3)]


def test_stream_manager_limits():
    for bad in (0, 9):
        with pytest.raises(ValueError, match="allowed 1 to 8"):
            StreamManager("cpu", bad)
    sm = StreamManager("cpu", 4)
    ev = sm.event()
    sm.record(ev, 0)
    sm.wait(ev, 3)
    assert sm.query(ev) is True
    with sm.use(2):
        t = torch.ones(3) * 2
    assert t.sum().item() == 6


def test_host_sync_counts_per_site():
    STATS.reset()
    assert host_sync("a", lambda: 5) == 5
    host_sync("a", lambda: None)
    host_sync("b", lambda: None)
    snap = STATS.reset()
    assert snap["a"]["count"] == 2 and snap["b"]["count"] == 1
    assert snap["a"]["max_ms"] >= snap["a"]["mean_ms"] >= 0
    assert STATS.snapshot() == {}


@pytest.mark.parametrize("n,interval", [(1, 10), (10, 10), (23, 10), (7, 3)])
def test_deferred_losses_each_step_once_in_order(n, interval):
    losses = DeferredLosses("cpu", interval)
    got = []
    for s in range(1, n + 1):
        losses.push(s, torch.tensor(float(s) / 7))
        got += losses.poll()
    got += losses.flush()
    assert [s for s, _ in got] == list(range(1, n + 1))
    assert [v for _, v in got] == [torch.tensor(float(s) / 7).item() for s in range(1, n + 1)]
    assert losses.flush() == []


def test_registry_has_the_seed_strategies():
    assert set(SEED_STRATEGIES) <= set(STRATEGIES)
    assert STRATEGIES["deep"].n_streams == 4 and STRATEGIES["baseline"].n_streams == 2
    assert STRATEGIES["full"].wants_workers


@pytest.mark.parametrize("strategy,streams", SCHEDULES[1:])
def test_strategies_equal_baseline_bitwise_on_cpu(strategy, streams):
    ref_losses, ref_params = train("baseline", "cpu")
    losses, params = train(strategy, "cpu", streams=streams)
    assert [s for s, _ in losses] == list(range(1, 24))
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_losses_depend_on_the_seed():
    # guards the equality test above against comparing two constant sequences
    a, _ = train("baseline", "cpu", seed=0)
    b, _ = train("baseline", "cpu", seed=1)
    assert a != b


def test_run_stops_early_without_losing_losses():
    dev = torch.device("cpu")
    step, losses = Regression(dev), DeferredLosses(dev, 10)
    strat = make_strategy("full", dev, EngineConfig())
    got = []
    for info in strat.run(make_batches(30), step, losses):
        got += losses.poll()
        if info.step == 13:
            break
    got += losses.flush()
    assert [s for s, _ in got] == list(range(1, 14))


@pytest.mark.parametrize("strategy", SEED_STRATEGIES + ["graph"])  # graph: its CPU fallback
def test_accumulation_in_every_strategy(strategy):
    """23 micro-batches, 3 per optimizer step: 8 steps (the last of 2), one loss each (the sum of
    its micro-batches'), the same in every strategy; gradients all-reduce only on a step's last."""
    ref, ref_params = train("baseline", "cpu", accum=3)
    steps: list = []
    got, params = train(strategy, "cpu", accum=3, step_out=steps)
    assert [s for s, _ in got] == list(range(1, 9))
    assert got == ref and all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert steps[0].opt_steps == 8
    assert steps[0].micro == [False, False, True] * 7 + [False, True]
    fresh = Regression(torch.device("cpu"))  # step 1 = the sum of 3 micro losses at the initial weights
    assert got[0][1] == pytest.approx(sum(fresh.forward(b).item() for b in make_batches(3)), rel=1e-6)
    plain, _ = train("baseline", "cpu")
    assert got[1][1] != pytest.approx(sum(v for _, v in plain[3:6]), rel=1e-3)  # later steps: fewer updates


def test_engine_imports_run_one_way():
    """base <- strategies <- graphs: no module imports one above it."""
    import ast
    import importlib

    def engine_imports(name):
        tree = ast.parse(open(importlib.import_module(f"streamnmt.engine.{name}").__file__).read())
        return {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("streamnmt.engine.")}

    assert engine_imports("base") <= {"config", "losses", "streams", "syncstats"}
    assert "graphs" not in engine_imports("strategies")
    assert "base" in engine_imports("graphs") and "base" in engine_imports("strategies")
