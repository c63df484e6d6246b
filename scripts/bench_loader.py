"""Benchmark the data pipeline on a large synthetic corpus: prepare time, cached start-up, loader rate.

The GPU strategies are only worth comparing if the loader is never the bottleneck: a 32-sentence
step takes ~9 ms in graph mode, so the loader must deliver well over 100 batches/s, with headroom.
This script

1. writes a synthetic English->Chinese corpus (``--pairs``, default 1M, as ``train.jsonl`` plus small
   dev/test) whose lengths spread like real text: mean ~25 tokens, a tail past 100;
2. times a first ``prepare_data`` (tokenizer training, tokenization, cache) and a cached start-up
   in a fresh process;
3. times ``make_loader`` over a fixed number of batches after warm-up for each worker count,
   at batch size 32, pinning when CUDA is present;

then prints a table and writes everything as JSON to ``--out``.

    PYTHONPATH=src python3 scripts/bench_loader.py --dir /tmp/c --out $OUT/loader.json
    PYTHONPATH=src python3 scripts/bench_loader.py --dir /tmp/c --out /tmp/l.json --pairs 20000  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from streamnmt.data import DataConfig, make_loader, prepare_data
from streamnmt.data.tokenizer import cpu_threads
from streamnmt.fsutil import atomic_path, atomic_write

SYLLABLES = ("ka to ri an sel mo pre ing tion er un de con ly ble st ar en ou ma ne ti ver per com "
             "pro ex in re dis al ment ness ful ous ive ate ize ham ber lin gor vel tra sho plu wen "
             "fi ga lo mu sa te vi zo qua ple bri cro dra").split()
VOCAB = 30000  # English-like word types (Zipf-distributed)


def make_lexicon(rng: np.random.Generator) -> tuple[list[str], list[str], np.ndarray]:
    """English-like words, a Chinese-like "translation" of each, and Zipf word probabilities."""
    english: set[str] = set()
    while len(english) < VOCAB:
        k = rng.integers(1, 5, size=VOCAB)
        parts = rng.integers(0, len(SYLLABLES), size=(VOCAB, 4))
        english.update("".join(SYLLABLES[p] for p in row[:n]) for row, n in zip(parts, k))
    en = sorted(english)[:VOCAB]
    rng.shuffle(en)
    hanzi = [chr(0x4E00 + i) for i in rng.choice(20000, size=4000, replace=False)]
    char_p = 1.0 / np.arange(1, 4001) ** 0.9
    char_p /= char_p.sum()
    sizes = rng.choice([1, 2, 2, 3], size=VOCAB)
    chars = rng.choice(4000, size=int(sizes.sum()), p=char_p)
    zh, o = [], 0
    for n in sizes:
        zh.append("".join(hanzi[c] for c in chars[o:o + n]))
        o += n
    word_p = 1.0 / np.arange(1, VOCAB + 1) ** 1.05
    return en, zh, word_p / word_p.sum()


def generate(n: int, rng: np.random.Generator, lexicon) -> list[tuple[str, str]]:
    en_words, zh_words, word_p = lexicon
    # ~23 words on average (~25 SentencePiece tokens), lognormal: a tail past 100 tokens.
    lengths = np.clip(rng.lognormal(2.97, 0.55, size=n).astype(np.int64), 1, 250)
    ids = rng.choice(VOCAB, size=int(lengths.sum()), p=word_p)
    en_arr = np.array(en_words, dtype=object)
    zh_arr = np.array(zh_words, dtype=object)
    en_tok, zh_tok = en_arr[ids].tolist(), zh_arr[ids].tolist()
    pairs, o = [], 0
    for k in lengths.tolist():
        en = " ".join(en_tok[o:o + k])
        zh = "".join(zh_tok[o:o + k])
        pairs.append((en[:1].upper() + en[1:] + ".", zh + "。"))
        o += k
    return pairs


def write_jsonl(path: Path, pairs: list[tuple[str, str]]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        dumps = json.JSONEncoder(ensure_ascii=False).encode
        f.writelines(dumps({"en": s, "ch": t}) + "\n" for s, t in pairs)


def make_corpus(directory: Path, n: int, seed: int) -> float:
    """Write the corpus unless the same one is already there; returns seconds spent."""
    manifest = directory / "bench-corpus.json"
    params = {"pairs": n, "seed": seed, "version": 2}
    if manifest.is_file() and json.loads(manifest.read_text()) == params and \
            all((directory / f"{s}.jsonl").is_file() for s in ("train", "dev", "test")):
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    lexicon = make_lexicon(rng)
    directory.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", n), ("dev", 2000), ("test", 2000)):
        write_jsonl(directory / f"{split}.jsonl", generate(size, rng, lexicon))
    atomic_write(manifest, json.dumps(params))
    return time.perf_counter() - t0


def cached_startup(directory: Path) -> dict:
    """prepare_data with a valid cache, in a fresh interpreter (imports included)."""
    code = ("import time, json; t0 = time.perf_counter()\n"
            "from streamnmt.data import DataConfig, prepare_data\n"
            "t1 = time.perf_counter()\n"
            f"b = prepare_data(DataConfig(data={str(directory)!r}), log=lambda s: None)\n"
            "t2 = time.perf_counter()\n"
            "print(json.dumps({'import_s': t1 - t0, 'prepare_s': t2 - t1, 'pairs': len(b.train)}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def loader_rate(corpus, cfg: DataConfig, workers: int, batches: int, warmup: int, pin: bool) -> dict:
    cfg = dataclasses.replace(cfg, workers=workers)
    loader = make_loader(corpus, cfg, train=True, seed=0, pin_memory=pin)
    batches = min(batches, len(loader) - warmup)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        next(it)
    real = padded = 0
    t1 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        real += b.ntokens + b.src_tokens
        padded += b.src.numel() + b.tgt_out.numel()
    dt = time.perf_counter() - t1
    pinned = b.is_pinned()
    del it, loader, b
    gc.collect()
    return {"workers": workers, "batches": batches, "seconds": dt, "batches_per_s": batches / dt,
            "tokens_per_s": real / dt, "padded_tokens_per_s": padded / dt, "first_batch_s": first,
            "pinned": pinned}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, type=Path, help="corpus directory (created)")
    ap.add_argument("--out", required=True, type=Path, help="JSON results file")
    ap.add_argument("--pairs", type=int, default=1_000_000, help="training pairs to generate")
    ap.add_argument("--workers", default="0,2,4,8", help="worker counts to time, comma-separated")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4000, help="timed batches per worker count")
    ap.add_argument("--warmup", type=int, default=200, help="batches before timing starts")
    ap.add_argument("--tokenizer-sample", type=int, default=DataConfig().tokenizer_sample,
                    help="pairs sampled to train each SentencePiece model (DataConfig.tokenizer_sample)")
    ap.add_argument("--keep", action="store_true", help="keep existing tokenizers/cache (no first-run time)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpus": cpu_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "pairs": args.pairs,
            "batch_size": args.batch_size}
    print(f"bench_loader: {args.pairs} pairs in {args.dir}, {info['cpus']} CPUs, CUDA {cuda}", flush=True)

    info["generate_s"] = make_corpus(args.dir, args.pairs, args.seed)
    print(f"corpus: {info['generate_s']:.1f}s to generate (0 = reused)", flush=True)

    if not args.keep:
        for sub in ("tokenizer", "cache"):
            shutil.rmtree(args.dir / sub, ignore_errors=True)
    cfg = DataConfig(data=str(args.dir), batch_size=args.batch_size, tokenizer_sample=args.tokenizer_sample)
    info["tokenizer_sample"] = args.tokenizer_sample
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print("  " + line, flush=True)

    t0 = time.perf_counter()
    bundle = prepare_data(cfg, log=log)
    info["first_prepare_s"] = time.perf_counter() - t0
    info["prepare_log"] = lines
    info["stats"] = bundle.stats
    info["vocab"] = [bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size]
    src_len, tgt_len = bundle.train.src_lengths, bundle.train.tgt_lengths
    info["lengths"] = {"src_mean": float(src_len.mean()), "tgt_mean": float(tgt_len.mean()),
                       "src_p99": float(np.percentile(src_len, 99)), "over_100": int((src_len > 100).sum())}
    print(f"first prepare: {info['first_prepare_s']:.1f}s; mean tokens src {info['lengths']['src_mean']:.1f} "
          f"tgt {info['lengths']['tgt_mean']:.1f}", flush=True)

    info["cached_startup"] = cached_startup(args.dir)
    print(f"cached start-up: {info['cached_startup']['process_s']:.2f}s in a fresh process "
          f"(prepare {info['cached_startup']['prepare_s']:.2f}s)", flush=True)

    probe = make_loader(bundle.train, cfg, train=True, seed=0, pin_memory=cuda)
    info["shapes"] = probe.shapes()
    info["padding"] = probe.num_tokens()
    del probe
    info["loader"] = []
    for w in [int(x) for x in args.workers.split(",") if x.strip()]:
        r = loader_rate(bundle.train, cfg, w, args.batches, args.warmup, cuda)
        info["loader"].append(r)
        print(f"workers {w}: {r['batches_per_s']:.0f} batches/s", flush=True)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, json.dumps(info, indent=1))
    print()
    print(f"prepare (first run) {info['first_prepare_s']:7.1f} s   cached start-up "
          f"{info['cached_startup']['process_s']:5.2f} s   corpus {args.pairs} pairs")
    print(f"{'workers':>7} {'batches/s':>10} {'tokens/s':>12} {'padded tok/s':>13} {'first batch s':>14} {'pinned':>7}")
    for r in info["loader"]:
        print(f"{r['workers']:>7} {r['batches_per_s']:>10.0f} {r['tokens_per_s']:>12.0f} "
              f"{r['padded_tokens_per_s']:>13.0f} {r['first_batch_s']:>14.2f} {str(r['pinned']):>7}")
    print(f"results: {args.out} ({time.perf_counter() - t_start:.0f}s in all)")


if __name__ == "__main__":
    main()
