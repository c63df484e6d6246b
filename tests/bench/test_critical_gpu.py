"""``bench --profile`` on a CUDA device: the graph row's critical path over its dumped graphs (``pytest -m gpu``)."""

from __future__ import annotations

import json

import pytest

from streamnmt import cli
from streamnmt.bench.critical import load_dot
from tests.conftest import single_thread

pytestmark = pytest.mark.gpu


def test_profiled_graph_row_reports_its_critical_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    out = tmp_path / "prof"
    with single_thread():
        code = cli.main(["bench", "--device", "cuda", "--model", "tiny", "--builtin-size", "2000", "--batch-size",
                         "16", "--max-len", "16", "--warmup", "2", "--repeats", "1", "--steps", "4", "--workers", "0",
                         "--strategies", "baseline,graph", "--no-references", "--profile", "--profile-steps", "3",
                         "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    profile = json.loads((out / "bench.json").read_text())["profile"]
    graph, eager = profile["graph"]["critical_path"], profile["baseline"]["critical_path"]
    assert graph["mode"] == "graph" and graph["steps"] == 3 and graph["graphs"], graph
    assert graph["critical_path_na"] is None, graph["critical_path_na"]
    assert 0 < graph["critical_path_ms"] <= graph["kernel_ms"] * 1.0001
    assert graph["stream_chain_ms"] <= graph["critical_path_ms"] * 1.0001  # one stream's ops form a chain too
    dots = sorted((out / "graphs_graph").glob("graph_*.dot"))
    assert dots and all(load_dot(d).gpu_nodes > 0 for d in dots)
    assert eager["mode"] == "eager" and eager["critical_path_ms"] is None and eager["stream_chain_ms"] > 0
    assert "graph: kernels" in printed and "critical path n/a" not in printed
    assert "baseline: kernels" in printed and "lower bound" in printed


def test_graphs_keep_no_topology_unless_asked(tmp_path):
    import torch

    from streamnmt.engine import EngineConfig, make_strategy
    from streamnmt.models.transformer import make_model
    from streamnmt.training.step import example_batch, make_step

    dev = torch.device("cuda")
    model = make_model(50, 60, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.0).to(dev)
    step = make_step(model, dev, d_model=32, warmup=10, amp="off")
    for keep in (False, True):
        strat = make_strategy("graph", dev, EngineConfig(sync_strategy="graph"), log=lambda s: None)
        strat.keep_topology = keep
        strat.prepare(step, [example_batch((4, 8, 8), model.shape, 0)])
        files = strat.dump_graphs(tmp_path / str(keep))
        assert bool(files) == keep and all(load_dot(f).gpu_nodes > 0 for f in files)
