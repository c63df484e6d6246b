"""Time to BLEU: dev BLEU against the run's wall clock for several runs, from their evals.csv.

Each row of ``evals.csv`` holds ``wall_s``, the run's seconds from the command's start (summed over
resumes) to the evaluated weights, and the dev BLEU of that evaluation. A pass the time limit cut
short (``bleu_n`` under the largest count of the run, taken as the whole pass) is drawn hollow and
not counted as the run's best. Dev BLEU can move by many points from one evaluation to the next, so
the plot draws each evaluation faintly and, solid, the best whole pass so far: what the run's
best.pt holds at that moment. Rows without ``wall_s`` (a run resumed from a checkpoint older than
that column: its earlier seconds are unknown) are left out, and the line says how many.

Usage: python3 scripts/plot_time_to_bleu.py RUN_DIR[=LABEL] ... [--out ttb.png] [--target BLEU] [--at MIN,...] [--steps]
Prints one line per run (evaluations, best BLEU and when, time to --target, the best so far at each
--at minute and, with --steps, the step reached there) and writes the plot.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curve:
    label: str
    wall_s: list[float]
    bleu: list[float]
    full: list[bool]  # a whole BLEU pass (not cut by the time limit)
    untimed: int = 0  # evaluations left out: no wall_s
    step: list[str] = field(default_factory=list)  # each evaluation's step, as evals.csv has it

    def best(self) -> tuple[float, float] | None:
        """(BLEU, wall_s) of the best whole pass, or None."""
        i = self.best_index()
        return None if i is None else (self.bleu[i], self.wall_s[i])

    def best_index(self) -> int | None:
        """The index of the best whole pass (the earliest of equals), or None."""
        points = [i for i, f in enumerate(self.full) if f]
        return max(points, key=lambda i: (self.bleu[i], -self.wall_s[i])) if points else None

    def best_so_far(self) -> list[float | None]:
        """After each evaluation, the best whole pass up to it (None before the first whole pass)."""
        out: list[float | None] = []
        for b, f in zip(self.bleu, self.full):
            prev = out[-1] if out else None
            out.append(max(b, prev) if f and prev is not None else (b if f else prev))
        return out

    def best_at(self, seconds: float) -> float | None:
        """The best whole pass evaluated at or before ``seconds`` of wall clock."""
        seen = [b for b, w in zip(self.best_so_far(), self.wall_s) if w <= seconds and b is not None]
        return seen[-1] if seen else None

    def step_at(self, seconds: float) -> float | None:
        """The training step at ``seconds`` of wall clock, interpolated between the evaluations around
        it (None outside them): how far each run had trained by the same wall clock."""
        pts = [(w, float(s)) for w, s in zip(self.wall_s, self.step) if s.isdigit()]
        for (w0, s0), (w1, s1) in itertools.pairwise(pts):
            if w0 <= seconds <= w1:
                return s0 if w1 == w0 else s0 + (s1 - s0) * (seconds - w0) / (w1 - w0)
        return None

    def time_to(self, target: float) -> float | None:
        """wall_s of the first whole pass at or above ``target``, or None."""
        return next((w for b, w, f in zip(self.bleu, self.wall_s, self.full) if f and b >= target), None)


class InputError(Exception):
    pass


def read_curve(spec: str) -> Curve:
    """``RUN_DIR[=LABEL]``: the run's evaluations with a BLEU, in step order."""
    path, _, label = spec.partition("=")
    run = Path(path)
    evals = run / "evals.csv" if run.is_dir() else run
    try:
        with open(evals, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if not r.get("kind")]  # the end's --average-last row: no point in time
    except OSError as e:
        raise InputError(f"{evals}: {e.strerror or e}") from None
    if rows and "wall_s" not in rows[0]:
        raise InputError(f"{evals}: no wall_s column (written by streamnmt train since evals.csv gained it)")
    rows = [r for r in rows if r.get("bleu")]
    if not rows:
        raise InputError(f"{evals}: no evaluation with a dev BLEU (a run with --bleu-samples 0?)")
    timed = [r for r in rows if r.get("wall_s")]
    if not timed:
        raise InputError(f"{evals}: no evaluation with a wall_s (resumed from a checkpoint that did not record it)")
    try:
        counts = [int(r["bleu_n"]) if r.get("bleu_n") else 0 for r in timed]
        return Curve(label or (run.name if run.is_dir() else run.parent.name),
                     [float(r["wall_s"]) for r in timed], [float(r["bleu"]) for r in timed],
                     [n == max(counts) for n in counts], untimed=len(rows) - len(timed),
                     step=[r.get("step") or "-" for r in timed])
    except ValueError as e:
        raise InputError(f"{evals}: {e}") from None


