"""The on-disk cache of tokenized splits under ``DIR/cache/``, keyed by everything that shapes it.

A cache entry is valid only for the exact bytes it was built from: its key hashes the source
file(s) content, both tokenizer models, ``max_len``, the overlong policy, the language keys and
:data:`CACHE_VERSION` (bumped when the layout changes). Each entry is a directory
``DIR/cache/{split}-{key[:16]}/`` holding one ``.npy`` per array and a ``meta.json`` written last;
an entry without a matching ``meta.json`` is ignored. A build that fails leaves no entry behind,
and a new entry for a split removes the split's older ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from streamnmt.data.corpus import ARRAYS, TokenizedCorpus
from streamnmt.data.readers import SplitSource
from streamnmt.data.tokenizer import Tokenizer, file_sha256
from streamnmt.fsutil import atomic_path, atomic_write

CACHE_VERSION = 1


def cache_key(source: SplitSource, src_tok: Tokenizer, tgt_tok: Tokenizer, *, max_len: int,
              overlong: str, src_lang: str, tgt_lang: str) -> dict[str, Any]:
    """The facts a cache entry depends on; its name is a hash of them."""
    return {
        "version": CACHE_VERSION,
        "split": source.split,
        "format": source.fmt,
        "sources": [file_sha256(p) for p in source.paths],
        "src_tokenizer": src_tok.sha256,
        "tgt_tokenizer": tgt_tok.sha256,
        "max_len": max_len,
        "overlong": overlong,
        "langs": [src_lang, tgt_lang],
    }


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def entry_dir(cache_dir: Path, key: dict[str, Any]) -> Path:
    return cache_dir / f"{key['split']}-{key_hash(key)[:16]}"


def load_entry(cache_dir: Path, key: dict[str, Any]) -> tuple[TokenizedCorpus, dict[str, int]] | None:
    """The cached corpus and its build stats, or None when there is no valid entry."""
    directory = entry_dir(cache_dir, key)
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("key") != key:
        return None
    try:
        corpus = TokenizedCorpus.load(directory, key["split"])
    except (OSError, ValueError):
        return None
    if len(corpus) != meta["stats"]["pairs"]:
        return None
    return corpus, meta["stats"]


def save_entry(cache_dir: Path, key: dict[str, Any], arrays: dict[str, np.ndarray],
               stats: dict[str, int]) -> TokenizedCorpus:
    """Write an entry (arrays first, ``meta.json`` last) and return it memory-mapped.

    On any failure the entry's directory is removed, so no partial entry is left behind.
    """
    directory = entry_dir(cache_dir, key)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (directory / "meta.json").unlink()  # invalidate whatever was there before rewriting
        for name in ARRAYS:
            with atomic_path(directory / f"{name}.npy") as tmp, open(tmp, "wb") as f:
                np.save(f, np.ascontiguousarray(arrays[name]))
        atomic_write(directory / "meta.json", json.dumps({"key": key, "stats": stats}, indent=1))
        corpus = TokenizedCorpus.load(directory, key["split"])
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    _remove_stale(cache_dir, key["split"], keep=directory)
    return corpus


def _remove_stale(cache_dir: Path, split: str, keep: Path) -> None:
    for old in cache_dir.glob(f"{split}-*"):
        if old != keep and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
