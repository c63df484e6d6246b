"""One row of scripts/real_grid.sh's table, from a run's evals.csv and its training log.

Prints, space-separated ("-" where the run has no value):
  best_dev at_s at_step tok/s setup_s train pieces compile
- best_dev, at_s, at_step: the best dev BLEU of a whole pass, with its wall-clock second and step, read
  as scripts/plot_time_to_bleu.py reads a run (a pass the time limit cut short is not compared, as for
  best.pt; the end's --average-last row, no point in time, is left out);
- tok/s: the median of the epoch lines' target tokens/s, in thousands;
- setup_s and train: the set-up line's seconds and the end line's training share of the wall clock;
- pieces: the source/target tokenizers' pieces from the data line, ",found" where the run trained
  none (it found them in the corpus folder or was given them);
- compile: how the step was compiled, from the engine lines: off, cold or warm (the compile cache when
  the run compiled before its first step), bg@STEP (`--compile background`, the compiled step from
  STEP on) or bg (the background compile never took over). A cold cache costs the set-up tens of
  seconds (docs/PERFORMANCE.md, "What compiling buys"): rows compared must say which they had.

Usage: python3 scripts/grid_row.py EVALS_CSV LOG
"""

from __future__ import annotations

import importlib.util
import re
import statistics
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("plot_time_to_bleu", Path(__file__).with_name("plot_time_to_bleu.py"))
ttb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ttb  # its dataclasses look their module up there
_spec.loader.exec_module(ttb)

EPOCH_LINE = re.compile(r"^\s+\d+\s+[\d.]+G\s+\d+\s+(\d+)\s", re.M)  # epoch, GPU_mem, steps, tokens/s
SETUP_LINE = re.compile(r"^set-up ([\d.]+) s", re.M)
END_LINE = re.compile(r"^wall \d+ s: training (\d+) %", re.M)
DATA_LINE = re.compile(r"^data: ready in .*\(vocab (\d+) source, (\d+) target\)", re.M)
TRAINED_LINE = re.compile(r"^data: trained ", re.M)
COMPILE_OFF = re.compile(r"^engine: compile off", re.M)
SWITCH_LINE = re.compile(r"^engine: compiled step from step (\d+) on", re.M)
BACKGROUND_LINE = re.compile(r"^engine: compile in the background", re.M)
CACHE_STATE = re.compile(r"^engine: .*compile cache (warm|cold)", re.M)


def best_dev(path: Path) -> list[str]:
    """[BLEU, wall s, step] of the best whole pass, or dashes."""
    try:
        curve = ttb.read_curve(str(path))
    except ttb.InputError:
        return ["-", "-", "-"]
    i = curve.best_index()
    if i is None:
        return ["-", "-", "-"]
    return [f"{curve.bleu[i]:.2f}", f"{curve.wall_s[i]:.0f}", curve.step[i]]


def compile_state(text: str) -> str:
    """off, cold, warm, bg@STEP, bg or - (see the module docstring)."""
    if COMPILE_OFF.search(text):
        return "off"
    if switch := SWITCH_LINE.search(text):
        return f"bg@{switch.group(1)}"
    if BACKGROUND_LINE.search(text):
        return "bg"
    cache = CACHE_STATE.search(text)
    return cache.group(1) if cache else "-"


def from_log(text: str) -> list[str]:
    """[tok/s, set-up s, training share, pieces, compile] from a training log."""
    tok = [float(m) for m in EPOCH_LINE.findall(text)]
    setup = SETUP_LINE.search(text)
    train = END_LINE.findall(text)
    vocab = DATA_LINE.search(text)
    pieces = f"{vocab.group(1)}/{vocab.group(2)}" if vocab else "-"
    if vocab and not TRAINED_LINE.search(text):
        pieces += ",found"
    return [f"{statistics.median(tok) / 1000:.0f}k" if tok else "-", setup.group(1) if setup else "-",
            f"{train[-1]}%" if train else "-", pieces, compile_state(text)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        text = Path(argv[1]).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    print(*best_dev(Path(argv[0])), *from_log(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
