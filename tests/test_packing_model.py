"""A packed batch computes what its pairs compute alone: losses, gradients, isolation, flex == sdpa."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamnmt.models import masks
from streamnmt.models.attention import flex_importable
from streamnmt.data import collate
from streamnmt.data.packbatch import collate_packed
from streamnmt.data.packing import PackSampler
from streamnmt.models.transformer import make_model
from streamnmt.training.runs import read_csv
from tests.data.test_packing import corpus_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest.single_thread)


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    return make_model(60, 60, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0, max_positions=64)  # fp32


def pairs(seed: int = 0, n: int = 7):
    rng = np.random.default_rng(seed)
    return [(list(rng.integers(4, 60, rng.integers(1, 9))), list(rng.integers(4, 60, rng.integers(1, 9))))
            for _ in range(n)]


def packed_batch(corpus, shape=(3, 24, 20)):
    (plan,) = PackSampler(corpus.src_lengths, corpus.tgt_lengths, shape, shuffle=False).plan(0)
    return collate_packed(corpus, plan).to_batch(), plan


def token_losses(model, b) -> torch.Tensor:
    logits = model(b.src, b.tgt_in, masks.src_mask(b.src), segments=b.segments())
    return F.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=masks.PAD,
                           reduction="none").view(b.tgt_out.shape)


def per_pair_packed(model, corpus):
    b, plan = packed_batch(corpus)
    loss = token_losses(model, b)
    out = {}
    for p, row in zip(plan.pairs.tolist(), plan.slots.tolist()):
        k = int(plan.pairs[plan.slots == row].tolist().index(p)) + 1
        out[p] = loss[row][b.tgt_seg[row] == k].sum()
    return out


def test_packed_losses_and_gradients_equal_unpacked():
    c = corpus_of(pairs())
    model = tiny()
    packed = per_pair_packed(model, c)
    assert len(packed) == len(c)
    torch.stack(list(packed.values())).sum().backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0
    for i in range(len(c)):  # each pair alone, one sentence per row
        b = collate(c, np.array([i]), int(max(c.src_lengths[i], c.tgt_lengths[i])) + 1)
        alone = token_losses(model, b).sum()
        torch.testing.assert_close(packed[i], alone, atol=1e-5, rtol=1e-5)
        total = total + alone
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, atol=1e-5, rtol=1e-5, msg=n)


def test_changing_one_pair_changes_no_other_pair():
    ps = pairs(1)
    model = tiny(1)
    before = per_pair_packed(model, corpus_of(ps))
    ps[2] = (ps[2][0][:-1] + [5, 6], [7] * len(ps[2][1]))  # other tokens, other source length
    after = per_pair_packed(model, corpus_of(ps))
    assert not torch.allclose(before[2], after[2])
    for k in before:
        if k != 2:
            torch.testing.assert_close(before[k], after[k], atol=1e-6, rtol=1e-6)


def test_old_checkpoint_with_separate_q_and_kv_loads():
    model = tiny(2)
    state = model.state_dict()
    old = {}
    for k, v in state.items():  # rewrite the fused self-attention weights as q and kv
        if ".qkv." in k:
            d = v.shape[0] // 3
            old[k.replace(".qkv.", ".q.")] = v[:d]
            old[k.replace(".qkv.", ".kv.")] = v[d:]
        else:
            old[k] = v
    fresh = tiny(3)
    fresh.load_state_dict(old)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_embeddings_are_normal_with_zero_pad_row():
    torch.manual_seed(0)
    model = make_model(4000, 4000, d_model=64, n_layers=1, n_heads=4, d_ff=64)
    w = model.tgt_embed.weight.detach()
    assert torch.count_nonzero(w[masks.PAD]) == 0
    assert abs(float(w[1:].std()) - 64 ** -0.5) < 0.01 * 64 ** -0.5 * 5


@pytest.mark.skipif(flex_importable() is not None, reason="no FlexAttention in this torch")
def test_flex_equals_sdpa_on_cpu():
    c = corpus_of(pairs(3))
    model = tiny(4)
    b, _ = packed_batch(c)
    with torch.no_grad():  # FlexAttention has no backward on the CPU
        sdpa = token_losses(model, b)
    model.set_attention("flex")
    try:
        with torch.no_grad():
            flex = token_losses(model, b)
    except Exception as e:  # noqa: BLE001 - the CPU backend of this torch may lack the kernel
        pytest.skip(f"FlexAttention does not run on this CPU build: {type(e).__name__}: {e}")
    real = b.tgt_out != masks.PAD
    torch.testing.assert_close(flex[real], sdpa[real], atol=1e-4, rtol=1e-4)


def test_flex_block_masks_follow_the_dense_masks_at_any_block_size():
    """Each block of a BlockMask is kept iff the dense mask allows some position pair in it."""
    if flex_importable():
        pytest.skip(flex_importable())
    from streamnmt.models.attention import dense_masks, flex_masks

    b, _ = packed_batch(corpus_of(pairs(3)), shape=(3, 40, 36))
    dense = dense_masks(b.src_seg, b.tgt_seg)
    for size in (None, 8, 16):
        blocks = flex_masks(b.src_seg, b.tgt_seg, block_size=size)
        step = size or 128
        for block, full in zip(blocks, dense):
            assert block.BLOCK_SIZE == (step, step)
            q, k = full.shape[-2:]
            padded = F.pad(full[:, 0], (0, -k % step, 0, -q % step))
            want = padded.unflatten(2, (-1, step)).unflatten(1, (-1, step)).any(4).any(2)
            assert torch.equal(block.to_dense()[:, 0].bool(), want)


def test_start_line_padding_under_five_percent_with_pack(tmp_path, capsys):
    import re

    from streamnmt import cli

    code = cli.main(["train", "--device", "cpu", "--model", "tiny", "--builtin-size", "2000", "--epochs", "1",
                     "--max-steps", "2", "--bleu-samples", "0", "--workers", "0", "--pack",
                     "--project", str(tmp_path), "--name", "packed"])
    out = capsys.readouterr().out
    assert code == 0
    m = re.search(r"in packed rows of \d+ target and \d+ source positions, \d+ a batch[^;]*; padding ([0-9.]+) % "
                  r"of the target positions", out)
    assert m is not None, out
    assert float(m.group(1)) < 5.0


PACKED = ["--max-tokens", "160", "--max-len", "32"]  # a token budget: packed batches by default


def test_packed_training_resumes_exactly_after_sigkill(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Killed after step 15 of 32, resumed from step 10 (mid-epoch): the resumed run crosses an epoch
    boundary (the next epoch's packing planned after the resume), logs the same losses and ends with the
    same weights as the uninterrupted one (which runs in the test process; the killed run in a forked
    child of it)."""
    import signal

    from tests.test_reliability import TINY, killed_in_child, losses, run_cli, train_here

    home = str(tmp_path_factory.getbasetemp() / "home")  # the session's corpora and tokenizers, as test_reliability's
    common = [*TINY, *PACKED, "--max-steps", "32", "--seed", "5", "--save-every", "10", "--project",
              str(tmp_path), "--builtin-size", "500", "--workers", "0"]
    code, out = train_here([*common, "--name", "ref"], home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    assert "in packed rows of" in out  # packed: one batch shape
    ref_losses = losses(tmp_path / "ref")
    assert len(ref_losses) == 32 and len({e for _, e, _ in ref_losses}) >= 2  # crosses an epoch boundary
    assert all(e == "1" for s, e, _ in ref_losses if int(s) <= 15)  # the kill (15) and its checkpoint (10) in epoch 1
    code, out = killed_in_child([*common, "--name", "killed"], home, 15, tmp_path / "killed.log")
    assert code == -signal.SIGKILL, out[-2000:]
    last = tmp_path / "killed" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 10
    resumed = run_cli(["--resume", str(last)], home)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "killed") == ref_losses
    a = torch.load(tmp_path / "ref" / "weights" / "last.pt", weights_only=True)["model"]
    b = torch.load(last, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_packed_training_is_the_same_in_every_strategy(tmp_path, tmp_path_factory, monkeypatch):
    """baseline (eager) and graph (its CPU fallback) train identically on packed batches."""
    from tests.test_cli import train

    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))  # as test_cli's runs

    runs = {}
    for s in ("baseline", "graph"):
        assert train(tmp_path, *PACKED, "--max-steps", "12", "--seed", "3", "--sync-strategy", s, name=s) == 0
        run = tmp_path / "runs" / s
        runs[s] = ([(r["step"], r["loss"]) for r in read_csv(run / "steps.csv")],
                   torch.load(run / "weights" / "last.pt", weights_only=True)["model"])
    (la, wa), (lb, wb) = runs["baseline"], runs["graph"]
    assert len(la) == 12 and la == lb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_additive_masks_under_autocast_compute_what_boolean_masks_do(monkeypatch):
    """Under autocast the packed masks are additive (0 / -inf) in autocast's dtype: they mark the
    same keys as the boolean masks, and the model's output is the same with either."""
    from streamnmt.models import attention

    mask_dtype = attention.sdpa_mask_dtype
    assert mask_dtype(torch.device("cpu")) is None  # no autocast: boolean masks
    corpus = corpus_of(pairs(3))
    b, _ = packed_batch(corpus)
    src_seg, tgt_seg = b.segments()[:2]
    for boolean, additive in zip(attention.dense_masks(src_seg, tgt_seg),
                                 attention.dense_masks(src_seg, tgt_seg, torch.bfloat16)):
        assert additive.dtype == torch.bfloat16
        assert torch.equal(additive == 0, boolean) and torch.equal(additive == float("-inf"), ~boolean)
    model = tiny().eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mask_dtype(torch.device("cpu")) == torch.bfloat16
        additive = model.features(b.src, b.tgt_in, masks.src_mask(b.src), segments=b.segments())
        monkeypatch.setattr(attention, "sdpa_mask_dtype", lambda device: None)
        boolean = model.features(b.src, b.tgt_in, masks.src_mask(b.src), segments=b.segments())
    torch.testing.assert_close(additive.float(), boolean.float(), rtol=0, atol=0)


