"""A corpus with a long length tail, to measure token-budget batching (``--max-tokens``).

Real corpora are mostly short sentences with a few very long ones. This writes train/dev/test JSON
arrays of ``{"en", "ch"}`` pairs whose lengths (in words; one SentencePiece piece each, the
vocabulary being small) are heavy-tailed: ``1 + Pareto(1.5) x 8``, capped at 126, so that with
BOS/EOS every sentence fits ``--max-len 128``. The words are random; only the shapes matter.

    python3 scripts/make_longtail.py --out /tmp/longtail --pairs 200000
    streamnmt bench --data /tmp/longtail --max-tokens 8192 --max-len 128 --strategies graph
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def lengths(rng: np.random.Generator, n: int, cap: int = 126) -> np.ndarray:
    return np.minimum(1 + (rng.pareto(1.5, n) * 8).astype(np.int64), cap)


def make_pairs(n: int, seed: int) -> list[dict[str, str]]:
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="corpus directory to write")
    ap.add_argument("--pairs", type=int, default=200000, help="training pairs (dev and test: 1000 each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", args.pairs, args.seed), ("dev", 1000, args.seed + 1),
                           ("test", 1000, args.seed + 2)):
        tmp = out / f".{split}.json.tmp"
        tmp.write_text(json.dumps(make_pairs(n, seed), ensure_ascii=False), encoding="utf-8")
        tmp.replace(out / f"{split}.json")
    lens = lengths(np.random.default_rng(args.seed), args.pairs)
    print(f"wrote {out}: {args.pairs} training pairs; source words: median {int(np.median(lens))}, "
          f"p99 {int(np.percentile(lens, 99))}, max {int(lens.max())}")


if __name__ == "__main__":
    main()
