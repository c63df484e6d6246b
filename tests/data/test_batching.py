"""Buckets, batches and the sampler: shapes stay in the declared set, order is seeded and resumable."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from streamnmt.models import masks
from streamnmt.data import Batch, BucketSampler, bucket_lengths, make_loader
from streamnmt.data.batch import collate, collate_host
from streamnmt.errors import InputError
from streamnmt.models.masks import BOS, EOS, PAD


def _rounded(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _signature(batches: list[Batch]) -> list[tuple]:
    return [(b.index.tolist(), b.src.tolist(), b.tgt_in.tolist(), b.tgt_out.tolist()) for b in batches]


@pytest.mark.parametrize("kw", [{}, {"max_tokens": 100}, {"pad_multiple": 1}, {"pad_multiple": 5, "batch_size": 3}])
def test_shapes_follow_the_bucket_rule(prepared, kw) -> None:
    cfg, bundle = prepared
    cfg = dataclasses.replace(cfg, **kw)
    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)
    declared = set(loader.shapes())
    assert len(declared) == len({s[1] for s in declared})  # one shape per bucket length
    seen = set()
    corpus = bundle.train
    for batch in loader:
        b, length, _ = batch.shape
        assert batch.shape in declared
        assert batch.src.shape == batch.tgt_in.shape == batch.tgt_out.shape == (b, length)
        expected_b = max(1, cfg.max_tokens // length) if cfg.max_tokens else cfg.batch_size
        assert b == expected_b and length % cfg.pad_multiple == 0
        for i in batch.index[batch.index >= 0]:
            n, m = len(corpus[i][0]), len(corpus[i][1])
            assert length == _rounded(max(n + 1, m + 1), cfg.pad_multiple) <= _rounded(cfg.max_len, cfg.pad_multiple)
        seen.add(batch.shape)
    assert seen == declared


def test_batch_contents(prepared) -> None:
    cfg, bundle = prepared
    corpus = bundle.train
    loader = make_loader(corpus, cfg, train=True, seed=1, pin_memory=False)
    fillers = 0
    for batch in loader:
        assert batch.src.dtype == batch.tgt_in.dtype == batch.tgt_out.dtype == torch.int64
        for r, i in enumerate(batch.index.tolist()):
            src, tgt_in, tgt_out = batch.src[r].tolist(), batch.tgt_in[r].tolist(), batch.tgt_out[r].tolist()
            if i < 0:
                fillers += 1
                assert set(src) == set(tgt_in) == set(tgt_out) == {PAD}
                continue
            s, t = corpus[i][0].tolist(), corpus[i][1].tolist()
            length = batch.shape[1]
            assert src == s + [EOS] + [PAD] * (length - len(s) - 1)
            assert tgt_in == [BOS] + t + [PAD] * (length - len(t) - 1)
            assert tgt_out == t + [EOS] + [PAD] * (length - len(t) - 1)
        assert batch.ntokens == int((batch.tgt_out != PAD).sum())
        assert batch.src_tokens == int((batch.src != PAD).sum())
    assert fillers > 0  # short last batches were filled, not shrunk


def test_each_pair_once_per_epoch_and_len(prepared) -> None:
    cfg, bundle = prepared
    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)
    batches = list(loader)
    assert len(batches) == len(loader)
    rows = np.concatenate([b.index for b in batches])
    assert sorted(rows[rows >= 0].tolist()) == list(range(len(bundle.train)))


def test_order_is_a_function_of_seed_and_epoch(prepared) -> None:
    cfg, bundle = prepared

    def order(seed: int, epoch: int) -> list[list[int]]:
        loader = make_loader(bundle.train, cfg, train=True, seed=seed, pin_memory=False)
        loader.set_epoch(epoch)
        return [b.index.tolist() for b in loader]

    assert order(0, 3) == order(0, 3)
    assert order(0, 3) != order(0, 4)
    assert order(0, 3) != order(1, 3)
    lengths = [b.shape[1] for b in make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)]
    assert lengths != sorted(lengths)  # buckets are interleaved, not served in length order


def test_epochs_advance_by_themselves(prepared) -> None:
    cfg, bundle = prepared
    loader = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)
    first, second = _signature(list(loader)), _signature(list(loader))
    assert loader.epoch == 2 and loader.position == 0
    other = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False)
    other.set_epoch(1)
    assert _signature(list(other)) == second != first


def test_eval_order_is_fixed_and_unshuffled(prepared) -> None:
    cfg, bundle = prepared
    loader = make_loader(bundle.dev, cfg, train=False, seed=0, pin_memory=False)
    first = [b for b in loader]
    it = iter(loader)
    next(it)  # an abandoned pass must not shift the next one
    del it
    assert _signature(list(loader)) == _signature(first)
    loader.set_epoch(5)
    assert _signature(list(loader)) == _signature(first)
    lengths = [b.shape[1] for b in first]
    assert lengths == sorted(lengths)
    for length in set(lengths):
        rows = np.concatenate([b.index for b in first if b.shape[1] == length])
        rows = rows[rows >= 0].tolist()
        assert rows == sorted(rows)


def test_worker_count_does_not_change_the_order(prepared) -> None:
    cfg, bundle = prepared
    runs = []
    for workers in (0, 2):
        loader = make_loader(bundle.train, dataclasses.replace(cfg, workers=workers, prefetch_factor=2),
                             train=True, seed=7, pin_memory=True)
        loader.set_epoch(2)
        runs.append(_signature(list(loader)))
        assert not loader.pin_memory or torch.cuda.is_available()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_exactly(prepared, workers: int) -> None:
    cfg, bundle = prepared
    cfg = dataclasses.replace(cfg, workers=workers)
    full = make_loader(bundle.train, cfg, train=True, seed=3, pin_memory=False)
    full.set_epoch(1)
    expected = _signature(list(full)) + _signature(list(full))  # epochs 1 and 2

    run = make_loader(bundle.train, cfg, train=True, seed=3, pin_memory=False)
    run.set_epoch(1)
    head = []
    for k, batch in enumerate(run):
        head.append(batch)
        if k == 9:
            state = run.state_dict()
            break
    assert state["epoch"] == 1 and state["position"] == 10

    resumed = make_loader(bundle.train, cfg, train=True, seed=3, pin_memory=False)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the trainer's usual call: must not restart the epoch
    tail = list(resumed)
    resumed.set_epoch(2)
    nxt = list(resumed)
    assert _signature(head) + _signature(tail) + _signature(nxt) == expected


def test_state_from_other_batching_is_refused(prepared) -> None:
    cfg, bundle = prepared
    state = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=False).state_dict()
    other = make_loader(bundle.train, dataclasses.replace(cfg, batch_size=5), train=True, seed=0,
                        pin_memory=False)
    with pytest.raises(InputError, match="cannot resume"):
        other.load_state_dict(state)


def test_sampler_pads_short_last_batch_per_bucket() -> None:
    buckets = bucket_lengths(np.array([1, 2, 9, 9, 9, 30]), np.array([3, 1, 2, 10, 4, 1]), 8)
    assert buckets.tolist() == [8, 8, 16, 16, 16, 32]
    sampler = BucketSampler(buckets, batch_size=2, shuffle=False)
    assert sampler.shapes() == [(2, 8, 8), (2, 16, 16), (2, 32, 32)]
    plan = [(length, rows.tolist()) for length, rows, _ in sampler]
    assert plan == [(8, [0, 1]), (16, [2, 3]), (16, [4, -1]), (32, [5, -1])]
    assert len(sampler) == 4


def test_batch_methods() -> None:
    from streamnmt.data.corpus import TokenizedCorpus

    arrays = {"src_tokens": np.array([5, 6, 7, 8], np.uint16), "src_offsets": np.array([0, 3, 4]),
              "tgt_tokens": np.array([9, 10], np.uint16), "tgt_offsets": np.array([0, 1, 2]),
              "index": np.arange(2)}
    batch = collate(TokenizedCorpus(arrays), np.array([1, 0, -1]), 8)
    assert batch.shape == (3, 8, 8) and batch.ntokens == 4 and batch.src_tokens == 6
    assert batch.src[1, :4].tolist() == [5, 6, 7, EOS] and batch.tgt_in[0, :3].tolist() == [BOS, 10, PAD]
    assert torch.equal(batch.src_mask, masks.src_mask(batch.src))
    assert torch.equal(batch.tgt_mask, masks.tgt_mask(batch.tgt_in))
    assert batch.tgt_mask.shape[-2:] == (8, 8) and batch.src_mask.shape[-1] == 8
    moved = batch.to("cpu", non_blocking=True)
    assert torch.equal(moved.tgt_out, batch.tgt_out) and moved.ntokens == 4
    copy = pickle.loads(pickle.dumps(batch))
    assert torch.equal(copy.src, batch.src) and copy.index.tolist() == [1, 0, -1]
    host = pickle.loads(pickle.dumps(collate_host(TokenizedCorpus(arrays), np.array([1, 0, -1]), 8)))
    again = host.to_batch()  # what the main process makes of a worker's result
    assert all(torch.equal(getattr(again, k), getattr(batch, k)) for k in ("src", "tgt_in", "tgt_out"))
    assert (again.ntokens, again.src_tokens) == (batch.ntokens, batch.src_tokens)


@pytest.mark.gpu
def test_pinned_batches_copy_to_the_gpu(prepared) -> None:
    cfg, bundle = prepared
    loader = make_loader(bundle.train, dataclasses.replace(cfg, workers=2), train=True, seed=0, pin_memory=True)
    batch = next(iter(loader))
    assert batch.is_pinned()
    on_gpu = batch.to("cuda", non_blocking=True)
    assert on_gpu.src_mask.device.type == "cuda" and torch.equal(on_gpu.src.cpu(), batch.src)
