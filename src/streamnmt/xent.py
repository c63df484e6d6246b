"""The generator and the label-smoothed cross-entropy in one pass, without whole-batch logits.

At a real vocabulary the output layer's logits are the largest tensor of a step: batch x length x
32k, and the usual ``F.cross_entropy(logits.float(), ...)`` holds them in bf16, again in fp32, as
fp32 log-probabilities and as their gradient. Here the projection ``h @ W.T + b`` and the loss run
over row chunks of at most :data:`CHUNK_ELEMENTS` logits: each chunk's logits are made in the
compute dtype (the autocast dtype, else the input's), read once in fp32 for the log-sum-exp, and
turned in place into their gradient, which is multiplied into the gradients of ``h``, ``W`` and
``b`` at once. The backward then only scales those by the incoming gradient, so nothing is
recomputed and no chunk outlives its loop iteration.

The smoothed loss and the plain NLL come from the same log-sum-exp. With smoothing ``e`` over
``V`` classes (PyTorch's definition, which spreads ``e`` over every class, the ignored one too):
``loss = (1 - e) * (lse - z_y) + e * (lse - mean(z))`` and ``dloss/dz = softmax(z) - (1 - e) *
onehot(y) - e / V``. Rows whose target is ``ignore_index`` add nothing. Shapes are static and
nothing is read on the host, so CUDA graphs capture it and torch.compile traces it.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 2 ** 25  # logits per chunk (rows x vocabulary): 128 MB in fp32, ~1k rows at 32k


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, target, smoothing: float, ignore_index: int, rows: int,
                dtype: torch.dtype, want_grad: bool):
        # h (N, D), weight (V, D), bias (V,) or None, target (N,)
        with torch.autocast(h.device.type, enabled=False):
            hc, w = h.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            n, v = hc.shape[0], w.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            nll = torch.zeros((), dtype=torch.float32, device=h.device)
            if want_grad:
                dh = torch.empty_like(hc)                                  # (N, D)
                dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)  # (V, D)
                db = torch.zeros(v, dtype=torch.float32, device=h.device) if b is not None else None
            for start in range(0, n, rows):
                x, y = hc[start:start + rows], target[start:start + rows]  # (C, D), (C,)
                z = (torch.addmm(b, x, w.t()) if b is not None else x @ w.t()).float()  # (C, V)
                lse = torch.logsumexp(z, dim=-1)                           # (C,)
                keep = y != ignore_index
                valid, y = keep.float(), y.masked_fill(~keep, 0)[:, None]  # (C,), (C, 1): a safe index
                row_nll = lse - z.gather(1, y).squeeze(1)
                row_loss = row_nll if smoothing == 0 else (1 - smoothing) * row_nll + smoothing * (lse - z.mean(-1))
                loss += (row_loss * valid).sum()
                nll += (row_nll * valid).sum()
                if not want_grad:
                    del z
                    continue
                g = z.sub_(lse[:, None]).exp_()                            # softmax, in place of z
                if smoothing:
                    g.sub_(smoothing / v)
                g.scatter_add_(1, y, torch.full_like(lse[:, None], smoothing - 1))
                g.mul_(valid[:, None])                                     # dloss/dz (C, V)
                if db is not None:
                    db += g.sum(0)
                gc = g.to(dtype)
                dh[start:start + rows] = gc @ w
                if dtype == torch.float32:
                    dw.addmm_(gc.t(), x)
                else:
                    dw += gc.t() @ x
                del z, g, gc  # before the next chunk's logits are made
        ctx.mark_non_differentiable(nll)
        ctx.h_dtype, ctx.has_bias = h.dtype, bias is not None
        if want_grad:
            ctx.save_for_backward(dh, dw, db if db is not None else dw.new_empty(0))
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        dh, dw, db = ctx.saved_tensors
        g = grad_loss.float()
        return ((dh.float() * g).to(ctx.h_dtype), dw * g, db * g if ctx.has_bias else None,
                None, None, None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                         *, label_smoothing: float = 0.0, ignore_index: int = -100,
                         chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(smoothed loss sum, plain NLL sum) over the rows of ``h`` (N, D) against ``target`` (N,),
    with logits ``h @ weight.T + bias``; both fp32 device scalars, the NLL without a gradient.

    The same as ``F.cross_entropy(F.linear(h, weight, bias).float(), target, reduction="sum",
    ignore_index=..., label_smoothing=...)`` (and with smoothing 0 for the NLL), computed in the
    autocast dtype where autocast is on. ``chunk_rows``: rows per chunk (default: as many as fit
    :data:`CHUNK_ELEMENTS` logits).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    want_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    return _LinearCrossEntropy.apply(h, weight, bias, target, float(label_smoothing), ignore_index, rows, dtype,
                                     want_grad)
