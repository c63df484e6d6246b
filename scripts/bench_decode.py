"""Decoding throughput: graph-cached, eager-cached and uncached search, HF generate, CTranslate2.

Why: translation has to run at the speed users get from dedicated inference engines. This times,
on one device and with one set of random weights:

* GPU grid (``--device cuda``, the default where CUDA is present): for each dtype, batch size and
  search (greedy, beam), streamnmt's graph-cached search (:mod:`streamnmt.inference.graph_search`), its eager
  cached search, the uncached reference (the decoder re-run over the whole prefix), and Hugging Face
  transformers ``generate`` on a MarianMT model of the same shape (random weights, nothing
  downloaded; the row is skipped with a note where transformers is absent).
* ``--ct2``: streamnmt on the CPU beside CTranslate2 on the CPU for the same model exported with
  ``streamnmt.inference.export`` (sentences/s, ``--threads`` threads each).

Sources are random ids of 20-40 tokens (5-10 with ``--quick``). A random model almost never emits EOS, so every sentence
is decoded to its length limit (1.5 * source tokens + 10): figures compare decoding cost, not
quality. Each row: a warm-up pass over all sentences (graphs captured there), then ``--repeats``
timed passes; median and min-max are reported. The table comes last; ``--out`` writes JSON.

    python scripts/bench_decode.py --out out/bench_decode.json              # base model, full grid
    python scripts/bench_decode.py --ct2 --no-grid --out out/bench_ct2.json  # CPU: streamnmt vs CTranslate2
    python scripts/bench_decode.py --quick --ct2                            # seconds on a CPU: does it run?
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from streamnmt.models import masks
from streamnmt.inference.decoding import SearchOptions
from streamnmt.inference.search import pad_batch, translate_ids
from streamnmt.inference.graph_search import GraphDecoder
from streamnmt.fsutil import atomic_write
from streamnmt.models.transformer import Transformer, make_model

NOTE = ("random weights: the model almost never emits EOS, so every sentence is decoded to its length "
        "limit (1.5 * source tokens + 10); figures compare decoding cost, not quality")
BASE = dict(d_model=512, n_layers=6, n_heads=8, d_ff=2048)
QUICK = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128)
VARIANTS = ("graph", "eager", "uncached", "hf")
LABELS = {"graph": "graph-cached", "eager": "eager-cached", "uncached": "uncached", "hf": "HF generate",
          "streamnmt-cpu": "streamnmt (CPU)", "ct2-cpu": "CTranslate2 (CPU)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N for the grid (default: cuda if present)")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings that finish in about a minute on a CPU (2+2 x 64 model, vocab 500, 8 "
                        "sentences of 5-10 tokens, batch 4, fp32, 1 timed run): to check that the script works "
                        "before spending GPU time")
    p.add_argument("--vocab", type=int, default=None, help="source and target vocabulary (default 8000)")
    p.add_argument("--sentences", type=int, default=None, help="sentences per timed run (default 512)")
    p.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", default=None,
                   help="comma-separated sentences per batch (default 64,256)")
    p.add_argument("--beams", default="1,3", help="comma-separated beam sizes (1 = greedy)")
    p.add_argument("--dtypes", "--dtype", dest="dtypes", default=None, help="comma-separated: bfloat16,float32 (default both on CUDA, "
                                                  "float32 on the CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--only", default="", help="comma-separated substrings: run only grid rows whose name "
                                              "(e.g. 'beam3 graph-cached', 'greedy uncached') has one")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 3)")
    p.add_argument("--sync-every", type=int, default=0, help="finished-sentence check interval (0 = auto)")
    p.add_argument("--no-grid", action="store_true", help="skip the grid (e.g. with --ct2 alone)")
    p.add_argument("--ct2", action="store_true", help="also compare streamnmt and CTranslate2 on the CPU")
    p.add_argument("--ct2-batch-size", type=int, default=None, help="batch size of the CPU comparison "
                                                                     "(default 32; 8 with --quick)")
    p.add_argument("--ct2-sentences", type=int, default=None, help="sentences of the CPU comparison "
                                                                    "(default 128; 24 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for the CPU comparison")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    q = a.quick
    a.vocab = a.vocab or (500 if q else 8000)
    a.sentences = a.sentences or (8 if q else 512)
    a.batch_sizes = [int(x) for x in (a.batch_sizes or ("4" if q else "64,256")).split(",") if x]
    a.beams = [int(x) for x in a.beams.split(",") if x]
    a.repeats = a.repeats or (1 if q else 3)
    a.ct2_batch_size = a.ct2_batch_size or (4 if q else 32)
    a.ct2_sentences = a.ct2_sentences or (8 if q else 128)
    a.lengths = (5, 10) if q else (20, 40)
    a.variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    return a


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_sources(n: int, vocab: int, seed: int, lengths: tuple[int, int] = (20, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lengths[0], lengths[1] + 1, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (k,), generator=g).tolist() + [masks.EOS] for k in lengths]


def timed(fn: Callable[[], int], device: torch.device, repeats: int) -> dict:
    """Warm-up call, then ``repeats`` timed calls of ``fn`` (returns output tokens)."""
    fn()
    times, tokens = [], 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # note: a sync point; each timed run starts with an idle GPU
        t0 = time.perf_counter()
        tokens = fn()  # ends with the results on the host (a sync)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "output_tokens": tokens}


def row(kind: str, dtype: str, batch: int, beam: int, n: int, t: dict, note: str = "") -> dict:
    med = t["median_s"]
    return {"variant": kind, "label": LABELS[kind], "dtype": dtype, "batch_size": batch, "beam": beam,
            "sentences_per_s": n / med, "sentences_per_s_range": [n / t["max_s"], n / t["min_s"]],
            "tokens_per_s": t["output_tokens"] / med, "output_tokens": t["output_tokens"], **t, "note": note}


def show(r: dict) -> None:
    lo, hi = r["sentences_per_s_range"]
    print(f"  {r['dtype']:<9}{'batch ' + str(r['batch_size']):<10}{'beam ' + str(r['beam']):<8}{r['label']:<20}"
          f"{r['sentences_per_s']:9.1f} sent/s ({lo:.1f}-{hi:.1f}) {r['tokens_per_s']:10.0f} tok/s"
          f"{'  ' + r['note'] if r['note'] else ''}", flush=True)


# -- HF transformers MarianMT of the same shape ---------------------------------------------------


def hf_model(shape: dict, vocab: int, device: torch.device, dtype: torch.dtype):
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(vocab_size=vocab, decoder_vocab_size=vocab, d_model=shape["d_model"],
                       encoder_layers=shape["n_layers"], decoder_layers=shape["n_layers"],
                       encoder_attention_heads=shape["n_heads"], decoder_attention_heads=shape["n_heads"],
                       encoder_ffn_dim=shape["d_ff"], decoder_ffn_dim=shape["d_ff"], activation_function="relu",
                       max_position_embeddings=1024, scale_embedding=True, pad_token_id=masks.PAD,
                       eos_token_id=masks.EOS, bos_token_id=masks.BOS, decoder_start_token_id=masks.BOS,
                       forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    return MarianMTModel(cfg).to(device, dtype).eval()


def hf_run(model, sources: list[list[int]], batch: int, beam: int, device: torch.device) -> int:
    """Translate like translate_ids (longest first, ``batch`` at a time); returns output tokens."""
    order = sorted(sources, key=len, reverse=True)
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(order), batch):
            src = pad_batch(order[i:i + batch], device)
            beam_args = dict(length_penalty=0.6, early_stopping=False) if beam > 1 else {}
            out = model.generate(input_ids=src, attention_mask=src != masks.PAD, num_beams=beam, do_sample=False,
                                 max_new_tokens=int(1.5 * src.size(1) + 10), **beam_args)
            # Output tokens: the positions after the start token, up to the first EOS (or PAD). A random
            # model may well emit the BOS id itself, which is an output token like any other here.
            gen = out[:, 1:]
            ended = ((gen == masks.EOS) | (gen == masks.PAD)).int().cumsum(1) > 0
            # note: a sync point, once per batch, as streamnmt's result copy
            tokens += int((~ended).sum())
    return tokens


# -- the GPU grid -------------------------------------------------------------------------------------


def grid(args: argparse.Namespace, device: torch.device, shape: dict, sources: list[list[int]]) -> list[dict]:
    dtypes = (args.dtypes.split(",") if args.dtypes else
              (["bfloat16", "float32"] if device.type == "cuda" else ["float32"]))
    try:
        import transformers
        hf_note = ""
    except ImportError:
        transformers = None
        hf_note = "skipped: transformers is not installed here"
    results = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(args.seed)
        model = make_model(args.vocab, args.vocab, dropout=0.0, **shape).to(device, dtype).eval()
        hf = None
        for batch in args.batch_sizes:
            for beam in args.beams:
                opts = SearchOptions(beam_size=beam, sync_every=args.sync_every)
                for kind in args.variants:
                    name = f"{'greedy' if beam == 1 else f'beam{beam}'} {LABELS[kind]}"
                    if args.only and not any(w in name for w in args.only.split(",") if w):
                        continue
                    if kind == "hf":
                        if transformers is None:
                            r = {"variant": "hf", "label": LABELS["hf"], "dtype": dtype_name, "batch_size": batch,
                                 "beam": beam, "note": hf_note}
                            print(f"  {dtype_name:<9}{'batch ' + str(batch):<10}{'beam ' + str(beam):<8}"
                                  f"{LABELS['hf']:<20}{hf_note}")
                            results.append(r)
                            continue
                        if hf is None:
                            hf = hf_model(shape, args.vocab, device, dtype)
                        t = timed(lambda: hf_run(hf, sources, batch, beam, device), device, args.repeats)
                        results.append(row(kind, dtype_name, batch, beam, len(sources), t,
                                           f"transformers {transformers.__version__}"))
                    else:
                        results.append(row(kind, dtype_name, batch, beam, len(sources),
                                           timed(streamnmt_run(model, sources, opts, kind, batch, device), device,
                                                 args.repeats),
                                           "" if device.type == "cuda" or kind != "graph"
                                           else "no CUDA: the static step runs eagerly"))
                    show(results[-1])
        model = hf = None  # free this dtype's models before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def streamnmt_run(model: Transformer, sources: list[list[int]], opts: SearchOptions, kind: str, batch: int,
                  device: torch.device) -> Callable[[], int]:
    if kind == "graph":
        decoder = GraphDecoder(model, opts, batch_size=batch)  # kept across runs: graphs captured in warm-up
        return lambda: sum(map(len, translate_ids(model, sources, opts, batch_size=batch, device=device,
                                                  search_fn=decoder.search)))
    o = SearchOptions(beam_size=opts.beam_size, sync_every=opts.sync_every, cached=kind == "eager")
    return lambda: sum(map(len, translate_ids(model, sources, o, batch_size=batch, device=device)))


# -- CPU: streamnmt beside CTranslate2 ----------------------------------------------------------------


class _Pieces:
    """Stand-in vocabulary for the exporter: piece ``i`` is ``t<i>`` (special pieces as SentencePiece's)."""

    SPECIAL = ("<pad>", "<unk>", "<s>", "</s>")

    def __init__(self, n: int):
        self.vocab_size = n

    def piece(self, i: int) -> str:
        return self.SPECIAL[i] if i < len(self.SPECIAL) else f"t{i}"


def ct2_compare(args: argparse.Namespace, shape: dict) -> list[dict]:
    try:
        import ctranslate2
    except ImportError:
        print("  CTranslate2 comparison skipped: pip install 'streamnmt[deploy]'")
        return [{"variant": "ct2-cpu", "label": LABELS["ct2-cpu"], "note": "skipped: ctranslate2 not installed"}]
    from streamnmt.inference.export import make_converter

    cpu = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = make_model(args.vocab, args.vocab, dropout=0.0, **shape).eval()
    sources = random_sources(args.ct2_sentences, args.vocab, args.seed + 1, args.lengths)
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            pieces = _Pieces(args.vocab)
            make_converter(model, pieces, pieces).convert(f"{tmp}/ct2")
            translator = ctranslate2.Translator(f"{tmp}/ct2", device="cpu", inter_threads=1,
                                                intra_threads=args.threads)
            toks = [[pieces.piece(i) for i in s[:-1]] for s in sources]  # CTranslate2 appends the EOS
            limits = [int(1.5 * len(s) + 10) for s in sources]  # streamnmt's per-sentence limit
            groups = {n: [t for t, m in zip(toks, limits) if m == n] for n in sorted(set(limits), reverse=True)}
            for beam in args.beams:
                opts = SearchOptions(beam_size=beam)
                t = timed(lambda: sum(map(len, translate_ids(model, sources, opts, batch_size=args.ct2_batch_size,
                                                             device=cpu))), cpu, args.repeats)
                results.append(row("streamnmt-cpu", "float32", args.ct2_batch_size, beam, len(sources), t,
                                   f"{args.threads} threads, eager cached"))
                show(results[-1])

                def ct2_run() -> int:
                    n = 0
                    for limit, group in groups.items():
                        out = translator.translate_batch(group, beam_size=beam, max_decoding_length=limit,
                                                         max_batch_size=args.ct2_batch_size, length_penalty=0.6)
                        n += sum(len(r.hypotheses[0]) for r in out)
                    return n

                results.append(row("ct2-cpu", "float32", args.ct2_batch_size, beam, len(sources),
                                   timed(ct2_run, cpu, args.repeats),
                                   f"{args.threads} threads, ctranslate2 {ctranslate2.__version__}"))
                show(results[-1])
    finally:
        torch.set_num_threads(threads)
    return results


# -- main -------------------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    lines = [f"{'dtype':<9}{'batch':>6}{'beam':>5}  {'variant':<20}{'sent/s':>9}{'(min-max)':>17}{'tok/s':>10}"
             f"{'x HF':>8}{'x eager':>9}{'x uncached':>11}"]
    by = {(r.get("dtype"), r.get("batch_size"), r.get("beam"), r["variant"]): r for r in results}
    for r in results:
        if "sentences_per_s" not in r:
            lines.append(f"{r.get('dtype', ''):<9}{r.get('batch_size', ''):>6}{r.get('beam', ''):>5}  "
                         f"{r['label']:<20}{r['note']}")
            continue
        key = (r["dtype"], r["batch_size"], r["beam"])
        ratios = []
        for other in ("hf", "eager", "uncached"):
            o = by.get((*key, other))
            ok = o and "sentences_per_s" in o and r["variant"] in ("graph", "eager") and other != r["variant"]
            ratios.append(f"{r['sentences_per_s'] / o['sentences_per_s']:.2f}x" if ok else "")
        if r["variant"] == "ct2-cpu":
            s = by.get((*key, "streamnmt-cpu"))
            ratios = ["", "", f"{r['sentences_per_s'] / s['sentences_per_s']:.2f}x streamnmt" if s else ""]
        lo, hi = r["sentences_per_s_range"]
        lines.append(f"{r['dtype']:<9}{r['batch_size']:>6}{r['beam']:>5}  {r['label']:<20}{r['sentences_per_s']:>9.1f}"
                     f"{f'({lo:.1f}-{hi:.1f})':>17}{r['tokens_per_s']:>10.0f}{ratios[0]:>8}{ratios[1]:>9}  {ratios[2]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = QUICK if args.quick else BASE
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"decode benchmark: {device_name}, model {shape} vocab {args.vocab}, {args.sentences} sentences of "
          f"{args.lengths[0]}-{args.lengths[1]} tokens, batches {args.batch_sizes}, beams {args.beams}, {args.repeats} timed runs per row")
    print(f"note: {NOTE}")
    results: list[dict] = []
    if not args.no_grid:
        results += grid(args, device, shape, random_sources(args.sentences, args.vocab, args.seed + 1, args.lengths))
    if args.ct2:
        print(f"CPU: streamnmt vs CTranslate2, {args.ct2_sentences} sentences, batch {args.ct2_batch_size}, "
              f"{args.threads} threads")
        results += ct2_compare(args, shape)
    if args.out:
        report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": git_commit(), "device": device_name, "torch": torch.__version__, "note": NOTE,
                  "args": vars(args), "model": {**shape, "vocab": args.vocab}, "results": results}
        atomic_write(args.out, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    print("\nsummary (x HF / x eager / x uncached: sentences/s ratios in the same dtype, batch and beam; "
          "CTranslate2 rows: x streamnmt on the CPU)")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
