"""Data parallel on ONE GPU: under ``torchrun --nproc-per-node 1`` the trainer joins a one-rank
NCCL group and wraps DDP, so one GPU runs the multi-GPU code path. Graph mode captures with DDP
(the all-reduce inside the graph; no fallback, no stream-mismatch warning), its losses and weights
equal the same run without DDP within 1e-6 (fp32, 100 steps, with and without --accum-steps 2),
the step makes no host sync outside ``host_sync``, and a capture failure stops the run with one
line (``pytest -m gpu tests/test_ddp_gpu.py``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_accum import assert_same_training
from tests.test_dist import free_port, home, launch, streamnmt  # noqa: F401  (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 100
GPU = ["--device", "cuda", "--model", "tiny", "--builtin-size", "2000", "--bleu-samples", "0", "--max-len", "32",
       "--max-tokens", "0", "--dropout", "0", "--amp", "off", "--deterministic", "--epochs", "5", "--loss-interval", "10", "--seed", "3",
       "--max-steps", str(STEPS), "--sync-strategy", "graph"]
MISMATCH = "AccumulateGrad node's stream does not match"


def one_rank(args: list[str], home: str, env: dict | None = None):  # noqa: F811
    """``torchrun --nproc-per-node 1 -m streamnmt train ARGS``: a one-rank NCCL group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
           str(free_port()), "-m", "streamnmt", "train", *args]
    return launch(cmd, home, env, True)


@pytest.mark.parametrize("accum", [1, 2])
def test_one_rank_ddp_graph_equals_plain_graph(tmp_path: Path, home: str, accum: int):  # noqa: F811
    common = [*GPU, "--batch-size", str(32 // accum), "--accum-steps", str(accum), "--project", str(tmp_path)]
    plain = streamnmt([*common, "--name", "plain"], home)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ddp = one_rank([*common, "--name", "ddp"], home)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    out = ddp.stdout + ddp.stderr
    assert "graph mode captured" in out and "graph mode unavailable" not in out and "capture failed" not in out
    assert "strategy graph; 1 processes (nccl)" in out  # the DDP path, and the strategy that runs
    assert MISMATCH not in out  # DDP built, warmed up and captured under one stream
    assert_same_training(tmp_path / "ddp", tmp_path / "plain", steps=STEPS, tol=1e-6)
    ckpt = torch.load(tmp_path / "ddp" / "weights" / "last.pt", weights_only=True)
    assert isinstance(ckpt["rng"]["cuda"], torch.Tensor) and len(ckpt["rng_ranks"]) == 1  # this device's state


@pytest.mark.parametrize("strategy,accum", [("full", 1), ("graph", 1), ("graph", 2)])
def test_one_rank_ddp_no_hidden_host_syncs(tmp_path: Path, strategy: str, accum: int):
    from tests.test_dist_gpu import _sync_debug_rank
    torch.multiprocessing.spawn(_sync_debug_rank, args=(1, free_port(), strategy, accum, str(tmp_path)), nprocs=1,
                                join=True)  # a hidden sync raises in the rank and fails the spawn
    assert (tmp_path / "rank0.steps").read_text().split() == [str(s) for s in range(1, 41)]


def test_one_rank_capture_failure_stops_with_one_line(tmp_path: Path, home: str):  # noqa: F811
    t0 = time.time()
    res = one_rank([*GPU, "--batch-size", "32", "--project", str(tmp_path / "runs"), "--name", "f"], home,
                   env={"STREAMNMT_TEST_CAPTURE_FAIL_RANK": "0"})
    assert res.returncode != 0 and time.time() - t0 < 60
    lines = [ln for ln in res.stderr.splitlines() if "graph capture failed on rank 0 of 1" in ln]
    assert len(lines) == 1 and lines[0].startswith("streamnmt: error:")
    assert not (tmp_path / "runs").exists()
