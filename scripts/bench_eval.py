"""``streamnmt eval`` end to end beside the decoding benchmark's graph-cached rate, same sources.

Builds a test set and a checkpoint that carries its tokenizers: base-model shape with seeded
random weights, a word-level SentencePiece model (one piece per word, so a sentence of n words is
n tokens + EOS, 20-40 tokens as in ``scripts/bench_decode.py``). Random weights never emit EOS:
every output runs to its length limit (1.5 x source + 10), as in the benchmark. Then

* ``streamnmt eval`` as a user runs it (a new process each time; the rate it prints covers
  translating and scoring the whole set, graph captures included), ``--repeats`` times;
* the benchmark's graph-cached search (``bench_decode.streamnmt_run``) on the same model, the
  same encoded sources, batch, dtype and beam: a warm-up call (captures), then ``--repeats``
  timed calls;

and prints eval / bench (the target is >= 80 %).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sentencepiece as spm
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

from bench_decode import streamnmt_run, timed  # noqa: E402
from streamnmt.checkpoint import save_checkpoint, tokenizer_entry  # noqa: E402
from streamnmt.data import Tokenizer  # noqa: E402
from streamnmt.inference.decoding import SearchOptions  # noqa: E402
from streamnmt.inference.graph_search import translate_ids  # noqa: E402
from streamnmt.inference.scoring import bleu_on_pairs, encode_sources  # noqa: E402
from streamnmt.models.transformer import make_model  # noqa: E402
from streamnmt.inference.translate import load_for_inference  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--sentences", type=int, default=1024, help="test sentences")
    p.add_argument("--words", type=int, default=7996, help="distinct words (vocabulary = words + 4 specials)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beam", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model instead of the base shape (a quick check)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--profile-first", action="store_true",
                   help="print where the host spends the first in-process call (cProfile, by cumulative time)")
    return p.parse_args(argv)


def make_corpus(directory: Path, n: int, words: int, seed: int = 0) -> Path:
    """test.json (n pairs of 20-40 words) and a word-level SentencePiece model over every word."""
    g = torch.Generator().manual_seed(seed)
    vocab = [f"w{i}" for i in range(words)]
    def sentence() -> str:
        k = int(torch.randint(20, 41, (1,), generator=g))
        return " ".join(vocab[i] for i in torch.randint(words, (k,), generator=g).tolist())
    pairs = [{"en": sentence(), "ch": sentence()} for _ in range(n)]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "test.json").write_text(json.dumps(pairs), encoding="utf-8")
    spm.SentencePieceTrainer.train(sentence_iterator=iter([" ".join(vocab)] * 2 + [p["en"] for p in pairs]),
                                   model_prefix=str(directory / "words"), model_type="word",
                                   vocab_size=words + 4, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                   hard_vocab_limit=False, minloglevel=2)
    return directory / "words.model"


def make_checkpoint(path: Path, tok: Tokenizer, tiny: bool = False) -> None:
    torch.manual_seed(0)
    shape = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128) if tiny else {}  # default: base shape
    model = make_model(tok.vocab_size, tok.vocab_size, dropout=0.0, **shape)
    entry = tokenizer_entry(tok)
    save_checkpoint(path, {"model": model.state_dict(), "model_shape": dataclasses.asdict(model.shape),
                           "tokenizers": {"src": entry, "tgt": entry},
                           "config": {"data": {"src_lang": "en", "tgt_lang": "ch"}}, "step": 0})


def run_eval(args: argparse.Namespace, ckpt: Path, data: Path) -> dict:
    cmd = [sys.executable, "-m", "streamnmt", "eval", "--weights", str(ckpt), "--data", str(data), "--split", "test",
           "--batch-size", str(args.batch_size), "--beam-size", str(args.beam), "--dtype", args.dtype,
           "--device", args.device]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"streamnmt eval failed ({res.returncode}): {res.stderr[-2000:]}")
    m = re.search(r"([\d.]+) sentences/s", res.stdout)
    print(res.stdout.strip().splitlines()[0], f"(command {wall:.1f} s)")
    return {"sentences_per_s": float(m.group(1)), "command_s": wall}


def _time_captures(device: torch.device) -> None:
    """Print, for each graph capture of the first call: the GPU work still queued before it (a
    synchronize), then capture_begin and capture_end (host seconds)."""
    cls = torch.cuda.CUDAGraph
    begin, end = cls.capture_begin, cls.capture_end

    def timed_begin(self, *a, **k):
        t0 = time.perf_counter()
        torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        begin(self, *a, **k)
        print(f"  capture: queued work {1e3 * (t1 - t0):7.1f} ms, capture_begin {1e3 * (time.perf_counter() - t1):7.1f} ms")

    def timed_end(self, *a, **k):
        t0 = time.perf_counter()
        end(self, *a, **k)
        print(f"  capture: capture_end {1e3 * (time.perf_counter() - t0):7.1f} ms")

    cls.capture_begin, cls.capture_end = timed_begin, timed_end


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_eval_"))
    data = work / "data"
    tok = Tokenizer(make_corpus(data, args.sentences, args.words))
    ckpt = work / "random.pt"
    make_checkpoint(ckpt, tok, args.tiny)
    print(f"{args.sentences} sentences, vocabulary {tok.vocab_size}, base shape, {args.dtype}, beam {args.beam}, "
          f"batch {args.batch_size}; {ckpt}")

    evals = [run_eval(args, ckpt, data) for _ in range(args.repeats)]

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model, src_tok, tgt_tok, _ = load_for_inference(ckpt, device, dtype=dtype)
    texts = [p["en"] for p in json.loads((data / "test.json").read_text(encoding="utf-8"))]
    sources, _ = encode_sources(src_tok, texts, model.shape.max_positions)
    opts = SearchOptions(beam_size=args.beam, graph=True)
    # Where eval's time goes, in this process: the first bleu_on_pairs call (captures, first kernel
    # launches, as in a fresh eval), a second (warm), and the warm decoding alone (no scoring).
    refs = [p["ch"] for p in json.loads((data / "test.json").read_text(encoding="utf-8"))]
    pairs = list(zip(texts, refs))
    phases = {}
    if args.profile_first:
        _time_captures(device)
    for name in ("bleu_on_pairs, first call", "bleu_on_pairs, second call"):
        prof = cProfile.Profile() if args.profile_first and not phases else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        bleu_on_pairs(model, src_tok, tgt_tok, pairs, device=device, beam_size=args.beam, batch_size=args.batch_size,
                      tgt_lang="ch", options=SearchOptions(graph=True))
        phases[name] = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    t0 = time.perf_counter()
    translate_ids(model, sources, opts, batch_size=args.batch_size, device=device)
    phases["translate_ids (shared decoder), warm"] = time.perf_counter() - t0
    t = timed(streamnmt_run(model, sources, opts, "graph", args.batch_size, device), device, args.repeats)
    bench = len(sources) / t["median_s"]
    for name, sec in phases.items():
        print(f"  {name:<40} {sec:6.2f} s  {len(sources) / sec:8.1f} sent/s")

    rates = [e["sentences_per_s"] for e in evals]
    eval_rate = statistics.median(rates)
    result = {"sentences": len(sources), "dtype": args.dtype, "beam": args.beam, "batch_size": args.batch_size,
              "eval_sentences_per_s": rates, "eval_command_s": [e["command_s"] for e in evals],
              "bench_graph_sentences_per_s": bench,
              "bench_range": [len(sources) / t["max_s"], len(sources) / t["min_s"]],
              "eval_over_bench": eval_rate / bench, "phases_s": phases}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\n{'':<28}{'sent/s (median)':>16}{'runs':>30}")
    print(f"{'streamnmt eval (end to end)':<28}{eval_rate:>16.1f}{', '.join(f'{r:.1f}' for r in rates):>30}")
    lo, hi = result["bench_range"]
    print(f"{'bench_decode graph-cached':<28}{bench:>16.1f}{f'[{lo:.1f}-{hi:.1f}]':>30}")
    print(f"eval / bench = {100 * result['eval_over_bench']:.1f} % (target >= 80 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
