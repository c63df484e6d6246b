"""Graph mode against the eager engine, on a CUDA device (``pytest -m gpu``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from streamnmt.data import Batch
from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from streamnmt.models.transformer import make_model
from streamnmt.training.step import example_batch, make_step
from tests.engine.test_engine import run_collect, run_without_host_syncs

pytestmark = pytest.mark.gpu
SHAPES = [(16, 16, 16), (16, 24, 24)]


def random_batches(n: int, seed: int = 0, src_vocab: int = 200, tgt_vocab: int = 220) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, s, t = SHAPES[i % len(SHAPES)]
        src = torch.randint(4, src_vocab, (b, s), generator=g)
        tgt = torch.randint(4, tgt_vocab, (b, t + 1), generator=g)
        for r in range(b):  # right padding of random length
            src[r, int(torch.randint(s // 2, s + 1, (1,), generator=g)):] = 0
            tgt[r, int(torch.randint(t // 2, t + 2, (1,), generator=g)):] = 0
        tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
        out.append(Batch(src=src.pin_memory(), tgt_in=tgt_in.pin_memory(), tgt_out=tgt_out.pin_memory(),
                         ntokens=int((tgt_out != 0).sum()), src_tokens=int((src != 0).sum())))
    return out


def with_global_norm(batches: list[Batch], accum: int) -> list[Batch]:
    """Each run of ``accum`` batches is one optimizer step: normalise by the tokens of all of them."""
    out = []
    for i in range(0, len(batches), accum):
        group = batches[i:i + accum]
        total = sum(b.ntokens for b in group)
        norm = torch.tensor(1.0 / total, dtype=torch.float32).pin_memory()
        out += [dataclasses.replace(b, norm=norm, norm_tokens=total) for b in group]
    return out


def train(strategy: str, amp: str, steps: int = 100, dropout: float = 0.1, accum: int = 1):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=dropout).to(dev)
    step = make_step(model, dev, d_model=64, warmup=50, amp=amp)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy, accum_steps=accum), log=lambda s: None)
    strat.prepare(step, [example_batch(s, model.shape, 0) for s in SHAPES])
    if strategy == "graph":
        assert strat.fallback is None and strat.report["shapes"] == len(SHAPES)
    torch.manual_seed(1)  # same dropout stream for both runs
    batches = with_global_norm(random_batches(steps * accum), accum)  # as the loader's, with a normaliser
    got = run_collect(strat, batches, step, DeferredLosses(dev, 10, group=accum))
    return [v for _, v in got], [p.detach().float().cpu() for p in model.parameters()]


@pytest.mark.parametrize("amp,tol", [("off", 1e-5), ("bf16", 2e-2)])
def test_graph_matches_eager(amp, tol):
    eager, w_eager = train("full", amp)
    graph, w_graph = train("graph", amp)
    assert len(graph) == len(eager) == 100
    rel = max(abs(a - b) / abs(b) for a, b in zip(graph, eager))
    assert rel <= tol, rel
    for a, b in zip(w_graph, w_eager):
        assert (a - b).norm() <= tol * max(b.norm(), 1e-6)
    assert eager[-1] < eager[0]  # it trained


def test_graph_accumulation_matches_eager():
    """--accum-steps 2 in graph mode (micro-step graphs + one optimizer graph) equals eager, fp32."""
    eager, w_eager = train("full", "off", steps=60, accum=2)
    graph, w_graph = train("graph", "off", steps=60, accum=2)
    assert len(graph) == len(eager) == 60
    rel = max(abs(a - b) / abs(b) for a, b in zip(graph, eager))
    assert rel <= 1e-5, rel
    for a, b in zip(w_graph, w_eager):
        assert (a - b).norm() <= 1e-5 * max(b.norm(), 1e-6)
    plain, _ = train("full", "off", steps=60)
    assert plain != pytest.approx(eager, rel=1e-3)  # accumulation changed the training


def test_graph_accumulation_has_no_hidden_syncs():
    dev = torch.device("cuda")
    model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128).to(dev)
    step = make_step(model, dev, d_model=64, warmup=50, amp="bf16")
    strat = make_strategy("graph", dev, EngineConfig(sync_strategy="graph", accum_steps=2), log=lambda s: None)
    strat.prepare(step, [example_batch(s, model.shape, 0) for s in SHAPES])
    assert strat.fallback is None and strat.opt_graph is not None
    got = run_without_host_syncs(strat, with_global_norm(random_batches(40), 2), step, DeferredLosses(dev, 10, group=2))
    assert [s for s, _ in got] == list(range(1, 21))


def test_graph_fp16_scaler_runs():
    losses, _ = train("graph", "fp16", steps=30)
    assert len(losses) == 30 and all(v == v for v in losses)


def test_graph_has_no_hidden_syncs():
    dev = torch.device("cuda")
    model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128).to(dev)
    step = make_step(model, dev, d_model=64, warmup=50, amp="bf16")
    strat = make_strategy("graph", dev, EngineConfig(sync_strategy="graph"), log=lambda s: None)
    strat.prepare(step, [example_batch(s, model.shape, 0) for s in SHAPES])
    losses = DeferredLosses(dev, 10)
    batches = with_global_norm(random_batches(40), 1)
    got = run_without_host_syncs(strat, batches, step, losses)
    assert len(got) == 40
