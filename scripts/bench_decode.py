"""Decoding throughput: cached vs uncached beam search (and greedy), sentences/s on one device.

Why: incremental decoding (streamnmt.decode.CachedStepper) is meant to make each new token cost one
position instead of the whole prefix; this measures what it buys against the uncached reference
(FullStepper), and what the interval between finished-sentence checks (host syncs) costs.

The model has random weights (fixed seed) and the sources are random ids of 20-40 tokens. Such a
model almost never emits EOS, so every variant decodes each sentence to its length limit
(1.5 * source length + 10): the figures compare decoding cost, not translation quality.

    python scripts/bench_decode.py --device cuda --out out/bench_decode.json
    python scripts/bench_decode.py --small --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from streamnmt import masks
from streamnmt.decode import SearchOptions, sync_interval, translate_ids
from streamnmt.engine.syncstats import STATS
from streamnmt.fsutil import atomic_write
from streamnmt.model import make_model

NOTE = ("random weights: the model almost never emits EOS, so every sentence is decoded to its length "
        "limit (1.5 * source tokens + 10); figures compare decoding cost, not quality")


@dataclass
class Variant:
    name: str
    beam_size: int
    cached: bool
    sync_every: int = 0  # 0 = decode.sync_interval(device)


def variants(beam: int, device: torch.device, sync_sweep: list[int]) -> list[Variant]:
    auto = sync_interval(device)
    out = [Variant("greedy cached", 1, True), Variant("greedy uncached", 1, False),
           Variant(f"beam{beam} cached", beam, True)]
    out += [Variant(f"beam{beam} cached, sync every {n}", beam, True, sync_every=n) for n in sync_sweep if n != auto]
    return out + [Variant(f"beam{beam} uncached", beam, False)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    p.add_argument("--small", action="store_true", help="a small model (2+2 layers x 128, vocab 2000) for the CPU")
    p.add_argument("--vocab", type=int, default=None, help="source and target vocabulary (default 8000; 2000 with --small)")
    p.add_argument("--sentences", type=int, default=None, help="sentences per timed run (default 512; 32 with --small)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per decoding batch")
    p.add_argument("--beam", type=int, default=3, help="beam size of the beam variants")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median reported)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model weights' dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-sweep", default="1",
                   help="comma-separated intervals (decoding steps) between finished-sentence checks to time "
                        "for cached beam search, besides the default interval")
    p.add_argument("--only", default="", help="comma-separated substrings: run only variants whose name has one")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_run(model: torch.nn.Module, sources: list[list[int]], opts: SearchOptions, batch_size: int,
             device: torch.device) -> tuple[float, int]:
    """(seconds, output tokens) of decoding ``sources`` once."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a sync point; the timed region starts with an idle GPU
    t0 = time.perf_counter()
    out = translate_ids(model, sources, opts, batch_size=batch_size, device=device)  # ends on a sync per batch
    return time.perf_counter() - t0, sum(len(h) for h in out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vocab = args.vocab or (2000 if args.small else 8000)
    n_sent = args.sentences or (32 if args.small else 512)
    shape = dict(d_model=128, n_layers=2, n_heads=4, d_ff=512) if args.small else \
        dict(d_model=512, n_layers=6, n_heads=8, d_ff=2048)

    # 1. model and sources, both from the seed
    torch.manual_seed(args.seed)
    model = make_model(vocab, vocab, dropout=0.0, **shape).to(device, getattr(torch, args.dtype)).eval()
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(20, 41, (n_sent,), generator=g).tolist()
    sources = [torch.randint(4, vocab, (n,), generator=g).tolist() + [masks.EOS] for n in lengths]
    wanted = [s for s in args.only.split(",") if s]
    sweep = [int(n) for n in args.sync_sweep.split(",") if n]
    runs = [v for v in variants(args.beam, device, sweep) if not wanted or any(w in v.name for w in wanted)]

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"decode benchmark: {device_name}, {args.dtype}, model {shape} vocab {vocab}, {n_sent} sentences of "
          f"20-40 tokens, batch {args.batch_size}, {args.repeats} timed runs per variant")
    print(f"note: {NOTE}")

    # 2. each variant: one warm-up batch, then timed runs over all sentences
    results = []
    for v in runs:
        opts = SearchOptions(beam_size=v.beam_size, cached=v.cached, sync_every=v.sync_every)
        time_run(model, sources[:args.batch_size], opts, args.batch_size, device)
        STATS.reset()
        times, tokens = [], 0
        for _ in range(args.repeats):
            seconds, tokens = time_run(model, sources, opts, args.batch_size, device)
            times.append(seconds)
        syncs = STATS.reset().get("decode.retire", {}).get("count", 0) / args.repeats
        med = statistics.median(times)
        results.append({**asdict(v), "sync_every": v.sync_every or sync_interval(device),
                        "sentences_per_s": n_sent / med, "tokens_per_s": tokens / med, "median_s": med,
                        "min_s": min(times), "max_s": max(times), "output_tokens": tokens,
                        "retire_syncs_per_run": syncs})
        r = results[-1]
        print(f"  {v.name:<34} {r['sentences_per_s']:9.1f} sent/s {r['tokens_per_s']:10.0f} tok/s  "
              f"median {med:7.3f} s  spread {min(times):.3f}-{max(times):.3f}  syncs/run {syncs:.0f}", flush=True)

    # 3. summary: what the cache buys
    by_name = {r["name"]: r for r in results}
    for kind in ("greedy", f"beam{args.beam}"):
        c, u = by_name.get(f"{kind} cached"), by_name.get(f"{kind} uncached")
        if c and u:
            print(f"{kind}: cached is {c['sentences_per_s'] / u['sentences_per_s']:.2f}x uncached")
    if args.out:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": git_commit(), "device": device_name, "torch": torch.__version__, "note": NOTE,
                  "args": vars(args), "model": {**shape, "vocab": vocab}, "results": results}
        atomic_write(args.out, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
