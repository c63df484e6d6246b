"""Data parallel on 2 GPUs (NCCL): 2 ranks x batch B equal 1 GPU x batch 2B over 100 steps (fp32,
deterministic) for full and graph (all-reduce captured in the step's graph), by sentences and
packed; the training loop of each rank makes no host sync outside ``host_sync``; a rank killed
with SIGKILL under graph mode ends the run with one line naming it, last.pt resumes exactly on 2
GPUs and continues on 1 GPU (``pytest -m multigpu``)."""

from __future__ import annotations

import gc
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from streamnmt.training.runs import read_csv
from tests.test_accum import assert_same_training
from tests.test_dist import home, kill_rank_after, streamnmt, torchrun  # noqa: F401  (fixture)

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


@pytest.mark.parametrize("strategy", ["full", "graph"])
def test_two_gpus_equal_one_gpu_double_budget_packed(tmp_path, home, strategy):  # noqa: F811
    """Packed rows (one shape): 2 ranks x --max-tokens T serve, step by step, the pairs that 1 GPU x
    2T packs (data.packing: global batch g is world x rows rows of one plan)."""
    i = GPU.index("--max-tokens")
    common = [*GPU[:i], *GPU[i + 2:], "--epochs", "20",  # 14 packed batches an epoch: 100 steps need 8
              "--sync-strategy", strategy, "--project", str(tmp_path)]
    one = streamnmt([*common, "--max-tokens", "1024", "--name", "one"], home)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "in packed rows of" in one.stdout + one.stderr  # packed: one batch shape
    two = torchrun([*common, "--max-tokens", "512", "--name", "two"], home)
    assert two.returncode == 0, two.stderr[-3000:]
    if strategy == "graph":
        assert "graph mode captured" in two.stdout and "graph mode unavailable" not in two.stdout + two.stderr
    # Each tensor within 1e-3 of its norm (the losses and the whole model within 1e-5): Adam (eps
    # 1e-9) scales each element's step by its own gradient history, so summation-order rounding in
    # the packed rows' sums grows most in the smallest tensors, the layer-norm biases (what the
    # GPUs gave: docs/PERFORMANCE.md, "Two H100s"). A tensor whose gradient missed the all-reduce
    # would differ by a share of its norm near its whole movement in 100 steps, far above 1e-3.
    assert_same_training(tmp_path / "two", tmp_path / "one", steps=STEPS, tensor_tol=1e-3)


def test_killed_rank_under_nccl_graph_then_resume_on_two_and_one_gpus(tmp_path, home):  # noqa: F811
    """SIGKILL of rank 1 mid-run (graph mode, all-reduce captured): the launcher exits non-zero
    within --dist-timeout plus torchrun's grace, and every error line names rank 1: the launcher's
    and rank 0's PeerLost, whichever come (rank 0's deadline, --dist-timeout 15, ends well inside
    torchrun's 30-s SIGTERM grace, and it names the rank of its host whose process ended); last.pt
    loads; --resume on 2 GPUs replays the uninterrupted run exactly; the same last.pt resumed on 1
    GPU says what changed and finishes."""
    common = [*GPU, "--sync-strategy", "graph", "--batch-size", "16", "--save-every", "10", "--dist-timeout", "15",
              "--project", str(tmp_path)]
    ref = torchrun([*common, "--name", "ref"], home)
    assert ref.returncode == 0, ref.stderr[-3000:]
    proc = streamnmt(["--nproc", "2", *common, "--name", "k"], home, wait=False)
    _, err, took = kill_rank_after(proc, tmp_path / "k" / "steps.csv", 25, timeout=120)
    errors = [ln for ln in err.splitlines() if ln.startswith("streamnmt: error:")]
    print(f"kill to launcher exit: {took:.1f} s")
    assert proc.returncode not in (0, None) and took < 15 + 30, (took, err[-3000:])
    named = ("streamnmt: error: rank 1 failed (killed by SIGKILL)", "rank 1 of this host ended")
    assert 1 <= len(errors) <= 2 and all(any(n in ln for n in named) for ln in errors), err[-3000:]
    last = tmp_path / "k" / "weights" / "last.pt"
    saved = torch.load(last, weights_only=True)
    assert saved["step"] >= 20 and len(saved["rng_ranks"]) == 2
    one_dir = tmp_path / "k1"  # the same run, to be resumed on one GPU
    shutil.copytree(tmp_path / "k", one_dir)
    resumed = streamnmt(["--nproc", "2", "--resume", str(last)], home)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not bit-exactly" not in resumed.stdout + resumed.stderr
    assert read_csv(tmp_path / "k" / "steps.csv") == read_csv(tmp_path / "ref" / "steps.csv")
    one = streamnmt(["--resume", str(one_dir / "weights" / "last.pt")], home)
    assert one.returncode == 0, one.stderr[-3000:]
    said = [ln for ln in (one.stdout + one.stderr).splitlines() if "not bit-exactly" in ln]
    assert len(said) == 1 and "saved with 2 process(es)" in said[0] and "now 1 x 1" in said[0], said
    rows = read_csv(one_dir / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))


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

    d = dist.init("nccl", "cuda", 60)
    # A failure propagates with the process group left up: tearing it down under graphs that
    # captured NCCL collectives hangs (as streamnmt train, see cli._run_trainer).
    _sync_debug_steps(d, rank, strategy, accum, out)
    gc.collect()  # the steps' graphs are gone: the process group can go
    d.close()


def _sync_debug_steps(d, rank: int, strategy: str, accum: int, out: str) -> None:
    from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
    from streamnmt.models.transformer import make_model
    from streamnmt.training.step import example_batch, make_step
    from tests.engine.test_engine import run_collect, run_without_host_syncs
    from tests.engine.test_graphs_gpu import SHAPES, random_batches, with_global_norm

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
