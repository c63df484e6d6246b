"""Engine checks that need a CUDA device (``pytest -m gpu`` on the GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from tests.engine.test_engine import (SCHEDULES, Regression, make_batches, run_collect, run_without_host_syncs,
                                       train)

pytestmark = pytest.mark.gpu


def engine_config(strategy: str, streams: int | None) -> EngineConfig:
    return EngineConfig(sync_strategy=strategy, streams=streams)


@pytest.mark.parametrize("strategy,streams", SCHEDULES[1:])
def test_strategies_match_baseline_on_gpu(strategy, streams):
    ref, ref_params = train("baseline", "cuda", n=200)
    got, params = train(strategy, "cuda", n=200, streams=streams)
    assert [s for s, _ in got] == list(range(1, 201))
    for (_, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= 1e-6 * max(abs(b), 1e-12)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(params, ref_params))


@pytest.mark.parametrize("strategy,streams", SCHEDULES[1:])
def test_no_hidden_host_syncs(strategy, streams):
    dev = torch.device("cuda")
    step, losses = Regression(dev), DeferredLosses(dev, 10)
    strat = make_strategy(strategy, dev, engine_config(strategy, streams))
    batches = [tuple(t.pin_memory() for t in b) for b in make_batches(40)]
    run_collect(strat, batches[:3], step, losses)  # warm-up: lazy inits may sync
    got = run_without_host_syncs(strat, batches, step, losses)
    assert len(got) == 40


@pytest.mark.parametrize("strategy,streams", SCHEDULES)
def test_stream_sanitizer_finds_no_race(strategy, streams, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from tests.engine.test_engine import Regression, make_batches
        from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
        dev = torch.device("cuda")
        step, losses = Regression(dev), DeferredLosses(dev, 10)
        strat = make_strategy("{strategy}", dev, EngineConfig(sync_strategy="{strategy}", streams={streams}))
        batches = [tuple(t.pin_memory() for t in b) for b in make_batches(25)]
        got = []
        for _ in strat.run(batches, step, losses):
            got += losses.poll()
        strat.drain("t")
        print("steps", len(got + losses.flush()))
    """))
    assert_no_race(script, steps=25)


@pytest.mark.parametrize("strategy,streams", SCHEDULES)
def test_memory_flat(strategy, streams):
    dev = torch.device("cuda")
    step, losses = Regression(dev), DeferredLosses(dev, 10)
    strat = make_strategy(strategy, dev, engine_config(strategy, streams))
    pool = [tuple(t.pin_memory() for t in b) for b in make_batches(50)]
    mem = {}
    for info in strat.run((pool[i % 50] for i in range(2000)), step, losses):
        losses.poll()
        if info.step in (100, 2000):
            strat.drain("test")
            mem[info.step] = torch.cuda.memory_allocated(dev)
    losses.flush()
    assert abs(mem[2000] - mem[100]) <= 0.01 * mem[100], mem


# -- the Transformer ---------------------------------------------------------------------------------
TRANSFORMER_RUN = textwrap.dedent("""
    import json, os, sys
    import torch
    # Deterministic kernels, so that the strategies' only difference is their streams: cuBLAS with a
    # fixed workspace, and the math attention (fp32 memory-efficient attention's backward uses atomics).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
    from streamnmt.models.transformer import make_model
    from streamnmt.training.step import make_step
    from tests.engine.test_engine import run_collect
    from tests.engine.test_graphs_gpu import random_batches, with_global_norm
    dev = torch.device("cuda")
    out = {}
    for name, strategy, streams in json.loads(sys.argv[1]):
        torch.manual_seed(0)
        model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128, dropout=0.1).to(dev)
        step = make_step(model, dev, d_model=64, warmup=50, amp="off")
        strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy, streams=streams),
                              log=lambda s: None)
        torch.manual_seed(1)  # the same dropout stream in every run
        got = run_collect(strat, with_global_norm(random_batches(100), 1), step, DeferredLosses(dev, 10))
        out[name] = {"losses": [v for _, v in got], "steps": [s for s, _ in got],
                     "weights": [p.detach().double().norm().item() for p in model.parameters()],
                     "weights_sum": [p.detach().double().sum().item() for p in model.parameters()]}
    print("RESULT " + json.dumps(out))
""")
TRANSFORMER_CASES = [("baseline", "baseline", None), ("baseline-again", "baseline", None)] + [
    (f"{s}-{n or 'default'}", s, n) for s, n in SCHEDULES[1:]]


@pytest.fixture(scope="module")
def transformer_runs(tmp_path_factory):
    """Every schedule trains the same small Transformer 100 steps, fp32, in one fresh process
    (deterministic settings must be made before cuBLAS starts)."""
    script = tmp_path_factory.mktemp("tf") / "run.py"
    script.write_text(TRANSFORMER_RUN)
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONPATH=os.pathsep.join(sys.path))
    import json
    out = subprocess.run([sys.executable, str(script), json.dumps(TRANSFORMER_CASES)], capture_output=True,
                         text=True, env=env, cwd=os.getcwd(), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_transformer_runs_are_repeatable(transformer_runs):
    """The control: two baseline runs agree exactly, so any difference below is the schedule's."""
    a, b = transformer_runs["baseline"], transformer_runs["baseline-again"]
    assert a == b
    assert a["steps"] == list(range(1, 101)) and a["losses"][-1] < a["losses"][0]  # it trained


@pytest.mark.parametrize("name", [c[0] for c in TRANSFORMER_CASES[2:]])
def test_strategies_match_baseline_on_the_transformer(transformer_runs, name):
    """fp32, 100 steps of a Transformer with dropout: losses and weights within 1e-6 of baseline."""
    ref, got = transformer_runs["baseline"], transformer_runs[name]
    assert got["steps"] == ref["steps"]
    assert _rel(got["losses"], ref["losses"]) <= 1e-6, _rel(got["losses"], ref["losses"])
    assert _rel(got["weights"], ref["weights"]) <= 1e-6
    assert _rel(got["weights_sum"], ref["weights_sum"]) <= 1e-6 or max(
        abs(x - y) for x, y in zip(got["weights_sum"], ref["weights_sum"])) <= 1e-6


@pytest.mark.parametrize("streams", [4, 3])
def test_stream_sanitizer_finds_no_race_in_the_transformer_pipeline(streams, tmp_path):
    """The deep pipeline on the Transformer (attention, embeddings, clipped fused Adam) under the sanitizer."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
        from streamnmt.models.transformer import make_model
        from streamnmt.training.step import make_step
        from tests.engine.test_engine import run_collect
        from tests.engine.test_graphs_gpu import random_batches, with_global_norm
        dev = torch.device("cuda")
        model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128).to(dev)
        step = make_step(model, dev, d_model=64, warmup=50, amp="bf16")
        strat = make_strategy("deep", dev, EngineConfig(sync_strategy="deep", streams={streams}))
        got = run_collect(strat, with_global_norm(random_batches(12), 1), step, DeferredLosses(dev, 10))
        print("steps", len(got))
    """))
    assert_no_race(script, steps=12)


def assert_no_race(script, steps: int) -> None:
    """Run ``script`` under PyTorch's CUDA stream sanitizer: it finishes its ``steps`` with no data race."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=os.getcwd(), timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[:4000]
    assert "data race" not in text.lower(), text[-3000:]
    assert f"steps {steps}" in text
