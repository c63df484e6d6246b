"""Writes that replace a file whole or leave everything as it was (fsutil.atomic_path)."""

from __future__ import annotations

import pytest

from streamnmt.fsutil import atomic_path, atomic_write


def test_a_failed_write_leaves_no_folder_it_made(tmp_path):
    # `average --out new/sub/avg.pt` whose write failed left new/sub/ behind
    target = tmp_path / "new" / "sub" / "avg.pt"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the write failed")
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []


def test_a_failed_write_keeps_the_file_and_the_folders_that_were_there(tmp_path):
    (tmp_path / "old").mkdir()
    target = tmp_path / "old" / "a.txt"
    atomic_write(target, "whole")
    (tmp_path / "old" / "other.txt").write_text("x")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert target.read_text() == "whole" and sorted(p.name for p in (tmp_path / "old").iterdir()) == ["a.txt",
                                                                                                       "other.txt"]
    atomic_write(tmp_path / "x" / "y" / "b.txt", "made")  # a write that succeeds keeps the folders it made
    assert (tmp_path / "x" / "y" / "b.txt").read_text() == "made"
