"""One line on a training run from its evals.csv and results.csv (scripts/gpu_measure.sh ab-async):
evaluations, best and last dev BLEU, optimizer steps, the epochs' training seconds, and the
evaluations' loop waits against their BLEU passes' own seconds."""

import csv
import sys


def main(evals_path: str, results_path: str) -> None:
    with open(evals_path) as f:
        evals = [r for r in csv.DictReader(f) if not r.get("kind")]  # evaluations only (no --average-last row)
    with open(results_path) as f:
        results = list(csv.DictReader(f))
    bleu = [float(r["bleu"]) for r in evals if r["bleu"]]
    epoch_s = sum(float(r["epoch_s"]) for r in results)
    waits = sum(float(r["eval_s"]) for r in evals)
    passes = sum(float(r["bleu_s"]) for r in evals)
    print(f"evals {len(evals)}, best dev BLEU {max(bleu):.2f}, last {bleu[-1]:.2f}; steps {results[-1]['steps']}, "
          f"epoch_s sum {epoch_s:.1f} s, loop waits for evaluation {waits:.1f} s, BLEU passes {passes:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
