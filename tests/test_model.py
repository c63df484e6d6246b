from __future__ import annotations

import torch
import torch.nn.functional as F

from streamnmt import masks
from streamnmt.model import make_model


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
