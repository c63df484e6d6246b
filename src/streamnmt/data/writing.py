"""How the target language is written: the share of its letters in scripts written without spaces
between words (Chinese and Japanese), read from a tokenized training split. The corpus rule's label
smoothing looks at it (streamnmt.config.corpus_label_smoothing)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# Token positions sampled, evenly spaced over the whole split (a corpus that lists one language's pairs
# after another's, as a target-tagged one may, is sampled across all of them).
SAMPLE_TOKENS = 200_000
# Code points of Chinese and Japanese letters (Han, kana): the two unspaced targets measured. Other
# scripts written without spaces (Thai, Khmer, ...) are not counted: no corpus of theirs was measured.
_UNSPACED = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
             (0xFF66, 0xFF9F), (0x20000, 0x3134F))


def unspaced_letter(ch: str) -> bool:
    """``ch`` is a Chinese or Japanese letter (Han or kana)."""
    c = ord(ch)
    return any(lo <= c <= hi for lo, hi in _UNSPACED)


def unspaced_share(tokens: np.ndarray, piece: Callable[[int], str], sample: int = SAMPLE_TOKENS) -> float | None:
    """Share of the letters of ``tokens`` (a split's flat token ids; ``piece`` maps an id to its text)
    that are Chinese or Japanese, over at most ``sample`` positions spread evenly across the split;
    None where the sample holds no letter."""
    if len(tokens) == 0:
        return None
    at = np.linspace(0, len(tokens) - 1, num=min(sample, len(tokens))).astype(np.int64)
    counts = np.bincount(np.asarray(tokens[at], dtype=np.int64))
    letters = unspaced = 0
    for i in np.flatnonzero(counts):
        n = int(counts[i])
        for ch in piece(int(i)):
            if ch.isalpha():
                letters += n
                unspaced += n if unspaced_letter(ch) else 0
    return unspaced / letters if letters else None
