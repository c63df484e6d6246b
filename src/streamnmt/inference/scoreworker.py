"""A scoring worker process: sacrebleu segment statistics for batches of translations.

Run as ``python scoreworker.py LANG`` by :class:`streamnmt.inference.scoring.Scorer` (by file path, so it
needs neither an installed package nor the parent's ``sys.path``; it imports sacrebleu and nothing
of PyTorch). It reads frames ``(tag, hyps, refs)`` from stdin and writes ``(tag, bleu_stats,
chrf_stats)`` to stdout, until a ``None`` frame or the end of stdin. A frame is a 4-byte
big-endian length and a pickle. Scoring in its own process keeps sacrebleu's pure-Python n-gram
counting off the decoding process's interpreter lock.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import IO, Any

# Language keys other than ISO 639-1's, by the language they name: the project's own ``ch``, country
# codes, ISO 639-2/3 codes and FLORES-200's (``zho_Hans``, ``jpn_Jpan``: the part before ``_``). The
# tokenizers read the same keys (streamnmt.data.tokenizer.CJK; this file imports nothing of the
# package, so a test holds the two tables together): a Japanese target keyed ``jp`` or ``jpn_Jpan`` is
# scored as ``ja`` is, not by 13a's words.
ALIASES = {"ch": "zh", "cn": "zh", "zho": "zh", "chi": "zh", "cmn": "zh", "yue": "zh",
           "jp": "ja", "jpn": "ja", "kr": "ko", "kor": "ko",
           "tha": "th", "lao": "lo", "khm": "km", "mya": "my", "bur": "my"}
CHINESE = {"zh"} | {key for key, lang in ALIASES.items() if lang == "zh"}  # keys scored with sacrebleu's "zh"
# Languages written without spaces between words, where 13a would count a whole sentence as one
# word: scored with sacrebleu's MeCab tokenizer where it is installed, else character by character.
UNSPACED = {"ja": "ja-mecab", "th": None, "lo": None, "km": None, "my": None}
# Languages with spaces between words that sacrebleu also segments morphologically where MeCab is
# installed; else 13a, which their spaces make meaningful (Korean: ko-mecab, or 13a).
MORPHOLOGICAL = {"ko": "ko-mecab"}


def language(key: str) -> str:
    """The language a key names, ISO 639-1's code where :data:`ALIASES` knows it: ``zh_CN``, ``ch``
    and ``zho_Hans`` -> ``zh``; ``ja-JP`` and ``jpn_Jpan`` -> ``ja``; any other key lower-cased, the
    part before its first ``_`` or ``-``."""
    lang = key.lower().replace("-", "_").split("_")[0]
    return ALIASES.get(lang, lang)


def bleu_tokenizer(tgt_lang: str) -> str:
    """sacrebleu's tokenizer for BLEU of a target language (``de``, ``ja_JP``, ``pt-BR``, ``jp`` alike):
    ``zh`` for Chinese, the language's MeCab tokenizer or ``char`` for the languages of
    :data:`UNSPACED`, MeCab or ``13a`` for those of :data:`MORPHOLOGICAL`, else ``13a`` (sacrebleu's
    default, WMT's habit)."""
    lang = language(tgt_lang)
    if lang in CHINESE:
        return "zh"
    if lang not in UNSPACED and lang not in MORPHOLOGICAL:
        return "13a"
    mecab = {**UNSPACED, **MORPHOLOGICAL}[lang]
    if mecab is not None:
        try:
            import sacrebleu

            sacrebleu.BLEU(tokenize=mecab)  # needs mecab-python3 and its dictionary
            return mecab
        except Exception:
            pass
    return "13a" if lang in MORPHOLOGICAL else "char"


def metrics(tgt_lang: str) -> tuple[Any, Any]:
    """BLEU (sacrebleu, tokenized by :func:`bleu_tokenizer`) and chrF, as the corpus score uses."""
    import sacrebleu

    return sacrebleu.BLEU(tokenize=bleu_tokenizer(tgt_lang)), sacrebleu.CHRF()


def write_frame(out: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def read_frame(inp: IO[bytes]) -> Any:
    """The next frame's object; EOFError at the end of the stream (also mid-frame)."""
    head = inp.read(4)
    if len(head) < 4:
        raise EOFError
    n = struct.unpack(">I", head)[0]
    data = inp.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def main(argv: list[str]) -> int:
    bleu, chrf = metrics(argv[0] if argv else "en")
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            frame = read_frame(inp)
        except EOFError:
            return 0
        if frame is None:
            return 0
        tag, hyps, refs = frame
        write_frame(out, (tag, bleu._extract_corpus_statistics(hyps, [refs]),
                          chrf._extract_corpus_statistics(hyps, [refs])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