def summary(curves: list[Curve], target: float | None, at_min: list[float] = (), steps: bool = False) -> str:
    head = f"{'run':<24} {'evals':>5} {'last s':>8} {'best BLEU':>9} {'at s':>8}"
    head += f" {'to ' + format(target, 'g'):>11}" if target is not None else ""
    head += "".join(f" {'best@' + format(m, 'g') + 'm':>9}" for m in at_min)
    head += "".join(f" {'step@' + format(m, 'g') + 'm':>9}" for m in at_min) if steps else ""
    lines = [head]
    for c in curves:
        best = c.best()
        line = (f"{c.label:<24} {len(c.bleu):>5} {c.wall_s[-1]:>8.1f} "
                + (f"{best[0]:>9.2f} {best[1]:>8.1f}" if best else f"{'-':>9} {'-':>8}"))
        if target is not None:
            t = c.time_to(target)
            line += f" {'not reached' if t is None else format(t, '.1f') + ' s':>11}"
        for m in at_min:
            b = c.best_at(60 * m)
            line += f" {'-' if b is None else format(b, '.2f'):>9}"
        for m in at_min if steps else ():
            s = c.step_at(60 * m)
            line += f" {'-' if s is None else format(round(s), ','):>9}"
        if c.untimed:
            line += f"  ({c.untimed} evaluation(s) without wall_s left out)"
        lines.append(line)
    return "\n".join(lines)


def plot(curves: list[Curve], out: Path, target: float | None, ylim: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in curves:
        minutes = [w / 60 for w in c.wall_s]
        best = [(m, b) for m, b in zip(minutes, c.best_so_far()) if b is not None]
        (line,) = ax.step(*zip(*best), where="post", lw=1.8, label=c.label) if best else ax.plot([], [], label=c.label)
        color = line.get_color()
        ax.plot(minutes, c.bleu, color=color, lw=0.6, alpha=0.3)
        ax.scatter([m for m, f in zip(minutes, c.full) if f], [b for b, f in zip(c.bleu, c.full) if f], s=8,
                   color=color, alpha=0.4)
        cut = [(m, b) for m, b, f in zip(minutes, c.bleu, c.full) if not f]
        if cut:
            ax.scatter(*zip(*cut), s=8, facecolors="none", edgecolors=color, alpha=0.4)
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls="--")
    if ylim is not None:
        ax.set_ylim(bottom=ylim)
    ax.set_xlabel("wall clock from the command's start (min)")
    ax.set_ylabel("dev BLEU (line: best so far; dots: each pass)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR[=LABEL]", help="run directories (or evals.csv files)")
    p.add_argument("--out", default="time_to_bleu.png", help="the plot (PNG)")
    p.add_argument("--target", type=float, default=None, help="a dev BLEU: print when each run first reached it")
    p.add_argument("--at", default="", metavar="MIN,...", help="minutes of wall clock: print each run's best so far there")
    p.add_argument("--steps", action="store_true",
                   help="with --at: also print each run's training step at those minutes (interpolated)")
    p.add_argument("--ylim", type=float, default=None, help="lowest dev BLEU drawn (default: all)")
    args = p.parse_args(argv)
    try:
        at_min = [float(m) for m in args.at.split(",") if m.strip()]
    except ValueError:
        print(f"plot_time_to_bleu: error: --at: not a list of minutes: {args.at!r}", file=sys.stderr)
        return 2
    try:
        curves = [read_curve(spec) for spec in args.runs]
    except InputError as e:
        print(f"plot_time_to_bleu: error: {e}", file=sys.stderr)
        return 2
    print(summary(curves, args.target, at_min, args.steps))
    plot(curves, Path(args.out), args.target, args.ylim)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
