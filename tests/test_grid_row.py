"""scripts/grid_row.py: a row of scripts/real_grid.sh's table from a run's evals.csv and log."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "grid_row.py"
spec = importlib.util.spec_from_file_location("grid_row", SCRIPT)
grid_row = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid_row)

# the lines the table reads, in the trainer's formats (values made up)
LOG = """\
data: trained source tokenizer and target tokenizer on 900 sampled pairs in 0.4s -> /c/tokenizer
data: ready in 1.3s (vocab 4000 source, 3900 target)
set-up 21.2 s: start-up (interpreter and imports) 5.7 s, data 6.6 s
  Epoch  GPU_mem  batches  tokens/s  train_loss  train_nll      ppl  val_loss   BLEU    time
      1    4.26G      184    595909      6.4268     6.1523   469.81    4.9234   5.47    1.3s
      2    4.26G      368    533818      4.6908     4.1283    62.08         -      -    1.4s
      3    4.26G      552    480136      3.8380     3.1234    22.72         -      -    1.6s
wall 595 s: training 95 % (563 s), evaluation 1 % (4 s), set-up 4 % (22 s)
"""


def write_evals(path: Path, rows: list[tuple]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["step", "epoch", "wall_s", "val_loss", "bleu", "bleu_n", "best", "kind"])
        for step, wall, bleu, n, *kind in rows:
            w.writerow([step, 1, wall, 1.0, bleu, n, 0, *kind])
    return path


def test_the_best_whole_pass_and_the_log_columns(tmp_path, capsys):
    # an evaluation without BLEU first (its empty value must not win or block the max), a cut pass
    # scoring above the whole ones (not compared, as for best.pt), the end's --average-last row (no
    # point in time: left out, as in the plots)
    evals = write_evals(tmp_path / "evals.csv", [(10, 20.0, "", 0), (184, 30.4, "41.20", 500),
                                                 (368, 61.9, "55.07", 500), (400, 70.0, "60.00", 64),
                                                 (400, 71.0, "58.00", 500, "average")])
    (tmp_path / "run.log").write_text(LOG)
    assert grid_row.main([str(evals), str(tmp_path / "run.log")]) == 0
    assert capsys.readouterr().out.split() == ["55.07", "62", "368", "534k", "21.2", "95%", "4000/3900", "-"]


def test_tokenizers_not_trained_are_marked_found_and_missing_files_give_dashes(tmp_path, capsys):
    found = LOG.replace("data: trained source tokenizer and target tokenizer", "data: source tokenizer:")
    assert grid_row.from_log(found)[-2] == "4000/3900,found"
    assert grid_row.main([str(tmp_path / "none.csv"), str(tmp_path / "none.log")]) == 0
    assert capsys.readouterr().out.split() == ["-"] * 8


@pytest.mark.parametrize("lines, state", [
    ("engine: compile off (auto: a run of ~2 min would save ~23 s, < 2x the ~34 s of compiling 1 batch shape(s))",
     "off"),
    # the auto line names the cache state even where the rule then says off: off wins
    ("engine: compile off (auto: a run of ~2 min would save ~23 s; compile cache cold)", "off"),
    (("engine: compile on (auto: a run of ~10 min saves ~116 s; compile cache cold)\n"
     "engine: ready in 26.7 s after the data (compile cache cold: /h/compile/inductor, key e7c0)"), "cold"),
    (("engine: compile on (as requested)\n"
     "engine: ready in 7.9 s after the data (compile cache warm: /h/compile/inductor, key e7c0)"), "warm"),
    (("engine: compile in the background\n"
     "engine: compiled step from step 6257 on (compiled beside training in 55 s; compiled here from its cache "
     "and captured in 10.7 s)"), "bg@6257"),
    ("engine: compile in the background", "bg"),
    ("engine: strategy graph (auto: CUDA is present)", "-"),
])
def test_the_compile_column_names_how_the_step_was_compiled(lines, state):
    assert grid_row.compile_state(lines) == state
    assert grid_row.from_log(LOG + lines)[-1] == state