# -- --pack-width: the packed row's target width --------------------------------------------

def test_a_given_pack_width_must_hold_the_longest_training_target():
    from streamnmt.data.packshape import pack_shape
    from streamnmt.errors import ConfigError

    src, tgt = np.array([4, 20]), np.array([5, 30])  # the longest target: 30 + EOS = 31 positions
    kw = {"max_len": 128, "max_tokens": 1024, "batch_size": 32}
    assert pack_shape(src, tgt, **kw, pad_multiple=8)[2] == 128  # default: --max-len
    assert pack_shape(src, tgt, **kw, pad_multiple=8, width=31)[2] == 32
    with pytest.raises(ConfigError, match=r"--pack-width .*30 positions cannot hold the longest training target "
                                          r"\(31 with its EOS\)"):
        pack_shape(src, tgt, **kw, pad_multiple=1, width=30)


def test_pack_width_packs_rows_of_that_width_and_resumes_exactly(tmp_path, tmp_path_factory, monkeypatch, capsys):
    """The uninterrupted run in the test process, the killed run in a forked child of it, the resume
    in a process of its own."""
    from tests.test_reliability import TINY, killed_in_child, losses, run_cli, train_here

    home = str(tmp_path_factory.getbasetemp() / "home")  # the session's corpora and tokenizers, as test_reliability's
    common = [*TINY, "--max-tokens", "256", "--max-len", "64", "--max-steps", "24", "--seed", "5", "--save-every",
              "10", "--project", str(tmp_path), "--builtin-size", "500", "--workers", "0", "--pack-width", "40"]
    code, out = train_here([*common, "--name", "ref"], home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    assert "packed rows of 40 target" in out and "(--pack-width 40)" in out
    killed, _ = killed_in_child([*common, "--name", "k"], home, 15, tmp_path / "k.log")
    resumed = run_cli(["--resume", str(tmp_path / "k" / "weights" / "last.pt")], home)
    assert killed != 0 and resumed.returncode == 0, resumed.stderr[-2000:]
    assert "packed rows of 40 target" in resumed.stdout and losses(tmp_path / "k") == losses(tmp_path / "ref")
