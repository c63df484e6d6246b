"""A tokenized split as flat NumPy arrays, built once and memory-mapped on later runs.

Tokenizing a million pairs takes most of a minute; reading them back should take a moment. Each
side of a split is stored as one flat token array plus ``n + 1`` int64 offsets, so sentence ``i``
is ``tokens[offsets[i]:offsets[i + 1]]``. The tokens are the SentencePiece ids only: bos/eos are
added at collate time, and each side is capped at ``max_len - 1`` tokens so that ``tokens + [EOS]``
and ``[BOS] + tokens`` fit in ``max_len``.

The arrays are saved with ``np.save`` through :func:`~streamnmt.fsutil.atomic_path` and opened
with ``np.load(mmap_mode="r")``: worker processes share the page cache instead of copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from streamnmt.data.tokenizer import Tokenizer

ARRAYS = ("src_tokens", "src_offsets", "tgt_tokens", "tgt_offsets", "index")
CHUNK = 32768  # pairs tokenized per call into SentencePiece's threads


@dataclass
class BuildStats:
    """Per-split counts (pairs, not sentences) reported by prepare_data."""

    read: int = 0
    empty_skipped: int = 0
    truncated: int = 0
    dropped: int = 0
    pairs: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"read": self.read, "empty_skipped": self.empty_skipped, "truncated": self.truncated,
                "dropped": self.dropped, "pairs": self.pairs}


class TokenizedCorpus:
    """Token ids of one split. ``corpus[i]`` -> ``(src_tokens, tgt_tokens)``, without bos/eos.

    Attributes:
        src_lengths, tgt_lengths: int64 arrays of token counts (bos/eos not included).
        index: int64 array, position of each pair among the split's usable pairs (as returned by
            :func:`streamnmt.data.read_pairs`); with ``overlong=drop`` some positions are missing.
        hold: the cache entry's lock file, kept open (its shared lock held) while the corpus lives,
            so that no other job evicts the arrays it maps (see ``streamnmt.data.cache``).
    """

    hold: IO[bytes] | None = None  # not pickled: a worker process reads while its parent holds

    def __init__(self, arrays: dict[str, np.ndarray], name: str = "", directory: Path | None = None) -> None:
        self.name = name
        self.directory = directory  # where the arrays are memory-mapped from, if they are
        self._set(arrays)

    def _set(self, arrays: dict[str, np.ndarray]) -> None:
        # Plain ndarray views of np.memmap: slicing a memmap subclass costs microseconds each.
        a = {k: arrays[k].view(np.ndarray) for k in ARRAYS}
        self.src_tokens, self.src_offsets = a["src_tokens"], a["src_offsets"]
        self.tgt_tokens, self.tgt_offsets = a["tgt_tokens"], a["tgt_offsets"]
        self.index = a["index"]
        self.src_lengths = np.diff(self.src_offsets)
        self.tgt_lengths = np.diff(self.tgt_offsets)

    @classmethod
    def load(cls, directory: Path, name: str = "") -> TokenizedCorpus:
        arrays = {k: np.load(directory / f"{k}.npy", mmap_mode="r") for k in ARRAYS}
        return cls(arrays, name, directory)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in ARRAYS}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"pair {i} out of range for {len(self)} pairs")
        i %= len(self)
        so, to = self.src_offsets, self.tgt_offsets
        return self.src_tokens[so[i]:so[i + 1]], self.tgt_tokens[to[i]:to[i + 1]]

    def num_tokens(self) -> tuple[int, int]:
        """(source, target) token totals, bos/eos not included."""
        return int(self.src_offsets[-1]), int(self.tgt_offsets[-1])

    def __repr__(self) -> str:
        where = f", mmap={str(self.directory)!r}" if self.directory else ""
        return f"TokenizedCorpus({self.name!r}, pairs={len(self)}{where})"

    # Pickled into DataLoader workers: a memory-mapped corpus travels as its directory.
    def __getstate__(self) -> dict[str, Any]:
        if self.directory is not None:
            return {"name": self.name, "directory": self.directory}
        return {"name": self.name, "directory": None, "arrays": self.arrays()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self.directory = state["name"], state["directory"]
        if self.directory is not None:
            self._set({k: np.load(self.directory / f"{k}.npy", mmap_mode="r") for k in ARRAYS})
        else:
            self._set(state["arrays"])


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def tokenize_pairs(pairs: Iterable[tuple[str, str]], src_tok: Tokenizer, tgt_tok: Tokenizer, *,
                   max_len: int, overlong: str, stats: BuildStats, threads: int = 0,
                   progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Tokenize a stream of pairs into the flat arrays of a :class:`TokenizedCorpus`.

    Pairs with a side over ``max_len - 1`` tokens are cut to it (``overlong="truncate"``) or left
    out (``"drop"``); ``stats`` counts both.
    """
    cap = max_len - 1
    parts: dict[str, list[np.ndarray]] = {"src": [], "tgt": [], "src_len": [], "tgt_len": [], "index": []}
    position = 0
    for chunk in _chunks(pairs, CHUNK):
        src_ids = src_tok.encode_batch([p[0] for p in chunk], threads)
        tgt_ids = tgt_tok.encode_batch([p[1] for p in chunk], threads)
        src_len = np.fromiter(map(len, src_ids), np.int64, len(chunk))
        tgt_len = np.fromiter(map(len, tgt_ids), np.int64, len(chunk))
        index = np.arange(position, position + len(chunk), dtype=np.int64)
        position += len(chunk)
        over = np.flatnonzero((src_len > cap) | (tgt_len > cap))
        if len(over) and overlong == "drop":
            stats.dropped += len(over)
            keep = np.ones(len(chunk), bool)
            keep[over] = False
            src_ids = list(itertools.compress(src_ids, keep))
            tgt_ids = list(itertools.compress(tgt_ids, keep))
            src_len, tgt_len, index = src_len[keep], tgt_len[keep], index[keep]
        elif len(over):
            stats.truncated += len(over)
            for i in over:
                src_ids[i], tgt_ids[i] = src_ids[i][:cap], tgt_ids[i][:cap]
            np.minimum(src_len, cap, out=src_len)
            np.minimum(tgt_len, cap, out=tgt_len)
        parts["src"].append(_flat(src_ids, int(src_len.sum()), token_dtype(src_tok.vocab_size)))
        parts["tgt"].append(_flat(tgt_ids, int(tgt_len.sum()), token_dtype(tgt_tok.vocab_size)))
        parts["src_len"].append(src_len)
        parts["tgt_len"].append(tgt_len)
        parts["index"].append(index)
        if progress is not None:
            progress(position)
    stats.pairs = sum(len(i) for i in parts["index"])
    return {
        "src_tokens": _cat(parts["src"], token_dtype(src_tok.vocab_size)),
        "src_offsets": _offsets(parts["src_len"]),
        "tgt_tokens": _cat(parts["tgt"], token_dtype(tgt_tok.vocab_size)),
        "tgt_offsets": _offsets(parts["tgt_len"]),
        "index": _cat(parts["index"], np.dtype(np.int64)),
    }


def _chunks(it: Iterable[tuple[str, str]], n: int) -> Iterator[list[tuple[str, str]]]:
    it = iter(it)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _flat(ids: list[list[int]], total: int, dtype: np.dtype) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(ids), dtype, total)


def _cat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _offsets(lengths: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(sum(len(x) for x in lengths) + 1, np.int64)
    if len(out) > 1:
        np.cumsum(np.concatenate(lengths), out=out[1:])
    return out
