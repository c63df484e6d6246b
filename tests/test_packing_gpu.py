"""Packed batches on a CUDA device (``pytest -m gpu``): graph mode == eager, flex == sdpa, no syncs."""

from __future__ import annotations

import pytest
import torch

from streamnmt.models import masks
from streamnmt.data.packbatch import collate_packed
from streamnmt.data.packing import PackSampler
from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from streamnmt.models.transformer import make_model
from streamnmt.training.step import example_batch, make_step
from tests.data.test_packing import random_corpus
from tests.engine.test_engine import run_collect, run_without_host_syncs

pytestmark = pytest.mark.gpu
SHAPE = (8, 48, 32)


def packed_batches(n: int, seed: int = 0):
    c = random_corpus(600, seed=seed, longest=14)
    s = PackSampler(c.src_lengths, c.tgt_lengths, SHAPE, shuffle=True, seed=seed)
    plans = (s.plan(0) * (n // len(s.plan(0)) + 1))[:n]
    return [collate_packed(c, p).pin_memory() for p in plans]


def train(strategy: str, amp: str = "off", attention: str = "sdpa", steps: int = 60, dropout: float = 0.0):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = make_model(60, 60, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=dropout).to(dev)
    model.set_attention(attention)
    step = make_step(model, dev, d_model=64, warmup=50, amp=amp)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy), log=lambda s: None)
    strat.prepare(step, [example_batch(SHAPE, model.shape, 0, packed=True)])
    if strategy == "graph":
        assert strat.fallback is None and strat.report["shapes"] == 1
    torch.manual_seed(1)
    got = run_collect(strat, packed_batches(steps), step, DeferredLosses(dev, 10))
    return [v for _, v in got], [p.detach().float().cpu() for p in model.parameters()]


def assert_same(a, b, tol):
    (la, wa), (lb, wb) = a, b
    assert len(la) == len(lb) > 0
    rel = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    assert rel <= tol, rel
    for x, y in zip(wa, wb):
        assert (x - y).norm() <= tol * max(y.norm(), 1e-6)
    assert lb[-1] < lb[0]  # it trained


def test_packed_graph_matches_eager_fp32():
    assert_same(train("graph"), train("full"), 1e-5)


def test_packed_graph_has_no_hidden_syncs():
    dev = torch.device("cuda")
    model = make_model(60, 60, d_model=64, n_layers=2, n_heads=4, d_ff=128).to(dev)
    step = make_step(model, dev, d_model=64, warmup=50, amp="bf16")
    strat = make_strategy("graph", dev, EngineConfig(sync_strategy="graph"), log=lambda s: None)
    strat.prepare(step, [example_batch(SHAPE, model.shape, 0, packed=True)])
    assert len(run_without_host_syncs(strat, packed_batches(30), step, DeferredLosses(dev, 10))) == 30


def test_flex_equals_sdpa_forward_and_gradients():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = make_model(60, 60, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0).to(dev)
    b = packed_batches(1)[0].to(dev)
    out = {}
    for kind in ("sdpa", "flex"):
        model.set_attention(kind)
        model.zero_grad()
        logits = model(b.src, b.tgt_in, masks.src_mask(b.src), segments=b.segments())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=0)
        loss.backward()
        out[kind] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(out["flex"][0], out["sdpa"][0], atol=1e-4, rtol=1e-4)
    for gf, gs in zip(out["flex"][1], out["sdpa"][1]):
        torch.testing.assert_close(gf, gs, atol=1e-4, rtol=1e-3)


def test_flex_graph_matches_flex_eager():
    assert_same(train("graph", attention="flex", steps=30), train("full", attention="flex", steps=30), 1e-4)
