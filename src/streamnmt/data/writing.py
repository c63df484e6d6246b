"""How a language is written: the share of its letters in scripts written without spaces between
words (Chinese and Japanese), read from a tokenized training split (:func:`unspaced_share`: the
corpus rule's label smoothing, streamnmt.config.corpus_label_smoothing) or from raw text
(:func:`written_language`: where a language key names none of Chinese, Japanese and Korean, the
tokenizers' settings and BLEU's tokenizer follow the text); and how many word forms a target has
beside its source (:func:`corpus_word_forms`: the corpus rule's vocabulary and label smoothing).

Imported by the tokenizers' child process, which imports neither torch nor numpy: numpy is imported
where a tokenized split is read."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from streamnmt.data.tokenizer import is_cjk, is_unspaced

if TYPE_CHECKING:
    import numpy as np

# Token positions sampled, evenly spaced over the whole split (a corpus that lists one language's pairs
# after another's, as a target-tagged one may, is sampled across all of them).
SAMPLE_TOKENS = 200_000
# Raw sentences read, evenly spaced (:func:`written_language`): tens of thousands of letters, enough to
# tell a text half Chinese from one that is not, and few enough to read at every BLEU pass.
SAMPLE_SENTENCES = 5_000
# A text with at least this share of its letters Chinese or Japanese is written without spaces: the
# label smoothing (streamnmt.config.corpus_label_smoothing) and :func:`written_language` read it.
UNSPACED_SHARE = 0.5
# Of those letters, kana at least this share make the text Japanese (Chinese has none; Japanese
# writes its grammar in kana, so any sentence has some).
JAPANESE_KANA_SHARE = 0.1
# Code points of Chinese and Japanese letters (Han, kana): the two unspaced targets measured. Other
# scripts written without spaces (Thai, Khmer, ...) are not counted: no corpus of theirs was measured.
_UNSPACED = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
             (0xFF66, 0xFF9F), (0x20000, 0x3134F))
_KANA = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F))
_HANGUL = ((0x1100, 0x11FF), (0x3130, 0x318F), (0xA960, 0xA97F), (0xAC00, 0xD7A3), (0xD7B0, 0xD7FF))
_LETTER = re.compile(r"[^\W\d_]")  # str.isalpha's letters
_UNSPACED_LETTER = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _UNSPACED) + "]")
_KANA_LETTER = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _KANA) + "]")
_HANGUL_LETTER = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _HANGUL) + "]")


def unspaced_letter(ch: str) -> bool:
    """``ch`` is a Chinese or Japanese letter (Han or kana)."""
    c = ord(ch)
    return any(lo <= c <= hi for lo, hi in _UNSPACED)


def unspaced_share(tokens: np.ndarray, piece: Callable[[int], str], sample: int = SAMPLE_TOKENS) -> float | None:
    """Share of the letters of ``tokens`` (a split's flat token ids; ``piece`` maps an id to its text)
    that are Chinese or Japanese, over at most ``sample`` positions spread evenly across the split;
    None where the sample holds no letter."""
    import numpy as np

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


def written_language(key: str, sentences: Sequence[str], sample: int = SAMPLE_SENTENCES) -> str | None:
    """The language of ``sentences`` where their key does not say it: where ``key`` names none of
    Chinese, Japanese and Korean (:func:`~streamnmt.data.tokenizer.is_cjk`: ``src``, ``tgt``, or a
    key of another language) but at least :data:`UNSPACED_SHARE` of the letters of (at most
    ``sample``, evenly spaced) ``sentences`` are Chinese or Japanese: ``ja`` where kana are at least
    :data:`JAPANESE_KANA_SHARE` of those, else ``zh``; or as many are Hangul: ``ko``. None otherwise:
    the key stands."""
    if is_cjk(key) or not sentences:
        return None
    step = -(-len(sentences) // sample)
    letters = "".join(_LETTER.findall("\n".join(sentences[::step])))
    unspaced = "".join(_UNSPACED_LETTER.findall(letters))
    if letters and len(unspaced) >= UNSPACED_SHARE * len(letters):
        return "ja" if len(_KANA_LETTER.findall(unspaced)) >= JAPANESE_KANA_SHARE * len(unspaced) else "zh"
    if letters and len(_HANGUL_LETTER.findall(letters)) >= UNSPACED_SHARE * len(letters):
        return "ko"
    return None


# Words of each side counted by :func:`word_form_ratio`: enough for a stable count, a 10k-pair corpus holds more.
# :func:`corpus_word_forms` reads them from the split's first pairs in its order (a bounded read, the same
# wherever it is counted); the tokenizers' seeded sample keeps that order up to its size
# (DataConfig.tokenizer_sample), so larger corpora count the pairs at their start, not the sample's.
FORM_WINDOW = 50_000
_WORD = re.compile(r"\w+")


def word_form_ratio(src: Iterable[str], tgt: Iterable[str], window: int = FORM_WINDOW) -> float | None:
    """Distinct (lower-cased) words in the target's first ``window`` words over those in the
    source's: how much richer in word forms the target language is. Counted over the same number of
    words on both sides (the shorter side's where either has fewer); None under 1,000 words. A
    target written without spaces (Chinese, Japanese) counts each run of letters as a word and
    comes out rich."""
    words = [_first_words(side, window) for side in (src, tgt)]
    n = min(len(words[0]), len(words[1]))
    if n < 1000:
        return None
    return len(set(words[1][:n])) / len(set(words[0][:n]))


def corpus_word_forms(pairs: Iterable[tuple[str, str]], src_key: str,
                      window: int = FORM_WINDOW) -> tuple[float | None, bool]:
    """The one count of a corpus's word forms (the tokenizers' training and the label smoothing read it):
    :func:`word_form_ratio` of the split's pairs in their order, read only as far as both sides' first
    ``window`` words, and whether its source is written without spaces (its key names Chinese or
    Japanese, or where the key names none of Chinese, Japanese and Korean, the text of those pairs:
    :func:`written_language`); such a source would count each run of its letters as one word, so its
    ratio is None. A key naming Chinese or Japanese reads nothing."""
    if is_unspaced(src_key):
        return None, True
    head = _first_pairs(pairs, window)
    sources = [s for s, _ in head]
    if written_language(src_key, sources) in ("zh", "ja"):
        return None, True
    return word_form_ratio(sources, [t for _, t in head], window), False


def _first_pairs(pairs: Iterable[tuple[str, str]], window: int) -> list[tuple[str, str]]:
    """The first ``pairs``, as far as both sides' first ``window`` words."""
    head: list[tuple[str, str]] = []
    words = [0, 0]
    for s, t in pairs:
        head.append((s, t))
        words[0] += len(_WORD.findall(s))
        words[1] += len(_WORD.findall(t))
        if min(words) >= window:
            break
    return head


def _first_words(sentences: Iterable[str], n: int) -> list[str]:
    out: list[str] = []
    for sentence in sentences:
        out += _WORD.findall(sentence.lower())
        if len(out) >= n:
            break
    return out[:n]
