"""A corpus with a long length tail, to measure token-budget batching (``--max-tokens``) and training.

Real corpora are mostly short sentences with a few very long ones. This writes train/dev/test JSON
arrays of ``{"en", "ch"}`` pairs whose lengths (in words) are heavy-tailed: ``1 + Pareto(1.5) x 8``,
capped at 126 (``--words random``) or 100 (``--words lexicon``: lexicon entries of a few words or
pieces each), so that nearly every sentence fits ``--max-len 128``.

``--words lexicon`` (the default): the words translate. Each sentence is a sequence of entries of
the built-in corpus's bilingual lexicon (:mod:`streamnmt.data.lexicon`: people, things, verbs,
places, units, weekdays, cities and the numbers 0-99), drawn with Zipf-like frequencies as a real
corpus's words are; the Chinese side is the same entries' translations in the same order. A model
that learns the lexicon scores a high BLEU, so BLEU on this corpus measures training.
``--words random``: random letter strings and characters, nothing translates; only shapes matter.

    python3 scripts/make_longtail.py --out /tmp/longtail --pairs 200000
    streamnmt bench --data /tmp/longtail --max-tokens 8192 --max-len 128 --strategies graph
    streamnmt train --data /tmp/longtail --time-limit 10m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def lengths(rng: np.random.Generator, n: int, cap: int = 126) -> np.ndarray:
    return np.minimum(1 + (rng.pareto(1.5, n) * 8).astype(np.int64), cap)


def lexicon_entries() -> list[tuple[str, str]]:
    """(English, Chinese) entries of the built-in corpus's lexicon, most common kinds first."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from streamnmt.data import lexicon as lx

    out: list[tuple[str, str]] = [(p.en, p.zh) for p in lx.PEOPLE.values()]
    out += [(v.en, v.zh) for v in lx.PAST_VERBS.values()]
    out += [(t.sg, t.zh) for t in lx.THINGS.values()]
    out += [(u.sg, u.zh) for u in lx._U.values()]
    out += [(en, zh) for en, zh, _ in lx._LOCATIONS] + list(lx.CITIES) + list(lx.WEEKDAYS)
    out += [(lx.en_number(k), lx.zh_number(k)) for k in range(100)]
    seen: dict[str, str] = {}
    for en, zh in out:  # one translation per English entry (e.g. a unit and a thing share a word)
        seen.setdefault(en, zh)
    return list(seen.items())


def make_lexicon_pairs(n: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    entries = lexicon_entries()
    order = rng.permutation(len(entries))  # which entries are frequent: seeded, fixed for all splits
    weights = np.empty(len(entries))
    weights[order] = 1.0 / np.arange(1, len(entries) + 1)  # Zipf: the k-th commonest at 1/k
    weights /= weights.sum()
    out = []
    for words in lengths(rng, n, cap=100):
        pick = rng.choice(len(entries), int(words), p=weights)
        out.append({"en": " ".join(entries[k][0] for k in pick), "ch": "".join(entries[k][1] for k in pick)})
    return out


def make_pairs(n: int, seed: int, words: str = "lexicon") -> list[dict[str, str]]:
    if words == "lexicon":
        return make_lexicon_pairs(n, seed)
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    en_words = ["".join(rng.choice(letters, rng.integers(2, 8))) for _ in range(2000)]
    ch_words = [chr(0x4E00 + int(k)) for k in rng.choice(6000, 2000, replace=False)]
    src_len = lengths(rng, n)
    tgt_len = np.clip(src_len + rng.integers(-2, 3, n), 1, 126)  # targets about as long as sources
    out = []
    for s, t in zip(src_len, tgt_len):
        out.append({"en": " ".join(en_words[k] for k in rng.integers(0, 2000, s)),
                    "ch": "".join(ch_words[k] for k in rng.integers(0, 2000, t))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="corpus directory to write")
    ap.add_argument("--pairs", type=int, default=200000, help="training pairs (dev and test: 1000 each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", choices=("lexicon", "random"), default="lexicon",
                    help="lexicon: entries of the built-in corpus's lexicon and their translations (BLEU "
                         "means something); random: random strings (shapes only)")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error(f"--pairs must be at least 1; got {args.pairs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", args.pairs, args.seed), ("dev", 1000, args.seed + 1),
                           ("test", 1000, args.seed + 2)):
        pairs = make_pairs(n, seed, args.words)
        tmp = out / f".{split}.json.tmp"
        tmp.write_text(json.dumps(pairs, ensure_ascii=False), encoding="utf-8")
        tmp.replace(out / f"{split}.json")
        if split == "train":
            lens = np.array([len(p["en"].split()) for p in pairs])
    print(f"wrote {out}: {args.pairs} training pairs ({args.words} words); English words per sentence: "
          f"median {int(np.median(lens))}, p99 {int(np.percentile(lens, 99))}, max {int(lens.max())}")


if __name__ == "__main__":
    main()
