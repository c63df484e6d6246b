"""Engine checks that need a CUDA device (``pytest -m gpu`` on the GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from tests.engine.test_engine import (SEED_STRATEGIES, Regression, make_batches, run_collect,
                                       run_without_host_syncs, train)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", SEED_STRATEGIES[1:])
def test_strategies_match_baseline_on_gpu(strategy):
    ref, ref_params = train("baseline", "cuda", n=200)
    got, params = train(strategy, "cuda", n=200)
    assert [s for s, _ in got] == list(range(1, 201))
    for (_, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= 1e-6 * max(abs(b), 1e-12)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(params, ref_params))


@pytest.mark.parametrize("strategy", SEED_STRATEGIES[1:])
def test_no_hidden_host_syncs(strategy):
    dev = torch.device("cuda")
    step, losses = Regression(dev), DeferredLosses(dev, 10)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy))
    batches = [tuple(t.pin_memory() for t in b) for b in make_batches(40)]
    run_collect(strat, batches[:3], step, losses)  # warm-up: lazy inits may sync
    got = run_without_host_syncs(strat, batches, step, losses)
    assert len(got) == 40


@pytest.mark.parametrize("strategy", SEED_STRATEGIES)
def test_stream_sanitizer_finds_no_race(strategy, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from tests.engine.test_engine import Regression, make_batches
        from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
        dev = torch.device("cuda")
        step, losses = Regression(dev), DeferredLosses(dev, 10)
        strat = make_strategy("{strategy}", dev, EngineConfig(sync_strategy="{strategy}"))
        batches = [tuple(t.pin_memory() for t in b) for b in make_batches(25)]
        got = []
        for _ in strat.run(batches, step, losses):
            got += losses.poll()
        strat.drain("t")
        print("steps", len(got + losses.flush()))
    """))
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=os.getcwd(), timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[:4000]
    assert "data race" not in text.lower(), text[-3000:]
    assert "steps 25" in text


@pytest.mark.parametrize("strategy", SEED_STRATEGIES)
def test_memory_flat(strategy):
    dev = torch.device("cuda")
    step, losses = Regression(dev), DeferredLosses(dev, 10)
    strat = make_strategy(strategy, dev, EngineConfig(sync_strategy=strategy))
    pool = [tuple(t.pin_memory() for t in b) for b in make_batches(50)]
    mem = {}
    for info in strat.run((pool[i % 50] for i in range(2000)), step, losses):
        losses.poll()
        if info.step in (100, 2000):
            strat.drain("test")
            mem[info.step] = torch.cuda.memory_allocated(dev)
    losses.flush()
    assert abs(mem[2000] - mem[100]) <= 0.01 * mem[100], mem
