"""The training recipe on a CUDA device (``pytest -m gpu``): EMA and tied embeddings inside graph mode.

The EMA update runs inside ``NMTStep.optimizer_step``, so graph mode captures it with the rest of
the step; its averages must match the eager engine's within 1e-5 (fp32, dropout 0), survive the
graph warm-up (restored with the other state tensors) and cost no host sync.
"""

from __future__ import annotations

import pytest
import torch

from streamnmt.data import Batch
from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from streamnmt.models.transformer import make_model
from streamnmt.training.step import example_batch, make_step
from tests.engine.test_engine import run_collect, run_without_host_syncs
from tests.engine.test_graphs_gpu import SHAPES, random_batches, with_global_norm

pytestmark = pytest.mark.gpu
VOCAB = 200


def batches(n: int, seed: int = 0) -> list[Batch]:
    return random_batches(n, seed, src_vocab=VOCAB, tgt_vocab=VOCAB)  # one vocabulary: --tie-embeddings all


def train(strategy: str, steps: int = 50, tie: str = "none", no_syncs: bool = False, every: int = 1,
          accum: int = 1):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = make_model(VOCAB, VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.0,
                       tie_embeddings=tie).to(dev)
    step = make_step(model, dev, d_model=64, warmup=20, amp="off", label_smoothing=0.1, ema=0.99, ema_every=every)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy, accum_steps=accum), log=lambda s: None)
    init = [s.clone() for s in step.ema.shadow]
    strat.prepare(step, [example_batch(s, model.shape, 0) for s in SHAPES])
    if strategy == "graph":
        assert strat.fallback is None and strat.report["shapes"] == len(SHAPES)
        # the warm-up steps moved the averages; prepare() restored them
        assert all(torch.equal(a, b) for a, b in zip(init, step.ema.shadow))
    run = run_without_host_syncs if no_syncs else run_collect
    data = with_global_norm(batches(steps * accum), accum) if accum > 1 else batches(steps)
    got = run(strat, data, step, DeferredLosses(dev, 10, group=accum))
    torch.cuda.synchronize()
    assert step.updates == steps  # the host's count of updates, replays included
    return ([v for _, v in got], [s.detach().cpu() for s in step.ema.shadow],
            [p.detach().cpu() for p in model.parameters()], model)


@pytest.mark.parametrize("tie, every, accum", [("none", 1, 1), ("all", 1, 1), ("none", 4, 1), ("none", 3, 2)])
def test_ema_in_graph_mode_matches_eager(tie, every, accum):
    """Also with the average updated every 3rd or 4th step (graph mode replays the step, or with
    accumulation the optimizer graph, that carries the update only where it is due)."""
    eager, ema_eager, w_eager, _ = train("full", tie=tie, every=every, accum=accum)
    graph, ema_graph, w_graph, model = train("graph", tie=tie, every=every, accum=accum)
    assert len(graph) == len(eager) == 50
    assert max(abs(a - b) / abs(b) for a, b in zip(graph, eager)) <= 1e-5
    for a, b in zip(ema_graph, ema_eager):
        assert (a - b).norm() <= 1e-5 * max(b.norm(), 1e-6)
    for a, b in zip(w_graph, w_eager):
        assert (a - b).norm() <= 1e-5 * max(b.norm(), 1e-6)
    assert any((e - w).norm() > 1e-4 for e, w in zip(ema_graph, w_graph))  # an average, not a copy
    if tie == "all":
        assert model.generator.weight is model.tgt_embed.weight is model.src_embed.weight


def test_ema_in_graph_mode_has_no_hidden_syncs():
    losses, *_ = train("graph", steps=20, no_syncs=True)
    assert len(losses) == 20 and all(v == v for v in losses)


def test_ema_swap_restores_trained_weights_on_cuda():
    dev = torch.device("cuda")
    model = make_model(VOCAB, VOCAB, d_model=64, n_layers=1, n_heads=4, d_ff=128).to(dev)
    step = make_step(model, dev, d_model=64, warmup=20, ema=0.9)
    for b in batches(3):
        loss = step.forward(b.to(dev))
        step.backward(loss)
        step.optimizer_step()
    trained = [p.detach().clone() for p in step.params]
    with step.ema.swapped():
        assert all(torch.equal(p, s) for p, s in zip(step.params, step.ema.shadow))
    assert all(torch.equal(p, t) for p, t in zip(step.params, trained))
