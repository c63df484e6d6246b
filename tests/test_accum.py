"""Gradient accumulation: K micro-batches of B rows train the same model as one batch of K*B rows.

The sampler draws a global step as one planned batch of K*B rows of a bucket and splits it in
order, and the loss is normalised by the target tokens of the whole global step, so
``--accum-steps 2 --batch-size B`` and ``--batch-size 2B`` must give the same per-step losses and
weights (fp32, dropout 0; within 1e-5: the sums run in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamnmt.cli import main
from streamnmt.data import BucketSampler, bucket_lengths
from streamnmt.engine import DeferredLosses
from streamnmt.training.runs import read_csv

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "500", "--bleu-samples", "0", "--max-len", "32",
        "--dropout", "0", "--epochs", "5", "--loss-interval", "5", "--seed", "3", "--workers", "0"]


def step_losses(run) -> list[float]:
    return [float(r["loss"]) for r in read_csv(run / "steps.csv")]


def weights(run) -> dict[str, torch.Tensor]:
    """The weights of ``run``'s last.pt, less the key halves of the attention ``kv`` biases: adding
    a constant to every key shifts all scores of a query alike, which softmax ignores, so their
    gradient is zero but for rounding, and Adam (eps 1e-9) turns that noise into full-size steps
    whose values depend on the summation order. They do not change what the model computes."""
    state = torch.load(run / "weights" / "last.pt", weights_only=True)["model"]
    return {k: _no_key_bias(k, v) for k, v in state.items()}


def _no_key_bias(name: str, v: torch.Tensor) -> torch.Tensor:
    if name.endswith("qkv.bias"):  # (q, k, v) of self-attention
        d = v.numel() // 3
        return torch.cat([v[:d], v[2 * d:]])
    return v[v.numel() // 2:] if name.endswith("kv.bias") else v


def assert_same_training(a, b, steps: int, tol: float = 1e-5, tensor_tol: float | None = None) -> None:
    """Every step's loss within ``tol`` (relative), the whole model's weights within ``tol`` (relative
    norm of the difference) and each weight tensor within ``tensor_tol`` (default ``tol``); the
    tensors that differ most are printed (``pytest -s``) for the record."""
    la, lb = step_losses(a), step_losses(b)
    assert len(la) == len(lb) == steps
    assert la != step_losses(a)[:1] * steps  # the loss moved: it trained
    rel = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
    assert rel <= tol, rel
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    diff = {k: float((wa[k] - wb[k]).norm()) for k in wa}
    tensor_rel = {k: diff[k] / max(float(wb[k].norm()), 1e-6) for k in wa}
    worst = sorted(tensor_rel.items(), key=lambda kv: -kv[1])[:5]
    print(f"losses within {rel:.2e}; largest relative weight differences: "
          + ", ".join(f"{k} {v:.2e}" for k, v in worst))
    whole = sum(d * d for d in diff.values()) ** 0.5 / sum(float(w.norm()) ** 2 for w in wb.values()) ** 0.5
    assert whole <= tol, whole
    limit = tol if tensor_tol is None else tensor_tol
    assert worst[0][1] <= limit, worst
    va, vb = (float(read_csv(r / "results.csv")[-1]["val_loss"]) for r in (a, b))
    assert abs(va - vb) <= tol * vb  # the same function: the dev loss agrees


@pytest.mark.parametrize("strategy", ["full", "graph"])  # graph: its CPU fallback
def test_accum_steps_equal_a_bigger_batch(tmp_path, monkeypatch, one_thread, strategy):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    common = [*TINY, "--max-steps", "30", "--sync-strategy", strategy, "--project", str(tmp_path)]
    assert main(["train", *common, "--batch-size", "16", "--name", "big"]) == 0
    assert main(["train", *common, "--batch-size", "8", "--accum-steps", "2", "--name", "acc"]) == 0
    assert_same_training(tmp_path / "acc", tmp_path / "big", steps=30)
    # One row per optimizer step, with the tokens of the whole step.
    big, acc = read_csv(tmp_path / "big" / "steps.csv"), read_csv(tmp_path / "acc" / "steps.csv")
    assert [r["step"] for r in acc] == [str(i) for i in range(1, 31)]
    assert [r["tokens"] for r in acc] == [r["tokens"] for r in big]


def test_accum_differs_from_plain_small_batches(tmp_path, monkeypatch, one_thread):
    """The comparison above can fail: without accumulation the same batch size trains differently."""
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    common = [*TINY, "--max-steps", "6", "--sync-strategy", "full", "--project", str(tmp_path)]
    assert main(["train", *common, "--batch-size", "16", "--name", "big"]) == 0
    assert main(["train", *common, "--batch-size", "8", "--name", "small"]) == 0
    assert step_losses(tmp_path / "big") != pytest.approx(step_losses(tmp_path / "small"), rel=1e-3)


def test_global_steps_split_one_planned_batch():
    """1 x 2B, 1 rank x 2 micro-batches of B and 2 ranks x B serve the same rows in the same order,
    disjoint across ranks, one shape per step on every rank, every step complete."""
    rng = np.random.default_rng(0)
    buckets = bucket_lengths(rng.integers(1, 30, 203), rng.integers(1, 30, 203), 8)
    one = list(BucketSampler(buckets, batch_size=8, shuffle=True, seed=4))
    acc = list(BucketSampler(buckets, batch_size=4, shuffle=True, seed=4, accum=2))
    ranks = [list(BucketSampler(buckets, batch_size=4, shuffle=True, seed=4, world=2, rank=r)) for r in (0, 1)]
    assert len(acc) == 2 * len(one) and len(ranks[0]) == len(ranks[1]) == len(one)
    for s, (L, rows, group) in enumerate(one):
        a0, a1 = acc[2 * s], acc[2 * s + 1]
        r0, r1 = ranks[0][s], ranks[1][s]
        assert a0[0] == a1[0] == r0[0] == r1[0] == L  # same bucket, so same shape everywhere
        assert np.concatenate([a0[1], a1[1]]).tolist() == rows.tolist() == np.concatenate([r0[1], r1[1]]).tolist()
        assert all(g.tolist() == rows.tolist() for g in (group, a0[2], a1[2], r0[2], r1[2]))
        real0, real1 = set(r0[1][r0[1] >= 0].tolist()), set(r1[1][r1[1] >= 0].tolist())
        assert not real0 & real1
    served = np.concatenate([rows for _, rows, _ in one])
    assert sorted(served[served >= 0].tolist()) == list(range(203))  # every pair once per epoch


def test_empty_rank_is_found():
    buckets = bucket_lengths(np.full(10, 5), np.full(10, 5), 8)  # one bucket of 10 pairs
    assert BucketSampler(buckets, batch_size=4, shuffle=False, world=3, rank=0).empty_rank() is None
    assert BucketSampler(buckets, batch_size=4, shuffle=False, world=4, rank=0).empty_rank() == 3
    assert BucketSampler(buckets, batch_size=4, shuffle=False, world=2, accum=2, rank=0).empty_rank() is None
    assert BucketSampler(buckets, batch_size=4, shuffle=False, world=2, accum=3, rank=0).empty_rank() == 1


def test_deferred_losses_add_micro_batches_and_reduce_once_per_extraction():
    calls = []

    def reduce(t):
        calls.append(t.numel())
        t.mul_(2)  # as a sum over two ranks holding the same values would

    losses = DeferredLosses("cpu", interval=3, group=2, reduce=reduce)
    got = []
    for step in range(1, 8):
        for part in (1.0, 0.5):
            losses.push(step, torch.tensor(step * part))
        got += losses.poll()
    got += losses.flush()
    assert got == [(s, 2 * 1.5 * s) for s in range(1, 8)]
    assert calls == [3, 3, 1]  # one reduction per extraction, after the step's last micro-batch
