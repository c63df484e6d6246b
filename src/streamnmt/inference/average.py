"""``streamnmt average``: the element-wise mean of several checkpoints' weights, as one checkpoint.

Averaging the last few checkpoints of a run (``--save-every S --keep-last 5`` keeps them as
``weights/step_NNNNNN.pt``) is the usual last step of the Transformer recipe: a smoother model,
often a little better than any single one. The inputs must hold the same model (shape, tying,
tokenizers); they are read one at a time and summed in float64, so memory stays at two models.
The output keeps the newest input's model shape, tokenizers and config, so it loads wherever a
checkpoint does (``translate``, ``eval``, ``train --weights``). It carries no optimizer state:
``--resume`` refuses it with a message pointing to ``--weights``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamnmt.checkpoint import load_checkpoint, save_checkpoint
from streamnmt.configbase import check, opt
from streamnmt.errors import InputError


@dataclass(kw_only=True)
class AverageConfig:
    inputs: list[str] | None = opt(None, "checkpoints to average, e.g. runs/train/exp/weights/step_*.pt (required)")
    out: str | None = opt(None, "the averaged checkpoint to write, e.g. avg.pt (required)")

    def __post_init__(self) -> None:
        check(bool(self.inputs), "inputs", "is required: two or more checkpoints, e.g. --inputs a.pt b.pt c.pt")
        check(bool(self.out), "out", "is required: the file to write, e.g. --out avg.pt")
        check(len(self.inputs or []) >= 2, "inputs", "needs two or more checkpoints to average, e.g. --inputs a.pt b.pt")
        resolved = [Path(p).resolve() for p in self.inputs or []]
        check(len(set(resolved)) == len(resolved), "inputs", "lists a checkpoint twice")


def average_checkpoints(paths: list[str | Path]) -> dict[str, Any]:
    """A checkpoint whose ``model`` is the element-wise mean of the inputs' (shared tensors stay shared)."""
    sums: dict[str, torch.Tensor] = {}
    first: dict[str, Any] = {}
    aliases: dict[str, str] = {}  # key -> the first key sharing its storage (tied embeddings)
    ckpt: dict[str, Any] = {}
    for i, path in enumerate(paths):
        ckpt = load_checkpoint(path, flag="--inputs")
        if "model" not in ckpt or "model_shape" not in ckpt:
            raise InputError(f"--inputs: {path} has no model weights or model_shape entry")
        state = ckpt["model"]
        if i == 0:
            first = ckpt
            seen: dict[int, str] = {}
            for k, v in state.items():
                aliases[k] = seen.setdefault(v.untyped_storage().data_ptr(), k) if v.numel() else k
            sums = {k: v.double().clone() for k, v in state.items() if aliases[k] == k}
            continue
        if _architecture(ckpt["model_shape"]) != _architecture(first["model_shape"]):
            raise InputError(f"--inputs: {path} holds another model ({ckpt['model_shape']}) than "
                             f"{paths[0]} ({first['model_shape']})")
        if set(state) != set(aliases):
            raise InputError(f"--inputs: {path} holds other weights than {paths[0]}")
        for side in ("src", "tgt"):  # two corpora at the same vocabulary sizes give the same shapes
            want, have = _tokenizer_sha(first, side), _tokenizer_sha(ckpt, side)
            if want != have:
                raise InputError(f"--inputs: {path} was trained with another {side} tokenizer than "
                                 f"{paths[0]} (sha256 {str(have)[:12]} vs {str(want)[:12]}): its weights "
                                 "index other pieces")
        for k, total in sums.items():
            total += state[k].double()
    n = len(paths)
    out_state = {k: (sums[aliases[k]] / n).to(first["model"][k].dtype) for k in first["model"] if aliases[k] == k}
    model = {k: out_state[aliases[k]] for k in first["model"]}  # in the inputs' key order
    return {"model": model, "model_shape": ckpt["model_shape"], "tokenizers": ckpt.get("tokenizers"),
            "config": ckpt.get("config"), "step": ckpt.get("step", 0), "averaged_from": [str(p) for p in paths]}


# Training settings that no weight depends on: checkpoints that differ only in them average (a run
# resumed across the release that split dropout into three settings records them differently).
_TRAINING_ONLY = ("dropout", "attention_dropout", "activation_dropout")


def _tokenizer_sha(ckpt: dict[str, Any], side: str) -> str | None:
    return ((ckpt.get("tokenizers") or {}).get(side) or {}).get("sha256")


def _architecture(shape: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in shape.items() if k not in _TRAINING_ONLY}


def run_average(cfg: AverageConfig) -> int:
    paths = list(cfg.inputs or [])
    out = Path(cfg.out or "")
    if out.resolve() in {Path(p).resolve() for p in paths}:
        raise InputError(f"--out: {out} is one of the inputs; write the average to a new file")
    if out.is_dir():
        raise InputError(f"--out: {out} is a folder; name the file to write, e.g. {out / 'avg.pt'}")
    avg = average_checkpoints(paths)
    try:
        save_checkpoint(out, avg)
    except OSError as e:
        raise InputError(f"--out: cannot write {out}: {e.strerror or e}") from None
    print(f"averaged {len(paths)} checkpoints -> {out}", file=sys.stderr)
    return 0
