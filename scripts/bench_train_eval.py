"""The trainer's dev BLEU pass beside the decoding benchmark's graph-cached rate, same model and sources.

A training run's ``evals.csv`` records, for each evaluation, the seconds of its BLEU pass
(``bleu_s``: translating ``--bleu-samples`` dev sentences through the graph decoder and scoring
them, inside the training loop). This reads the run's last evaluation (its graphs captured at an
earlier one), then times :func:`bench_decode.streamnmt_run` (graph-cached search alone, no
scoring) on the run's ``last.pt`` weights in the same dtype, on the same dev sources, batch and
beam: a warm-up call, then ``--repeats`` timed calls. It prints trainer / bench (the target is
>= 80 %).

    python3 scripts/bench_train_eval.py runs/train/exp --out out/train_eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

from bench_decode import streamnmt_run, timed  # noqa: E402
from streamnmt.config import job_from_dict  # noqa: E402
from streamnmt.data import read_pairs  # noqa: E402
from streamnmt.fsutil import atomic_write  # noqa: E402
from streamnmt.inference.decoding import SearchOptions, decode_dtype  # noqa: E402
from streamnmt.inference.scoring import encode_sources  # noqa: E402
from streamnmt.inference.translate import load_for_inference  # noqa: E402
from streamnmt.training.evaluator import EVAL_BATCH  # noqa: E402
from streamnmt.training.runs import read_csv  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a training run directory (runs/train/expN)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    run = Path(args.run)
    evals = [r for r in read_csv(run / "evals.csv") if r["bleu_s"] and not r.get("kind")]  # evaluations only
    if len(evals) < 2:
        print(f"{run}: needs two evaluations or more (the first one captures the decoding graphs)")
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = load_for_inference(run / "weights" / "last.pt", "cpu")[3]
    job = job_from_dict(config)
    dtype = decode_dtype(job.run.eval_dtype, device, "eval_dtype")
    model, src_tok, _, _ = load_for_inference(run / "weights" / "last.pt", device, dtype=dtype)
    pairs = read_pairs(job.data, "dev")[:job.run.bleu_samples]
    sources, _ = encode_sources(src_tok, [s for s, _ in pairs], model.shape.max_positions)
    opts = SearchOptions(beam_size=job.run.beam_size, graph=True)
    with torch.no_grad():
        t = timed(streamnmt_run(model, sources, opts, "graph", EVAL_BATCH, device), device, args.repeats)
    n = len(sources)
    trainer = [n / float(r["bleu_s"]) for r in evals[1:]]
    bench = n / t["median_s"]
    result = {"run": str(run), "sentences": n, "batch_size": EVAL_BATCH, "beam": job.run.beam_size,
              "dtype": str(dtype), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "trainer_sentences_per_s": trainer, "trainer_last": trainer[-1], "bench_sentences_per_s": bench,
              "bench_range": [n / t["max_s"], n / t["min_s"]], "ratio_last": trainer[-1] / bench}
    print(f"{n} dev sentences, batch {EVAL_BATCH}, beam {job.run.beam_size}, {dtype}: trainer's BLEU pass "
          f"{trainer[-1]:.1f} sent/s (evaluations after the first: {', '.join(f'{x:.0f}' for x in trainer)}); "
          f"bench_decode graph-cached {bench:.1f} sent/s [{result['bench_range'][0]:.0f}-"
          f"{result['bench_range'][1]:.0f}]: {100 * result['ratio_last']:.1f} % (target >= 80 %)")
    if args.out:
        atomic_write(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
