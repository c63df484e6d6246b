"""Attention masks of packed rows: attention never crosses the pairs packed into one row.

A packed row (:mod:`streamnmt.data.packing`) holds several pairs; ``src_seg``/``tgt_seg`` number
them 1, 2, ... (0 on padding). Three masks follow from the segment ids alone:

* encoder self-attention: query and key in the same source segment;
* decoder self-attention: same target segment, and causal;
* cross-attention: target segment ``k`` sees source segment ``k`` only.

Padding positions (segment 0) see the other padding positions (themselves at least) and, across
attention, every source position: no query row is ever fully masked, which would make SDPA return
NaN and poison the gradients of the real rows (see :mod:`streamnmt.models.masks`).

Three implementations, chosen by ``--attention``:

* ``sdpa``: dense boolean masks ``(B, 1, Tq, Tk)`` built on the device from the segment ids (a few
  elementwise kernels, no host sync, capturable), fed to ``F.scaled_dot_product_attention``
  (the memory-efficient kernel on the GPU; attention dropout as for unpacked batches);
* ``flex``: ``torch.nn.attention.flex_attention`` with block masks (blocks of fully masked keys
  are skipped). Needs torch >= 2.5 and a compiled kernel; it has no attention-probability dropout,
  so training with it drops only the other dropouts. Falls back to ``sdpa`` where it is missing;
* ``triton``: :mod:`streamnmt.models.segattn_triton`, Triton kernels that visit only the tiles of
  positions near each pair's own (:class:`SegmentRanges`); CUDA, head dims a power of two from 16,
  no attention dropout either. Falls back to ``sdpa`` where it cannot run.

``auto`` is ``triton`` where it runs (a CUDA GPU of compute capability 8.0 or newer, no attention
dropout in the recipe: :func:`auto_attention`), else ``sdpa``; ``streamnmt bench --attention``
measures them at the packed shape.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from streamnmt import setupclock
from streamnmt.models import prebuild
from streamnmt.models.segments import SegmentRanges, segment_ranges

ATTENTION_CHOICES = ("auto", "sdpa", "flex", "triton")


@dataclass
class SegmentMasks:
    """The three attention masks of a packed batch (dense bool tensors or flex BlockMasks) and the
    positions of each token within its pair."""

    enc: Any
    dec: Any
    cross: Any
    src_pos: torch.Tensor
    tgt_pos: torch.Tensor


def dense_masks(src_seg: torch.Tensor, tgt_seg: torch.Tensor, dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(enc (B,1,S,S), dec (B,1,T,T), cross (B,1,T,S)) boolean masks, True = may attend; with a
    floating ``dtype``, additive masks of that dtype instead (0 = may attend, -inf = may not)."""
    t = tgt_seg.size(1)
    enc = src_seg[:, :, None] == src_seg[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=tgt_seg.device).tril_()
    dec = (tgt_seg[:, :, None] == tgt_seg[:, None, :]) & causal
    cross = (tgt_seg[:, :, None] == src_seg[:, None, :]) | (tgt_seg == 0)[:, :, None]
    masks = enc[:, None], dec[:, None], cross[:, None]
    if dtype is None:
        return masks
    return tuple(torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
                 for m in masks)  # type: ignore[return-value]


