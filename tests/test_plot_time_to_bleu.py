"""scripts/plot_time_to_bleu.py: dev BLEU against the run's wall clock from evals.csv."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plot_time_to_bleu.py"
spec = importlib.util.spec_from_file_location("plot_time_to_bleu", SCRIPT)
ttb = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ttb  # dataclasses look their module up there
spec.loader.exec_module(ttb)

COLUMNS = ["step", "epoch", "wall_s", "val_loss", "bleu", "bleu_n", "bleu_s", "val_s", "best", "eval_s", "save_s"]


def write_run(path: Path, rows: list[tuple[float, float | str, int]]) -> Path:
    path.mkdir(parents=True)
    with open(path / "evals.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for i, (wall, bleu, n) in enumerate(rows, 1):
            w.writerow([10 * i, 1, wall, 2.0, bleu, n, 0.5, 0.1, 0, 0.6, 0.0])
    return path


def test_best_and_time_to_target_skip_cut_passes(tmp_path):
    run = write_run(tmp_path / "a", [(30.0, 20.0, 500), (60.0, 41.0, 500), (90.0, 45.0, 120), (118.0, 40.0, 500)])
    c = ttb.read_curve(f"{run}=one GPU")
    assert c.label == "one GPU" and c.full == [True, True, False, True]
    assert c.best() == (41.0, 60.0)          # the cut pass's 45 is not a best
    assert c.time_to(40.0) == 60.0 and c.time_to(44.0) is None


def test_rows_without_wall_s_are_left_out_and_counted(tmp_path, capsys):
    run = write_run(tmp_path / "old", [("", 20.0, 500), ("", 30.0, 500), (95.0, 41.0, 500)])
    c = ttb.read_curve(str(run))
    assert c.wall_s == [95.0] and c.untimed == 2
    assert ttb.main([str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert "(2 evaluation(s) without wall_s left out)" in capsys.readouterr().out


def test_main_prints_a_line_per_run_and_writes_the_plot(tmp_path, capsys):
    a = write_run(tmp_path / "a", [(30.0, 20.0, 500), (60.0, 41.0, 500)])
    b = write_run(tmp_path / "b", [(25.0, 30.0, 500), (50.0, "", 0), (70.0, 44.0, 500)])
    out = tmp_path / "ttb.png"
    assert ttb.main([str(a), f"{b}=two", "--out", str(out), "--target", "40"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[1].split()[:2] == ["a", "2"] and text[1].endswith("60.0 s")
    assert text[2].split()[:2] == ["two", "2"] and text[2].endswith("70.0 s")  # the row without BLEU is left out
    assert out.stat().st_size > 0 and not list(tmp_path.glob("*.tmp.png"))


@pytest.mark.parametrize("content, says", [(None, "No such file"), ("step,epoch,bleu\n1,1,3.0\n", "no wall_s column"),
                                           (",".join(COLUMNS) + "\n", "no evaluation with a dev BLEU"),
                                           (",".join(COLUMNS) + "\n1,1,,2.0,30.0,5,0.1,0.1,0,0.2,0\n",
                                            "no evaluation with a wall_s")])
def test_bad_runs_exit_2_naming_the_file(tmp_path, capsys, content, says):
    run = tmp_path / "r"
    run.mkdir()
    if content is not None:
        (run / "evals.csv").write_text(content)
    assert ttb.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"plot_time_to_bleu: error: {run / 'evals.csv'}") and says in err
    assert not (tmp_path / "x.png").exists()


def test_best_so_far_skips_cut_passes_and_at_prints_it_per_minute(tmp_path, capsys):
    run = write_run(tmp_path / "a", [(30.0, 20.0, 500), (60.0, 45.0, 120), (90.0, 41.0, 500), (150.0, 30.0, 500)])
    c = ttb.read_curve(str(run))
    assert c.best_so_far() == [20.0, 20.0, 41.0, 41.0]  # the cut pass is no best; a later drop keeps the best
    assert c.best_at(29.0) is None and c.best_at(60.0) == 20.0 and c.best_at(1e9) == 41.0
    assert ttb.main([str(run), "--out", str(tmp_path / "p.png"), "--at", "0.25,1,3"]) == 0
    head, line = capsys.readouterr().out.splitlines()[:2]
    assert head.split()[-3:] == ["best@0.25m", "best@1m", "best@3m"] and line.split()[-3:] == ["-", "20.00", "41.00"]
    assert ttb.main([str(run), "--out", str(tmp_path / "q.png"), "--at", "1,x"]) == 2
    assert "--at" in capsys.readouterr().err and not (tmp_path / "q.png").exists()


def test_steps_at_interpolates_between_evaluations(tmp_path, capsys):
    # write_run's steps are 10, 20, 30 at 30, 60, 120 s of wall clock
    run = write_run(tmp_path / "a", [(30.0, 20.0, 500), (60.0, 45.0, 500), (120.0, 41.0, 500)])
    c = ttb.read_curve(str(run))
    assert c.step_at(45.0) == 15.0 and c.step_at(90.0) == 25.0 and c.step_at(120.0) == 30.0
    assert c.step_at(10.0) is None and c.step_at(121.0) is None  # outside the evaluations: unknown
    assert ttb.main([str(run), "--out", str(tmp_path / "p.png"), "--at", "0.75,1.5,3", "--steps"]) == 0
    head, line = capsys.readouterr().out.splitlines()[:2]
    assert head.split()[-3:] == ["step@0.75m", "step@1.5m", "step@3m"] and line.split()[-3:] == ["15", "25", "-"]
