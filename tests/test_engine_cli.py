"""The engine through the trainer and the CLI: --streams, the event strategy's counters and a failed
event query, CPU utilisation in results.csv (CPU, tiny model)."""

from __future__ import annotations

import functools
import json

import pytest

import streamnmt.training.build
from streamnmt.cli import main
from streamnmt.engine import make_strategy
from streamnmt.training.runs import read_csv
from tests.engine.streamdouble import RecordingStreamManager
from tests.test_cli import TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest.single_thread)


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))


def train(tmp_path, *extra: str, name: str = "exp") -> int:
    return main(["train", *TINY, "--project", str(tmp_path / "runs"), "--name", name, *extra])


def with_manager(monkeypatch, **kw) -> list[RecordingStreamManager]:
    """The trainer's strategy gets a recording stream manager; returns the managers made."""
    made: list[RecordingStreamManager] = []

    def factory(device, n):
        made.append(RecordingStreamManager(device, n, **kw))
        return made[-1]

    monkeypatch.setattr(streamnmt.training.build, "make_strategy", functools.partial(make_strategy, manager=factory))
    return made


def test_event_not_ready_count_in_sync_stats(tmp_path, monkeypatch):
    answers = iter([False, False, True] * 100)
    made = with_manager(monkeypatch, answer=lambda ev: next(answers))
    assert train(tmp_path, "--sync-strategy", "event", "--max-steps", "12", "--epochs", "1") == 0
    assert made and made[0].n == 2
    stats = json.loads((tmp_path / "runs" / "exp" / "sync_stats.json").read_text())
    assert stats[0]["strategy"] == "event"
    assert stats[0]["engine"] == {"event.queries": 12, "event.not_ready": 8}


def test_failed_event_query_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    def answer(ev):
        if ev.records >= 4:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return True

    with_manager(monkeypatch, answer=answer)
    assert train(tmp_path, "--sync-strategy", "event", "--max-steps", "12") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--sync-strategy event" in err[0] and "batch 3" in err[0] and "launch failure" in err[0]


def test_streams_flag(tmp_path, monkeypatch, capsys):
    assert train(tmp_path, "--sync-strategy", "interval", "--streams", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--streams" in err[0] and "deep and full" in err[0]
    assert train(tmp_path, "--sync-strategy", "deep", "--streams", "5") == 2
    assert "--streams" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    made = with_manager(monkeypatch)
    assert train(tmp_path, "--sync-strategy", "deep", "--streams", "3", "--max-steps", "6", "--epochs", "1") == 0
    assert made[0].n == 3 and {op.stream for op in made[0].ops if op.kind == "use"} == {0, 1, 2}
    results = read_csv(tmp_path / "runs" / "exp" / "results.csv")
    # loader in worker processes or not, the training process itself used some CPU
    assert 0 < float(results[0]["cpu_util"]) < 100 * 64