def sdpa_mask_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of the packed masks fed to SDPA: autocast's where it is on, so that the attention
    kernels read an additive mask of their own dtype (a boolean one is turned into that on every
    call, forward and backward: docs/PERFORMANCE.md, "Masks, and attention's share of the step"); None (boolean masks) otherwise."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def flex_importable() -> str | None:
    """None if this torch has FlexAttention, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    return None


def flex_available(device: torch.device) -> str | None:
    """None if FlexAttention can train on ``device``, else why not (it has no CPU backward)."""
    why = flex_importable()
    if why is None and device.type != "cuda":
        why = f"FlexAttention trains on CUDA only (no backward on {device.type})"
    return why


def triton_available(device: torch.device, head_dim: int | None = None) -> str | None:
    """None if the Triton segment kernels can train on ``device`` at ``head_dim``, else why not."""
    if device.type != "cuda":
        return f"the Triton kernels train on CUDA only (not on {device.type})"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"head dim {head_dim} is not a power of two from 16"
    return None


@functools.lru_cache(maxsize=None)
def _triton_builds(index: int, head_dim: int) -> str | None:
    """None if the Triton segment kernels build and run forward and backward on GPU ``index``, else
    why not: ``import triton`` succeeds without the C compiler and ``ptxas`` that building a kernel
    needs. A tiny call, once per process (its kernels land in Triton's cache), before any capture."""
    try:
        with setupclock.timed("Triton kernel build check"):
            triton_probe(torch.device("cuda", index), _check_dtype(index), head_dim)
    except Exception as e:  # a compiler missing, a kernel that does not build here: say which
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"the Triton kernels do not build here ({type(e).__name__}: {first})"
    return None


def _check_dtype(index: int) -> torch.dtype:
    """The dtype the build check runs the kernels in: the training's under ``--amp auto``."""
    with torch.cuda.device(index):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def build_in_child(argv: list[str]) -> int:
    """The build of one of :mod:`streamnmt.models.prebuild`'s child processes (``INDEX HEAD_DIM AMP
    [JOBS]``), into Triton's on-disk cache: with ``JOBS`` (``VARIANT:KERNEL[+KERNEL][:AMP]`` joined by
    commas, e.g. ``0:fwd,1:dq``) only those launches (:func:`probe_kernels`), in the build check's
    dtype or, with ``:AMP``, in that ``--amp``'s where it is another; without, the whole build check
    of :func:`_triton_builds` and that of the training's dtype where ``--amp`` names another. Nothing
    on a GPU ``auto`` does not pick the kernels for."""
    index, head_dim, amp = int(argv[0]), int(argv[1]), argv[2]
    device = torch.device("cuda", index)
    if torch.cuda.get_device_capability(device) < (8, 0):
        return 0
    checked = _check_dtype(index)
    if len(argv) > 3:
        for variant, kernels, job_amp in parse_jobs(argv[3]):
            dtype = checked if job_amp is None else AMP_DTYPES[job_amp]
            if job_amp is None or dtype != checked:  # the check's dtype: built by the job without ``:AMP``
                probe_kernels(device, dtype, head_dim, variant, kernels)
        return 0
    dtypes = [checked]
    trained = AMP_DTYPES.get(amp)
    if trained is not None and trained not in dtypes:
        dtypes.append(trained)
    for dtype in dtypes:
        triton_probe(device, dtype, head_dim)
    return 0


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": torch.float32}  # --amp's training dtypes


def parse_jobs(spec: str) -> list[tuple[int, tuple[str, ...], str | None]]:
    """``VARIANT:KERNEL[+KERNEL][:AMP]`` jobs joined by commas -> (variant, kernels, amp or None)."""
    from streamnmt.models.segattn_triton import KERNELS

    jobs = []
    for job in spec.split(","):
        parts = job.split(":")
        kernels = tuple(parts[1].split("+")) if len(parts) in (2, 3) else ()
        if (len(parts) not in (2, 3) or not parts[0].isdigit() or int(parts[0]) >= len(VARIANTS)
                or not kernels or any(k not in KERNELS for k in kernels)
                or (len(parts) == 3 and parts[2] not in AMP_DTYPES)):
            raise ValueError(f"Triton build job {job!r}: VARIANT:KERNEL[+KERNEL][:AMP], a variant below "
                             f"{len(VARIANTS)}, kernels of {', '.join(KERNELS)}, AMP one of {', '.join(AMP_DTYPES)}")
        jobs.append((int(parts[0]), kernels, parts[2] if len(parts) == 3 else None))
    return jobs


VARIANTS = ((False, False), (True, False), (False, True))  # (causal, cross): encoder, decoder, cross
PROBE_LENGTH = 32  # positions of the build check's one segment


def _probe_ranges(device: torch.device, variant: int) -> SegmentRanges:
    """The build check's segment ranges of ``variant``: one segment of :data:`PROBE_LENGTH` positions."""
    causal, cross = VARIANTS[variant]
    seg = torch.ones(1, PROBE_LENGTH, dtype=torch.int32, device=device)
    return segment_ranges(seg, seg, causal=causal, cross=cross)


def probe_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, variant: int,
                  kernels: tuple[str, ...]) -> None:
    """Only ``kernels`` (:data:`streamnmt.models.segattn_triton.KERNELS`) of ``variant``, launched on
    the input of :func:`triton_probe` (:func:`streamnmt.models.segattn_triton.launch_alone`): the
    entries of Triton's cache that its forward and backward compile, one kernel at a time, so that
    child processes build them side by side."""
    from streamnmt.models.segattn_triton import launch_alone

    on_gpu = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_gpu:  # Triton launches on the current device
        q = torch.zeros(1, 1, PROBE_LENGTH, head_dim, dtype=dtype, device=device)
        launch_alone(kernels, q, _probe_ranges(device, variant))


