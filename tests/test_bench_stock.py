"""The stock-ro peer's model (streamnmt.bench.stock): it trains what the bench's model trains."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from streamnmt.bench.apart import CHILD, rows_apart
from streamnmt.bench.config import BenchConfig
from streamnmt.bench.stock import StockLossModel
from streamnmt.data import collate
from streamnmt.models.transformer import ModelShape
from streamnmt.training.step import make_step
from tests.test_packing_model import corpus_of, packed_batch, pairs

SHAPE = ModelShape(60, 60, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0, max_positions=64)


def stock(seed: int = 0) -> StockLossModel:
    torch.manual_seed(seed)
    return StockLossModel(SHAPE, label_smoothing=0.1)  # fp32, no dropout


def test_a_packed_batch_gives_the_loss_and_gradients_of_its_pairs_alone():
    c = corpus_of(pairs(2))
    model = stock()
    b, _ = packed_batch(c)
    packed, _ = model(b.src, b.tgt_in, b.tgt_out, b.segments())
    packed.backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for i in range(len(c)):  # each pair alone, one sentence per row (padding masked)
        one = collate(c, np.array([i]), int(max(c.src_lengths[i], c.tgt_lengths[i])) + 3)
        total = total + model(one.src, one.tgt_in, one.tgt_out)[0]
    torch.testing.assert_close(packed, total, atol=1e-4, rtol=1e-5)
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_the_bench_step_trains_the_stock_model():
    model = stock(1)
    step = make_step(model, torch.device("cpu"), d_model=SHAPE.d_model, warmup=10, label_smoothing=0.1,
                     loss_model=model)
    assert {id(p) for p in step.params} == {id(p) for p in model.parameters()}
    b, _ = packed_batch(corpus_of(pairs(3)))
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(8):
        loss = step.forward(b)
        step.backward(loss)
        step.optimizer_step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()) if p.dim() > 1)


def test_stock_ro_row_is_named_only_left_out_on_cpu_and_set_apart(monkeypatch):
    rows, notes = BenchConfig(strategies="stock-ro,graph").rows(torch.device("cpu"))
    assert "stock-ro" not in rows and any(n.startswith("stock-ro left out") for n in notes)
    from streamnmt.bench import config as bench_config
    monkeypatch.setattr(bench_config, "peer_available", lambda device, name="compile-ro": None)  # a CUDA machine with Triton
    assert "stock-ro" not in BenchConfig(strategies="graph").rows(torch.device("cuda"))[0]  # not a reference
    assert "stock-ro" in BenchConfig(strategies="stock-ro,graph").rows(torch.device("cuda"))[0]
    assert "stock-ro" not in BenchConfig(strategies="stock-ro").rows(torch.device("cuda"), world=2)[0]
    monkeypatch.setattr(bench_config, "peer_available", lambda device, name="compile-ro": f"{name} left out: no triton")
    rows, notes = BenchConfig(strategies="stock-ro,graph").rows(torch.device("cuda"))
    assert "stock-ro" not in rows and "stock-ro left out: no triton" in notes
    monkeypatch.delenv(CHILD, raising=False)
    assert rows_apart(["compile-ro", "stock-ro", "graph"]) == ["compile-ro", "stock-ro"]
    assert rows_apart(["compile-ro", "stock-ro"]) == ["stock-ro"]  # two sets of graph trees: apart
    assert rows_apart(["plain", "stock-ro", "full"]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
def test_stock_ro_row_runs_beside_graph_mode_on_cuda(tmp_path, monkeypatch):
    """The stock peer compiles and replays on packed batches, in its own child bench beside a
    graph-mode row, and joins the table with a rate."""
    from streamnmt import cli

    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    out = tmp_path / "bench"
    code = cli.main(["bench", "--device", "cuda", "--model", "tiny", "--builtin-size", "2000", "--max-len", "32",
                     "--max-tokens", "1024", "--vocab", "2000", "--steps", "10", "--warmup", "3", "--repeats", "1",
                     "--no-references", "--strategies", "graph,stock-ro", "--out", str(out)])
    assert code == 0
    runners = json.loads((out / "bench.json").read_text())["runners"]
    assert set(runners) == {"graph", "stock-ro"}
    stock_runs = runners["stock-ro"]["runs"]
    assert len(stock_runs) == 1 and stock_runs[0]["tokens_per_s"] > 0 and stock_runs[0]["real_share_pct"] > 80
    assert any("process of its own" in n for n in runners["stock-ro"]["notes"])


def test_stock_model_drops_where_the_bench_model_does():
    shape = ModelShape(60, 60, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.1, max_positions=64,
                       attention_dropout=0.0, activation_dropout=0.05)
    m = StockLossModel(shape, 0.1)
    layers = [*m.transformer.encoder.layers, *m.transformer.decoder.layers]
    assert all(layer.self_attn.dropout == 0.0 and layer.dropout.p == 0.05 and layer.dropout1.p == 0.1
               for layer in layers)
    assert all(layer.multihead_attn.dropout == 0.0 for layer in m.transformer.decoder.layers)
