"""What decoding is configured with, apart from the search itself: options, dtype, the model copy.

The trainer, translate/eval and scoring build a :class:`SearchOptions`, pick the weights' dtype
(:func:`decode_dtype`) and get a model in it (:func:`decoding_copy`) without importing the search
machinery (:mod:`streamnmt.inference.search`); both searches, eager and graph
(:mod:`streamnmt.inference.graph_search`), take the same options and the same sync interval
(:func:`sync_interval`) from here.
"""

from __future__ import annotations

import copy as copy_module
from dataclasses import dataclass

import torch

from streamnmt.configbase import check, check_choice
from streamnmt.models.transformer import Transformer


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How to search; the user-facing configs (translate.py) validate these and build one."""

    beam_size: int = 3  # 1 = greedy
    len_penalty: float = 0.6  # GNMT alpha: score / ((5 + len) / 6) ** alpha; 0 = raw log-prob
    max_len_a: float = 1.5  # output limit = max_len_a * source tokens + max_len_b ...
    max_len_b: int = 10  # ... capped by the model's max_positions - 1
    cached: bool = True  # False = re-run the decoder over the whole prefix each step (the reference)
    sync_every: int = 0  # check for finished sentences every N steps; 0 = auto (sync_interval)
    graph: bool = False  # on CUDA, decode through CUDA graphs (decode_graph.translate_ids); CPU: ignored


DTYPES = ("auto", "bf16", "fp16", "fp32")  # --dtype of translate and eval, --eval-dtype of train
_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` is a GPU with bf16 arithmetic in hardware (not emulated)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch without the including_emulation argument
        return torch.cuda.get_device_capability(device)[0] >= 8


def decode_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """The weights' dtype for decoding: ``auto`` is bf16 on a GPU that has it natively, else fp32.
    ``key`` names the setting in errors (``dtype`` for translate/eval, ``eval_dtype`` for train)."""
    check_choice(name, key, DTYPES)
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    check(name != "fp16" or device.type == "cuda", key, "fp16 decoding needs a CUDA device; use bf16 or fp32 on the CPU")
    return _DTYPE[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPE.items()}.get(dtype, str(dtype))


def decoding_copy(model: Transformer, dtype: torch.dtype, copy: Transformer | None = None, *,
                  separate: bool = False) -> Transformer:
    """``model`` itself for its own dtype (unless ``separate``), else ``copy`` (a cast copy made on
    the first call) with ``model``'s current weights copied in: the trainer decodes its BLEU pass in
    bf16 while it trains in fp32, and the copy's weights stay at the same addresses, so captured
    decoding graphs stay valid. ``separate``: a copy even in the model's dtype (a pass that decodes
    while the model trains on)."""
    if next(model.parameters()).dtype == dtype and not separate:
        return model
    if copy is None or copy is model:
        copy = copy_module.deepcopy(model).to(dtype)
    with torch.no_grad():
        for dst, src in zip(copy.parameters(), model.parameters()):
            dst.copy_(src)
    return copy.train(model.training)


def sync_interval(device: torch.device) -> int:
    """Steps between checks for finished sentences when SearchOptions.sync_every is 0.

    Each check is a host-device sync, and it retires finished sentences from the batch. On the CPU
    a "sync" costs nothing and smaller batches do less work, so we check every step. On a GPU,
    decoding steps are small and launch-bound: a row of a finished sentence left in the batch for
    a few more steps costs almost nothing, while each sync makes the host wait for the GPU before
    it queues the next step. So we check every 4th step, which wastes at most 3 steps per sentence.
    Measured (scripts/bench_decode.py, base model, beam 3, batch 64 and 256; docs/PERFORMANCE.md,
    "Decoding"): intervals 1, 2, 4, 8 and 16 gave the same sentences/s within the run-to-run spread, so the
    choice rests on the argument above, not on a measured gain.
    """
    return 1 if device.type == "cpu" else 4