def triton_probe(device: torch.device, dtype: torch.dtype, head_dim: int,
                 variants: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
    """One tiny forward and backward of each of the Triton segment kernels' three variants (encoder,
    causal decoder, cross attention), as :func:`_triton_builds` runs them (on the CPU under Triton's
    interpreter in the tests). The kernels are not specialised on lengths or head counts, so these
    are the kernels the training step launches, compiled once here and not again at graph capture.
    Returns the encoder variant's gradient of a (1, 1, 32, head_dim) input (normal, from a generator
    of its own seeded 0: the run's random streams stay untouched) used as queries, keys and values,
    one segment of 32 positions (of the first variant in ``variants``: indices into :data:`VARIANTS`)."""
    from streamnmt.models.segattn_triton import segment_attention

    on_gpu = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_gpu:  # Triton launches on the current device
        gen = torch.Generator(device=device).manual_seed(0)
        grads = []
        for v in variants:
            q = torch.randn(1, 1, PROBE_LENGTH, head_dim, device=device, generator=gen).to(dtype).requires_grad_()
            segment_attention(q, q, q, _probe_ranges(device, v)).float().sum().backward()
            grads.append(q.grad)
    return grads[0]


def triton_runs(device: torch.device, head_dim: int | None = None, log=print) -> str | None:
    """None if the Triton segment kernels can train on ``device`` at ``head_dim``, built and run once
    to make sure (:func:`triton_available`, then a tiny call), else why not. Where child processes
    build them (:mod:`streamnmt.models.prebuild`): on one process (no torchrun) they are trusted and
    the check is owed until :func:`settle_triton`, just before the step first launches them, so the
    set-up's data and model phases run beside their compile; under torchrun they are waited for here
    (the other ranks then load them from the cache). One line where the children failed."""
    why = triton_available(device, head_dim)
    if why is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if prebuild.pending(index, head_dim or 64) is not None and os.environ.get("WORLD_SIZE", "1") == "1":
            _OWED[(index, head_dim or 64)] = None
            return None
        why = _wait_and_build(index, head_dim or 64, log)
    return why


_OWED: dict[tuple[int, int], None] = {}  # (GPU, head dim): builds trusted to the children, not yet checked


def _wait_and_build(index: int, head_dim: int, log) -> str | None:
    cache = prebuild.pending(index, head_dim)  # where the children put the kernels (None: no children)
    with setupclock.timed("waiting for the Triton kernels' build in child processes"):
        note = prebuild.wait(index, head_dim)
    if note is not None:
        log(f"model: {note}")
    with prebuild.triton_cache(cache):
        return _triton_builds(index, head_dim)


def settle_triton(log=print) -> str | None:
    """The build check :func:`triton_runs` owes (None where none is owed or the kernels built and
    ran), waiting for the children first: called once the set-up has done all it can beside them,
    before anything launches the kernels. Else why they cannot train here: the caller then trains
    with ``sdpa`` and says so."""
    why = None
    while _OWED:
        (index, head_dim), _ = _OWED.popitem()
        why = _wait_and_build(index, head_dim, log) or why
    return why


# ``auto`` picks the kernels only at the head dims measured (64, docs/PERFORMANCE.md) and up to 128:
# larger tiles of keys and values than that may not fit a GPU's shared memory at the fixed tiles.
AUTO_TRITON_MAX_HEAD_DIM = prebuild.AUTO_TRITON_MAX_HEAD_DIM


def auto_attention(device: torch.device, head_dim: int | None = None, attention_dropout: float = 0.0,
                   log=print) -> str:
    """What ``--attention auto`` trains packed batches with: ``triton`` on an NVIDIA GPU of compute
    capability 8.0 or newer where the kernels build and run (:func:`triton_runs`), at head dims up to
    128, when the recipe has no attention dropout (they have none); else ``sdpa``. The Triton kernels
    made the packed base-model step faster than SDPA's dense masks, compiled or not,
    at 4,096 and 16,384 tokens, and trained to the same dev BLEU (docs/PERFORMANCE.md, "Triton segment
    kernels"); older GPUs were not measured, nor AMD's (ROCm builds keep ``sdpa``). Silent, but for
    one line where Triton is installed on such a GPU and its kernels do not build, and one where their
    build in a child process (:mod:`streamnmt.models.prebuild`) failed and this process builds them."""
    if (attention_dropout or torch.version.hip is not None or triton_available(device, head_dim) is not None
            or (head_dim or 64) > AUTO_TRITON_MAX_HEAD_DIM or torch.cuda.get_device_capability(device) < (8, 0)):
        return "sdpa"
    why = triton_runs(device, head_dim, log)
    if why is not None:
        log(f"model: --attention auto: {why}; using sdpa")
        return "sdpa"
    return "triton"


def resolve_attention(choice: str, device: torch.device, log=print, head_dim: int | None = None,
                      attention_dropout: float = 0.0) -> str:
    """``auto`` -> :func:`auto_attention`; ``flex`` or ``triton`` where it cannot run -> ``sdpa`` with
    one log line."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}")
    if choice == "auto":
        return auto_attention(device, head_dim, attention_dropout, log)
    if choice in ("flex", "triton"):
        why = flex_available(device) if choice == "flex" else triton_runs(device, head_dim, log)
        if why is None:
            return choice
        log(f"model: --attention {choice} unavailable ({why}); using sdpa")
    return "sdpa"


def flex_masks(src_seg: torch.Tensor, tgt_seg: torch.Tensor,
               block_size: int | None = None) -> tuple[Any, Any, Any]:
    """(enc, dec, cross) FlexAttention BlockMasks of the same rules as :func:`dense_masks`, in blocks
    of ``block_size`` positions (None: FlexAttention's default, 128)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = src_seg.shape
    t = tgt_seg.size(1)
    dev = src_seg.device

    def enc(bi, h, q, k):
        return src_seg[bi, q] == src_seg[bi, k]

    def dec(bi, h, q, k):
        return (tgt_seg[bi, q] == tgt_seg[bi, k]) & (k <= q)

    def cross(bi, h, q, k):
        return (tgt_seg[bi, q] == src_seg[bi, k]) | (tgt_seg[bi, q] == 0)

    sized = {} if block_size is None else {"BLOCK_SIZE": block_size}
    block = functools.partial(create_block_mask, B=b, H=None, device=dev, **sized)
    return block(enc, Q_LEN=s, KV_LEN=s), block(dec, Q_LEN=t, KV_LEN=t), block(cross, Q_LEN=t, KV_LEN=s)


def segment_masks(kind: str, src_seg: torch.Tensor, tgt_seg: torch.Tensor, src_pos: torch.Tensor,
                  tgt_pos: torch.Tensor) -> SegmentMasks:
    if kind == "flex":
        return SegmentMasks(*flex_masks(src_seg, tgt_seg), src_pos=src_pos, tgt_pos=tgt_pos)
    if kind == "triton":
        return SegmentMasks(segment_ranges(src_seg, src_seg, causal=False, cross=False),
                            segment_ranges(tgt_seg, tgt_seg, causal=True, cross=False),
                            segment_ranges(tgt_seg, src_seg, causal=False, cross=True), src_pos=src_pos, tgt_pos=tgt_pos)
    return SegmentMasks(*dense_masks(src_seg, tgt_seg, sdpa_mask_dtype(src_seg.device)), src_pos=src_pos,
                        tgt_pos=tgt_pos)


def is_block_mask(mask: Any) -> bool:
    return mask is not None and not isinstance(mask, (torch.Tensor, SegmentRanges))


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """FlexAttention of (B, h, T, dk) tensors under ``block_mask``: compiled on CUDA (the eager
    path materialises the scores), eager elsewhere and inside an outer ``torch.compile``."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()(q, k, v, block_mask=block_mask)
    return flex_attention(q, k, v, block_mask=block_mask)
