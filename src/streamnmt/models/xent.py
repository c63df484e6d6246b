"""The generator and the label-smoothed cross-entropy in one pass, without whole-batch logits.

At a real vocabulary the output layer's logits are the largest tensor of a step: batch x length x
32k, and the usual ``F.cross_entropy(logits.float(), ...)`` holds them in bf16, again in fp32, as
fp32 log-probabilities and as their gradient. Here the projection ``h @ W.T + b`` and the loss run
over row chunks of at most :data:`CHUNK_ELEMENTS` logits: each chunk's logits are made in the
compute dtype (the autocast dtype, else the input's), read by one fp32 softmax (its output is
the only fp32 copy), which is turned in place into their gradient and written once in the compute
dtype; that is multiplied into the gradients of ``h``, ``W`` and ``b`` at once. The backward then
only scales those by the incoming gradient, so nothing is recomputed and no chunk outlives its
loop iteration. Per chunk of C x V logits that is six passes over C x V values (the softmax's
read and write, the mean, the gradient's read and write, the bias gradient's read), against
fifteen for a separate fp32 copy, log-sum-exp, mean, exponential, subtraction, mask, bias sum
and cast.

The smoothed loss and the plain NLL come from the softmax. With smoothing ``e`` over ``V``
classes (PyTorch's definition, which spreads ``e`` over every class, the ignored one too):
``nll = lse - z_y = -log softmax(z)_y``, ``loss = (1 - e) * nll + e * (lse - mean(z)) = nll + e *
(z_y - mean(z))`` and ``dloss/dz = softmax(z) - (1 - e) * onehot(y) - e / V``. A token's NLL
saturates at 87.3 nats (a probability below fp32's smallest normal number); its gradient does
not. Rows whose target is ``ignore_index`` add nothing. Shapes are static and
nothing is read on the host, so CUDA graphs capture it and torch.compile traces it.
"""

from __future__ import annotations

import sys

import torch

from streamnmt.errors import one_line
from streamnmt.models import xent_triton

CHUNK_ELEMENTS = 2 ** 25  # logits per chunk (rows x vocabulary): 128 MB in fp32, ~1k rows at 32k
# With the Triton kernel a chunk is only its logits in the compute dtype (no fp32 softmax), so
# chunks are larger: fewer, larger matrix multiplies and fewer fp32 additions into the weight
# gradient. 2**27 logits per chunk: most of the speed of 2**28 at a lower peak memory
# (loss forward + backward at 16,384 x 32,000 in bf16; docs/PERFORMANCE.md).
FUSED_CHUNK_ELEMENTS = 2 ** 27


_FUSED = {"failed": None}  # why the Triton kernel is off for this process (it failed once), else None


def _fused_ok(h: torch.Tensor) -> bool:
    """Whether chunks go through the Triton kernel: on CUDA where Triton is importable, unless it
    failed once in this process (then the torch path, after one log line)."""
    return _FUSED["failed"] is None and xent_triton.available(h)


def _fused_rows(z: torch.Tensor, y: torch.Tensor, smoothing: float, ignore_index: int, want_grad: bool):
    """(row loss, row NLL, gradient: ``z`` itself) from :func:`streamnmt.models.xent_triton.xent_rows`, or
    None (and the torch path from now on, with one line on stderr) where the kernel cannot be built
    here. Inside a CUDA graph capture a failure is raised: the capture is then abandoned, and its
    warm-up has already run this kernel eagerly."""
    try:
        return (*xent_triton.xent_rows(z, y, smoothing, ignore_index, want_grad), z)
    except torch.cuda.OutOfMemoryError:  # memory, not the kernel: the torch path would need more
        raise
    except Exception as e:  # noqa: BLE001 -- a Triton build error has no common base class
        if z.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _FUSED["failed"] = msg = one_line(e, typed=True)
        print(f"loss: the fused cross-entropy kernel is unavailable ({msg}); using the torch path", file=sys.stderr)
        return None


def _torch_rows(z: torch.Tensor, y: torch.Tensor, smoothing: float, ignore_index: int, want_grad: bool):
    """The torch path of one chunk: (row loss, row NLL, both 0 on ignored rows; gradient (C, V) in
    z's dtype, or None)."""
    v = z.shape[1]
    p = torch.softmax(z, dim=-1, dtype=torch.float32)          # (C, V) fp32, one pass over z
    keep = y != ignore_index
    valid, y = keep.float(), y.masked_fill(~keep, 0)[:, None]  # (C,), (C, 1): a safe index
    row_nll = -p.gather(1, y).squeeze(1).clamp_min(torch.finfo(torch.float32).tiny).log()  # at most 87.3
    if smoothing:  # lse - mean(z) = nll + z_y - mean(z)
        z_y = z.gather(1, y).squeeze(1).float()
        row_loss = row_nll + smoothing * (z_y - z.mean(-1, dtype=torch.float32))
    else:
        row_loss = row_nll
    row_loss, row_nll = row_loss * valid, row_nll * valid
    if not want_grad:
        return row_loss, row_nll, None
    # dloss/dz = (softmax(z) - e / V - (1 - e) onehot(y)) * valid, written once in the compute
    # dtype (the subtraction and the row mask in fp32, rounded on the write)
    p.scatter_add_(1, y, torch.full_like(valid[:, None], smoothing - 1))
    gc = torch.empty((p.shape[0], v), dtype=z.dtype, device=z.device)
    torch.addcmul((valid * (-smoothing / v))[:, None], p, valid[:, None], out=gc)  # one pass
    return row_loss, row_nll, gc


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
            fused = _fused_ok(hc)
            start = 0
            while start < n:
                x, y = hc[start:start + rows], target[start:start + rows]  # (C, D), (C,)
                z = torch.addmm(b, x, w.t()) if b is not None else x @ w.t()  # (C, V), compute dtype
                # one kernel: the row losses, and the gradient written over z (None: torch path)
                out = _fused_rows(z, y, smoothing, ignore_index, want_grad) if fused else None
                if out is None and fused:  # the kernel failed: this chunk again, at the torch path's size
                    fused, rows = False, max(1, min(rows, CHUNK_ELEMENTS // v))
                    del z
                    continue
                if out is None:
                    out = _torch_rows(z, y, smoothing, ignore_index, want_grad)
                row_loss, row_nll, gc = out  # gc: the gradient (z itself on the kernel's path), or None
                del out, z  # no chunk's logits may outlive its iteration (gc is dropped below)
                loss += row_loss.sum()
                nll += row_nll.sum()
                if want_grad:
                    if db is not None:
                        db += gc.sum(0, dtype=torch.float32)
                    dh[start:start + rows] = gc @ w
                    if dtype == torch.float32:
                        dw.addmm_(gc.t(), x)
                    else:
                        dw += gc.t() @ x
                del gc  # before the next chunk's logits are made
                start += rows
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
    chunk = FUSED_CHUNK_ELEMENTS if _fused_ok(h) else CHUNK_ELEMENTS
    rows = chunk_rows or max(1, chunk // weight.shape[0])
    want_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias))
    return _LinearCrossEntropy.apply(h, weight, bias, target, float(label_smoothing), ignore_index, rows, dtype,
                                     want_grad)
