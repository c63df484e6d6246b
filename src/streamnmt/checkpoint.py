"""Checkpoints: everything needed to rebuild the model, continue training exactly, or translate.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)``: a file that is not one of ours is refused and nothing in it is
executed. It is written atomically (temporary file, fsync, rename): a kill at any moment leaves
the previous good checkpoint in place.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import pickle
import random
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamnmt.errors import InputError
from streamnmt.fsutil import atomic_path, atomic_write, streamnmt_home

FORMAT, VERSION = "streamnmt-checkpoint", 1


def rng_state() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch's CPU generator and the generator of the
    current CUDA device only (a rank's own GPU; the others belong to other ranks, and a rank may
    see just one device)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s states; the CUDA one into the current device. A checkpoint of
    earlier versions holds a list of every visible device's: the current device's entry is used
    (the first one if this process sees fewer devices than the saving one did)."""
    random.setstate(_to_tuple(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # earlier format: one state per visible device
            if not cuda:
                return
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` (plus format marker) to ``path`` atomically."""
    payload = {"format": FORMAT, "version": VERSION, **state}
    with atomic_path(path) as tmp:
        try:
            torch.save(payload, tmp)
        except RuntimeError as e:
            # torch.save's zip writer reports a write that failed (a full disk, a file-size limit) as a
            # RuntimeError of its own wording; an OSError naming the file is the one line a user gets.
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise OSError(errno.EIO, f"writing the checkpoint failed (a full disk or a file-size limit?): "
                                     f"{reason}", str(path)) from None


def load_checkpoint(path: str | Path, flag: str = "--weights", mmap: bool = False) -> dict[str, Any]:
    """Load a streamnmt checkpoint safely (``weights_only``); clear InputError for anything else.
    ``mmap``: the tensors mapped from the file, not read (a caller that reads the checkpoint's records only)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{flag}: checkpoint not found: {path}")
    if path.suffix == ".safetensors":  # written beside best.pt for other tools: the weights alone
        raise InputError(f"{flag}: {path} holds the weights alone (safetensors, for other tools); "
                         f"pass the streamnmt checkpoint beside it: {path.with_suffix('.pt')}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
            AttributeError, ImportError, IndexError, KeyError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{flag}: {path} is not a valid streamnmt checkpoint (truncated, corrupt or "
                         f"not a safe weights file: {reason[:200]})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise InputError(f"{flag}: {path} is not a streamnmt checkpoint (no '{FORMAT}' marker)")
    if ckpt.get("version", 0) > VERSION:
        raise InputError(f"{flag}: {path} was written by a newer streamnmt (format version "
                         f"{ckpt['version']} > {VERSION})")
    return ckpt


def load_model_weights(model: torch.nn.Module, ckpt: dict[str, Any], path: str | Path,
                       flag: str = "--weights") -> None:
    """Copy a checkpoint's weights into ``model``; a shape mismatch names the first bad tensor.

    Tied embeddings stay one tensor: the model re-ties after loading (``tie_weights``), and a
    checkpoint whose tying differs from the model's is refused (loading untied weights into a tied
    model would keep whichever of the two tensors came last).
    """
    state = ckpt["model"]
    want = getattr(getattr(model, "shape", None), "tie_embeddings", "none")
    have = (ckpt.get("model_shape") or {}).get("tie_embeddings", "none")
    if want != have:
        raise InputError(f"{flag}: {path} was trained with --tie-embeddings {have}; this model has "
                         f"--tie-embeddings {want} (use the same setting)")
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise InputError(f"{flag}: {path} holds another model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise InputError(f"{flag}: {path} holds another model shape: {k} is {tuple(v.shape)}, "
                             f"this model has {tuple(own[k].shape)}")
    model.load_state_dict(state)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def tokenizer_entry(tok: Any) -> dict[str, Any]:
    """A checkpoint's record of one tokenizer: where it was, its hash and size, and the model itself.

    The SentencePiece model travels inside the checkpoint (as a uint8 tensor, so that
    ``weights_only`` loading accepts it on every torch version): a checkpoint copied alone to
    another machine translates, evaluates and exports without the corpus directory.
    """
    data = tok.model_bytes()
    return {"path": str(Path(tok.path).resolve()), "sha256": tok.sha256, "vocab_size": tok.vocab_size,
            "model": torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()}


def embedded_tokenizer(ckpt: dict[str, Any], side: str, path: str | Path) -> Any | None:
    """The ``side`` ("src"/"tgt") tokenizer embedded in ``ckpt`` (None in checkpoints that only name
    a path); its bytes must hash to the recorded sha256."""
    from streamnmt.data import Tokenizer

    meta = (ckpt.get("tokenizers") or {}).get(side) or {}
    blob = meta.get("model")
    if blob is None:
        return None
    data = blob.numpy().tobytes() if isinstance(blob, torch.Tensor) else bytes(blob)
    name = f"{path}#{side}.model"
    if meta.get("sha256") and hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise InputError(f"{name}: the embedded {side} tokenizer is damaged (sha256 differs from the record)")
    return Tokenizer.from_bytes(data, name)


def keep_step_copy(last: Path, step: int, keep: int) -> Path:
    """Keep ``last`` (just written) as ``step_NNNNNN.pt`` beside it, and only the ``keep`` newest.

    The copy is a hard link where the file system allows one (no second write of a large file;
    ``last.pt`` is later replaced by a rename, which leaves the linked file as it is), else a copy.
    """
    target = last.parent / f"step_{step:06d}.pt"
    with atomic_path(target) as tmp:
        tmp.unlink()
        try:
            os.link(last, tmp)
        except OSError:
            shutil.copyfile(last, tmp)
    steps = sorted(last.parent.glob("step_*.pt"), key=lambda p: int(p.stem[5:]) if p.stem[5:].isdigit() else -1)
    for old in steps[:-keep]:
        old.unlink(missing_ok=True)
    return target


# -- safetensors ---------------------------------------------------------------------------------
# The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
# data_offsets}}, then the raw tensor bytes; written here without the extra dependency.
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
              torch.uint8: "U8", torch.bool: "BOOL"}


def save_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    import json

    header: dict[str, Any] = {"__metadata__": metadata or {}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # 0-dim too
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # align the data section
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for b in blobs:
            f.write(b)


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, read from its header alone."""
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n < 100_000_000:
            raise InputError(f"{path}: not a valid safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise InputError(f"{path}: not a valid safetensors file ({e})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    import json

    inverse = {v: k for k, v in _ST_DTYPES.items()}
    raw = Path(path).read_bytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            buf = bytearray(raw[8 + n + a:8 + n + b])
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(inverse[info["dtype"]]).reshape(info["shape"])
        return out
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise InputError(f"{path}: not a valid safetensors file ({e})") from None


def embedded_tokenizers(ckpt: dict[str, Any], path: str, out: Path | None = None,
                         shared: bool | None = None, by_hash: bool = False) -> dict[str, str]:
    """Write the tokenizers a checkpoint embeds to files and return the data settings that name
    them, so that a run goes on with the very models the checkpoint was trained with even where
    the corpus directory's tokenizers are gone. ``out``: the directory (default: the run
    directory's ``tokenizer/``, for --resume); ``shared``: one model for both sides (default: as
    the checkpoint's run had it); ``by_hash``: files named by their sha256, else src/tgt. Empty for older checkpoints, which only name their files."""
    from streamnmt.data.tokenizer import file_sha256

    toks = {side: embedded_tokenizer(ckpt, side, path) for side in ("src", "tgt")}
    if any(tok is None for tok in toks.values()):
        return {}
    if shared is None:
        shared = (ckpt.get("config") or {}).get("data", {}).get("shared_vocab", False)
    out = out or Path(path).resolve().parent.parent / "tokenizer"
    files = {}
    for side, tok in toks.items():
        files[side] = out / (f"{tok.sha256[:16]}.model" if by_hash else f"{side}.model")
        if not files[side].is_file() or file_sha256(files[side]) != tok.sha256:
            atomic_write(files[side], tok.model_bytes())
    # shared: the one model names both sides, replacing whatever file the run named for either
    return {"tokenizer_src": str(files["src"]), "tokenizer_tgt": str(files["src" if shared else "tgt"])}


def tokenizers_of_weights(job: Any, log: Callable[[str], None]) -> Any:
    """``--weights``: fine-tune with the tokenizers the checkpoint carries (its model's vocabulary)
    unless --tokenizer-src/--tokenizer-tgt name others; they are written, named by their hash, to
    ``$STREAMNMT_HOME/tokenizers/``, which config.yaml then records."""
    d = job.data
    if not job.run.weights or d.tokenizer_src or d.tokenizer_tgt:
        return job
    ckpt = load_checkpoint(job.run.weights)
    metas = ckpt.get("tokenizers") or {}
    one = (metas.get("src") or {}).get("sha256") == (metas.get("tgt") or {}).get("sha256")
    if d.shared_vocab and not one:
        return job  # two models cannot serve --shared-vocab: the data directory's shared model is used
    home = streamnmt_home() / "tokenizers"
    files = embedded_tokenizers(ckpt, job.run.weights, home, shared=d.shared_vocab, by_hash=True)
    if files:
        log(f"weights: tokenizers from {job.run.weights} ({', '.join(sorted(set(files.values())))})")
    return dataclasses.replace(job, data=dataclasses.replace(d, **files)) if files else job
