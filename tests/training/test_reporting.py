"""The start lines' notes: a warm-up the run's step count never finishes."""

from __future__ import annotations

import pytest

from streamnmt.training.reporting import warmup_note
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("warmup, end, said", [
    (400, 506, None),       # the warm-up ends inside the run
    (400, 400, None),       # at its last step: the peak is reached
    (4000, None, None),     # a time limit or the plateau ends it: no step count to compare
    (4000, 988, "the warm-up (--warmup 4000 steps) is longer than the run (988 steps): the learning rate never "
                "reaches its peak (25 % of it at the end)"),
])
def test_warmup_note_names_a_warmup_longer_than_the_run(warmup, end, said):
    note = warmup_note(warmup, end)
    assert (note is None) if said is None else (note.startswith("warning: " + said) and "--warmup" in note)


def test_a_run_shorter_than_its_warmup_says_so_at_the_start(tmp_path):
    lines: list[str] = []
    make_trainer(tmp_path, "--name", "w", "--epochs", "1", "--max-steps", "3", "--warmup", "50", lines=lines)
    assert any(line.startswith("warning: the warm-up (--warmup 50 steps) is longer than the run (3 steps)")
               for line in lines), lines
    lines.clear()
    make_trainer(tmp_path, "--name", "w2", "--epochs", "1", "--max-steps", "3", "--warmup", "3", lines=lines)
    assert not any("warm-up" in line for line in lines), lines
