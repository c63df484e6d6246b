"""Data parallel on 2 GPUs (NCCL): 2 ranks x batch B equal 1 GPU x batch 2B over 100 steps (fp32,
deterministic) for full and graph (all-reduce captured in the step's graph), and the training
loop of each rank makes no host sync outside ``host_sync`` (``pytest -m multigpu``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.test_accum import assert_same_training
from tests.test_dist import home, streamnmt, torchrun  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

STEPS = 100
GPU = ["--device", "cuda", "--model", "tiny", "--builtin-size", "2000", "--bleu-samples", "0", "--max-len", "32",
       "--max-tokens", "0", "--dropout", "0", "--amp", "off", "--deterministic", "--epochs", "5", "--loss-interval", "10", "--seed", "3",
       "--max-steps", str(STEPS)]


@pytest.mark.parametrize("strategy", ["full", "graph"])
def test_two_gpus_equal_one_gpu_double_batch(tmp_path, home, strategy):  # noqa: F811
    common = [*GPU, "--sync-strategy", strategy, "--project", str(tmp_path)]
    one = streamnmt([*common, "--batch-size", "32", "--name", "one"], home)
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun([*common, "--batch-size", "16", "--name", "two"], home)
    assert two.returncode == 0, two.stderr[-3000:]
    if strategy == "graph":
        assert "graph mode captured" in two.stdout and "graph mode unavailable" not in two.stdout + two.stderr
    assert_same_training(tmp_path / "two", tmp_path / "one", steps=STEPS)


@pytest.mark.parametrize("strategy,accum", [("full", 1), ("graph", 1), ("graph", 2)])
def test_two_gpus_no_hidden_host_syncs(tmp_path, strategy, accum):
    port = _free_port()
    torch.multiprocessing.spawn(_sync_debug_rank, args=(2, port, strategy, accum, str(tmp_path)), nprocs=2,
                                join=True)  # a rank that raised (a hidden sync) fails the spawn
    # every rank ran its 40 global steps under set_sync_debug_mode("error") and got each loss back
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.steps").read_text().split() == [str(s) for s in range(1, 41)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_debug_rank(rank: int, world: int, port: int, strategy: str, accum: int, out: str) -> None:
    """One rank: DDP step, the strategy, deferred losses reduced across ranks, 40 global steps
    under ``set_sync_debug_mode("error")`` (a sync outside ``host_sync`` raises)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from streamnmt import dist
    from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
    from streamnmt.models.transformer import make_model
    from streamnmt.training.step import example_batch, make_step
    from tests.engine.test_engine import run_collect, run_without_host_syncs
    from tests.engine.test_graphs_gpu import SHAPES, random_batches, with_global_norm

    d = dist.init("nccl", "cuda", 60)
    try:
        torch.manual_seed(0)
        model = make_model(200, 220, d_model=64, n_layers=2, n_heads=4, d_ff=128).to(d.device)
        step = make_step(model, d.device, d_model=64, warmup=50, amp="bf16", ddp=True)
        cfg = EngineConfig(sync_strategy=strategy, accum_steps=accum)
        strat = make_strategy(strategy, d.device, cfg, log=lambda s: None)
        strat.prepare(step, [example_batch(s, model.shape, 0) for s in SHAPES])
        if strategy == "graph":
            assert strat.fallback is None and "capture_error" not in strat.report, strat.report
        losses = DeferredLosses(d.device, 10, group=accum, reduce=d.reduce_sum_)
        batches = with_global_norm(random_batches(4 * accum, seed=rank), accum)
        run_collect(strat, batches, step, losses)  # warm-up: lazy inits may sync
        batches = with_global_norm(random_batches(40 * accum, seed=10 + rank), accum)
        got = run_without_host_syncs(strat, batches, step, losses)
        (Path(out) / f"rank{rank}.steps").write_text(" ".join(str(s) for s, _ in got))
    finally:
        d.close()
