"""Run folders: --project checked before the set-up."""

from __future__ import annotations

import os

import pytest

from streamnmt.cli import main
from streamnmt.errors import ConfigError
from streamnmt.training.runs import check_project, check_weights_kept, increment_path


def test_a_project_under_a_file_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--project: .*file is not a folder"):
        check_project(tmp_path / "file" / "runs" / "train")
    check_project(tmp_path / "new" / "runs")  # missing folders are made later: fine
    check_project(tmp_path)


def test_an_unwritable_project_is_refused(tmp_path, monkeypatch):
    # os.access stands in for the permission bits (a root user writes anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != os.fspath(tmp_path))
    with pytest.raises(ConfigError, match=r"--project: cannot write in "):
        check_project(tmp_path / "runs")


def test_train_refuses_the_project_before_its_set_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    (tmp_path / "file").write_text("x")
    rc = main(["train", "--device", "cpu", "--model", "tiny", "--builtin-size", "2000", "--max-steps", "1",
               "--project", str(tmp_path / "file" / "runs")])
    out = capsys.readouterr()
    assert rc != 0 and "--project:" in out.err and "is not a folder" in out.err
    assert "data:" not in out.out + out.err  # no corpus prepared, no tokenizer trained


def test_increment_path_numbers_the_next_free_name(tmp_path):
    assert increment_path(tmp_path, "exp") == tmp_path / "exp"
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp3").mkdir()
    assert increment_path(tmp_path, "exp") == tmp_path / "exp4"
    assert increment_path(tmp_path, "exp", exist_ok=True) == tmp_path / "exp"


def test_weights_in_the_folder_exist_ok_reuses_are_refused(tmp_path):
    weights = tmp_path / "runs" / "exp" / "weights"
    weights.mkdir(parents=True)
    for name in ("best.pt", "last.pt", "ema.pt", "step_000100.pt"):
        with pytest.raises(ConfigError, match=r"--weights: .* --exist-ok reuses"):
            check_weights_kept(tmp_path / "runs", "exp", True, str(weights / name))
    check_weights_kept(tmp_path / "runs", "exp", False, str(weights / "best.pt"))  # a new folder: kept
    check_weights_kept(tmp_path / "runs", "exp2", True, str(weights / "best.pt"))  # another folder
    check_weights_kept(tmp_path / "runs", "exp", True, str(weights / "mine.pt"))  # not removed


def test_train_keeps_weights_it_would_have_removed(tmp_path, capsys, monkeypatch):
    # fine-tuning from the earlier run's best.pt into the same folder deleted that best.pt once loaded
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    best = tmp_path / "runs" / "exp" / "weights" / "best.pt"
    best.parent.mkdir(parents=True)
    best.write_bytes(b"an earlier run's weights")
    rc = main(["train", "--device", "cpu", "--model", "tiny", "--max-steps", "1", "--project",
               str(tmp_path / "runs"), "--exist-ok", "--weights", str(best)])
    assert rc != 0 and "--exist-ok reuses" in capsys.readouterr().err
    assert best.read_bytes() == b"an earlier run's weights"
