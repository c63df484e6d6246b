"""The label-smoothed cross-entropy of a chunk of logits in one Triton kernel, the gradient in place.

:mod:`streamnmt.models.xent` computes the loss chunk by chunk; on CUDA, where Triton is importable, each
chunk of logits ``z`` (C, V) goes through :func:`xent_rows`: one program per row reads the row
twice (an online max and sum of exponentials, the sum of logits and the target's logit; then the
gradient) and writes ``dloss/dz = (softmax(z) - e / V - (1 - e) onehot(y)) * valid`` over ``z``
itself, in its dtype. That is three passes over C x V values in the compute dtype (two reads, one
write), against the torch path's fp32 softmax and separate passes for the mean, the gradient and
its cast, and no fp32 copy of the chunk is ever made.

Per row it returns the smoothed loss ``nll + e * (z_y - mean(z))`` and the plain NLL ``lse - z_y``
(saturated at 87.3 nats, as the torch path's clamped probability), both 0 where the target is
``ignore_index``. Launches have static shapes and no host reads: CUDA graphs capture them. The
kernel is compiled on first use (before any capture: graph mode's warm-up steps run it eagerly).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: streamnmt.models.xent keeps its torch path
    triton = None

NLL_MAX = -math.log(torch.finfo(torch.float32).tiny)  # 87.3365...: -log of fp32's smallest normal
BLOCK = 4096  # logits per load: 8 KB of bf16, 8 iterations for a 32k vocabulary
WARPS = 8


def available(t: torch.Tensor) -> bool:
    """True where :func:`xent_rows` can run on ``t``: a CUDA tensor and Triton importable."""
    return triton is not None and t.is_cuda and t.dtype in (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:
    @triton.jit
    def _xent_rows(z_ptr, y_ptr, loss_ptr, nll_ptr, stride, V, smoothing, ignore_index, nll_max,
                   WANT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride
        y = tl.load(y_ptr + row)
        valid = y != ignore_index
        y_safe = tl.where(valid, y, 0)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max,
        s = tl.zeros([BLOCK], tl.float32)                # sum of exp(z - m),
        tot = tl.zeros([BLOCK], tl.float32)              # sum of z
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            s = s * alpha + tl.where(inside, tl.exp(x - m_new), 0.0)
            m = m_new
            tot += tl.where(inside, x, 0.0)
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        z_y = tl.load(z_row + y_safe).to(tl.float32)
        nll = tl.minimum(lse - z_y, nll_max)
        loss = nll + smoothing * (z_y - tl.sum(tot, 0) / V)
        vf = valid.to(tl.float32)
        tl.store(loss_ptr + row, loss * vf)
        tl.store(nll_ptr + row, nll * vf)
        if WANT_GRAD:
            floor = smoothing / V
            hit = 1.0 - smoothing
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                x = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - floor - tl.where(cols == y_safe, hit, 0.0)) * vf
                tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=inside)


def xent_rows(z: torch.Tensor, target: torch.Tensor, smoothing: float, ignore_index: int,
              want_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (smoothed loss, NLL), fp32 (C,), of logits ``z`` (C, V) against ``target`` (C,);
    with ``want_grad`` the loss's gradient with respect to ``z`` is written over ``z``. Targets must
    be ``ignore_index`` or in [0, V): the kernel reads the target's logit unchecked (a check would
    cost a host sync; in training the same ids are the decoder's inputs one position later, and
    its embedding lookup stops on an id out of range)."""
    c, v = z.shape
    if z.stride(1) != 1:
        raise ValueError("xent_rows needs logits contiguous along the vocabulary")
    loss = torch.empty(c, dtype=torch.float32, device=z.device)
    nll = torch.empty(c, dtype=torch.float32, device=z.device)
    _xent_rows[(c,)](z, target.contiguous(), loss, nll, z.stride(0), v, float(smoothing), int(ignore_index),
                     NLL_MAX, WANT_GRAD=bool(want_grad), BLOCK=BLOCK, num_warps=WARPS)
    return loss, nll
