from __future__ import annotations

import torch
import torch.nn.functional as F

from streamnmt.models import masks
from streamnmt.models.transformer import make_model


def test_src_mask_shape_and_values():
    src = torch.tensor([[5, 6, 0, 0], [0, 0, 0, 0]])
    m = masks.src_mask(src)
    assert m.shape == (2, 1, 1, 4) and m.dtype == torch.bool
    assert m[0, 0, 0].tolist() == [True, True, False, False]
    assert m[1, 0, 0].tolist() == [True, False, False, False]  # all-PAD row keeps key 0


def test_causal_mask():
    m = masks.tgt_mask(torch.zeros(3, 4, dtype=torch.long))
    assert m.shape == (1, 1, 4, 4)
    assert m[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                [True, True, True, False], [True, True, True, True]]


def test_forward_shape_and_no_nan_for_pad_rows():
    torch.manual_seed(0)
    m = make_model(30, 40, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    src = torch.randint(4, 30, (3, 8))
    src[2] = 0  # a filler row
    tgt = torch.randint(4, 40, (3, 8))
    out = m(src, tgt, masks.src_mask(src))
    assert out.shape == (3, 8, 40)
    assert torch.isfinite(out).all()
    loss = F.cross_entropy(out.flatten(0, 1), tgt.flatten())
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_causality():
    torch.manual_seed(0)
    m = make_model(30, 40, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0).eval()
    src = torch.randint(4, 30, (2, 6))
    tgt = torch.randint(4, 40, (2, 7))
    a = m(src, tgt, masks.src_mask(src))
    tgt2 = tgt.clone()
    tgt2[:, 5:] = 9
    b = m(src, tgt2, masks.src_mask(src))
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-5)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-5)


def test_incremental_decoding_matches_full():
    torch.manual_seed(0)
    m = make_model(30, 40, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0).eval()
    src = torch.randint(4, 30, (3, 7))
    src[1, 4:] = 0
    tgt = torch.randint(4, 40, (3, 6))
    sm = masks.src_mask(src)
    full = m(src, tgt, sm).log_softmax(-1)
    cache = m.init_cache(m.encode(src, sm))
    inc = torch.stack([m.decode_step(tgt[:, i], sm, cache) for i in range(6)], 1)
    assert torch.allclose(full, inc, atol=1e-5)


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    m = make_model(20, 20, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    src = torch.randint(4, 20, (8, 6))
    tgt_full = torch.cat([torch.full((8, 1), masks.BOS), src.flip(1), torch.full((8, 1), masks.EOS)], 1)
    tgt_in, tgt_out = tgt_full[:, :-1], tgt_full[:, 1:]
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = None
    for _ in range(300):
        loss = F.cross_entropy(m(src, tgt_in, masks.src_mask(src)).flatten(0, 1), tgt_out.flatten())
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 2.0
    assert loss.item() < 0.05


def test_tied_embeddings_are_one_parameter():
    torch.manual_seed(0)
    untied = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    dec = make_model(30, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="decoder")
    assert dec.generator.weight is dec.tgt_embed.weight and dec.src_embed.weight is not dec.tgt_embed.weight
    both = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="all")
    assert both.generator.weight is both.tgt_embed.weight is both.src_embed.weight
    assert untied.num_params() - both.num_params() == 2 * 40 * 32  # one (V, D) tensor instead of three
    assert sum(p is both.tgt_embed.weight for p in both.parameters()) == 1


def test_tied_embeddings_stay_tied_through_training_and_reload(tmp_path):
    from streamnmt.checkpoint import load_checkpoint, load_model_weights, save_checkpoint
    from streamnmt.training.step import example_batch, make_step

    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="all")
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10)
    for _ in range(3):
        loss = step.forward(example_batch((4, 8, 8), model.shape, 0))
        step.backward(loss)
        step.optimizer_step()
    assert model.generator.weight is model.tgt_embed.weight is model.src_embed.weight
    path = tmp_path / "tied.pt"
    save_checkpoint(path, {"model": model.state_dict(), "model_shape": vars(model.shape)})
    ckpt = load_checkpoint(path)
    state = ckpt["model"]
    assert state["generator.weight"].data_ptr() == state["tgt_embed.weight"].data_ptr()  # stored once
    fresh = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="all")
    load_model_weights(fresh, ckpt, path)
    assert fresh.generator.weight is fresh.tgt_embed.weight is fresh.src_embed.weight
    assert torch.equal(fresh.generator.weight, model.generator.weight)


def test_tying_mismatch_and_vocab_errors(tmp_path):
    import pytest

    from streamnmt.checkpoint import load_model_weights
    from streamnmt.errors import InputError

    tied = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="decoder")
    untied = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    ckpt = {"model": untied.state_dict(), "model_shape": vars(untied.shape)}
    with pytest.raises(InputError, match="--tie-embeddings none"):
        load_model_weights(tied, ckpt, "untied.pt")
    with pytest.raises(ValueError, match="one vocabulary"):
        make_model(30, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="all")


def test_bf16_autocast_keeps_the_residual_stream_and_layer_norms_in_bf16():
    """Under bf16 autocast the layer norms read and write bf16 (not autocast's fp32 copies), the
    outputs agree with the fp32 model to bf16's precision, and every parameter gets a gradient of
    its own (fp32) dtype."""
    from streamnmt.models.transformer import LayerNorm

    torch.manual_seed(0)
    model = make_model(40, 50, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)
    src, tgt = torch.randint(4, 40, (3, 7)), torch.randint(4, 50, (3, 6))
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((i[0].dtype, o.dtype)))
             for m in model.modules() if isinstance(m, LayerNorm)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(src, tgt, masks.src_mask(src))
    for h in hooks:
        h.remove()
    assert len(seen) == 2 * 2 + 2 * 3 + 2 and set(seen) == {(torch.bfloat16, torch.bfloat16)}
    ref = model(src, tgt, masks.src_mask(src))
    assert ref.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=0.1, rtol=0.05)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_the_position_table_is_computed_on_the_cpu_whatever_the_default_device():
    """Inference builds the model under ``with torch.device(...)``; the sinusoid table must still be
    the CPU's (the trainer's), bit for bit, not the other device's sin/cos."""
    from streamnmt.models.transformer import PositionalEncoding

    want = PositionalEncoding(32, 40).pe
    with torch.device("meta"):
        got = PositionalEncoding(32, 40).pe
    assert got.device.type == "cpu" and torch.equal(got, want)


def test_dropout_sites_follow_the_shape():
    """Attention and feed-forward dropout are their own settings; None (checkpoints written
    before them) means ``dropout`` at every site."""
    old = make_model(20, 20, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.2)
    assert old.encoder[0].attn.dropout == 0.2 and old.decoder[0].cross_attn.dropout == 0.2
    assert old.decoder[0].ff.drop.p == 0.2 and old.drop.p == 0.2
    new = make_model(20, 20, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.2, attention_dropout=0.0,
                     activation_dropout=0.05)
    assert new.encoder[0].attn.dropout == 0.0 and new.decoder[0].self_attn.dropout == 0.0
    assert new.encoder[0].ff.drop.p == 0.05 and new.decoder[0].drop.p == 0.2 and new.drop.p == 0.2

