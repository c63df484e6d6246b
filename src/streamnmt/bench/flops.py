"""Model FLOPs of a training step, and the device's peak rate: the MFU column.

MFU (model FLOPs utilisation) says how much of the hardware's arithmetic a step uses: the FLOPs
the model needs for a batch, divided by the wall time, over the device's peak dense rate for the
precision in use. It is counted from the model's shape, not measured, in the usual way (Kaplan et
al.; PaLM's appendix):

* only matrix products count (2 FLOPs per multiply-add); embeddings, norms, softmax, dropout and
  the optimizer are left out;
* on the padded batch (B, S source positions, T target positions): the kernels compute over
  padding as well, so padded positions count;
* attention scores and weighted values as dense S x S / T x T products (the causal mask's skipped
  half is counted, as PaLM does);
* backward = 2 x forward, so a training step = 3 x forward.

Peak rates are vendors' dense (no sparsity) figures, looked up by device name; an unknown device
gives ``None`` and the table prints "n/a".
"""

from __future__ import annotations

import torch

from streamnmt.models.transformer import ModelShape


def forward_flops(shape: ModelShape, b: int, s: int, t: int) -> int:
    """Matrix-product FLOPs of one forward pass over a (B, S, T) batch."""
    d, n, ff, v = shape.d_model, shape.n_layers, shape.d_ff, shape.tgt_vocab
    src, tgt = b * s, b * t  # padded token positions
    attn_proj = 4 * 2 * d * d  # q, k, v and output projections, per token
    ffn = 2 * 2 * d * ff       # two linear layers, per token
    encoder = n * src * (attn_proj + ffn + 2 * 2 * s * d)  # + scores (QK^T) and values (AV) over S keys
    decoder = n * (tgt * (attn_proj + 2 * 2 * t * d)        # self-attention over T keys
                   + tgt * (2 * 2 * d * d + 2 * 2 * s * d)  # cross-attention: q and output, over S keys
                   + src * 2 * 2 * d * d                    # cross-attention k, v of the encoder output
                   + tgt * ffn)
    generator = tgt * 2 * d * v
    return encoder + decoder + generator


def real_token_flops(shape: ModelShape, src_tokens: int, tgt_tokens: int) -> int:
    """Training FLOPs (3 x forward) of the real tokens alone: every matrix product a token takes part
    in (projections, feed-forward, generator), none for padding. Attention scores and values, which
    grow with each pair's own length (~10-30 tokens here, under 2 % of a base model's FLOPs), are
    left out: a packed row's attention over other pairs is masked work, not useful work."""
    d, n, ff, v = shape.d_model, shape.n_layers, shape.d_ff, shape.tgt_vocab
    attn_proj, ffn = 4 * 2 * d * d, 2 * 2 * d * ff
    encoder = n * src_tokens * (attn_proj + ffn)
    decoder = n * (tgt_tokens * (attn_proj + 2 * 2 * d * d + ffn) + src_tokens * 2 * 2 * d * d)
    return 3 * (encoder + decoder + tgt_tokens * 2 * d * v)


def training_flops(shape: ModelShape, b: int, s: int, t: int) -> int:
    """Forward + backward (2 x forward) of one training step."""
    return 3 * forward_flops(shape, b, s, t)


# (substring of torch.cuda.get_device_name, dense TFLOP/s by precision); first match wins.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
]


def precision(amp: str) -> str:
    """The matmul precision a run uses: bf16/fp16 under autocast, else tf32 if allowed, else fp32."""
    if amp in ("bf16", "fp16"):
        return amp
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device_name: str, amp: str) -> float | None:
    """Peak dense FLOP/s of ``device_name`` at the precision ``amp`` implies, or None if unknown."""
    prec = precision(amp)
    for key, rates in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            rate = rates.get(prec)
            return rate * 1e12 if rate else None
    return None
