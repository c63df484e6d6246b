"""translate's input as a stream of line chunks (inference/lines.py)."""

from __future__ import annotations

import codecs
import io
import os
import sys
import threading

import pytest

from streamnmt.errors import InputError
from streamnmt.inference.lines import read_chunks, read_lines


def _chunks(data: bytes, max_lines: int, monkeypatch) -> list[tuple[int, list[str]]]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    return [(c.first, c.lines) for c in read_chunks(None, max_lines=max_lines)]


def test_chunks_of_at_most_max_lines_numbered_over_the_whole_input(monkeypatch):
    data = "".join(f"line {i}\n" for i in range(7)).encode()
    assert _chunks(data, 3, monkeypatch) == [(0, ["line 0", "line 1", "line 2"]), (3, ["line 3", "line 4", "line 5"]),
                                             (6, ["line 6"])]


@pytest.mark.parametrize("data, lines", [
    (b"a\nb", ["a", "b"]),  # no final newline
    (b"a\nb\n", ["a", "b"]),  # a final newline ends the last line
    (b"a\n\n", ["a", ""]),
    (b"", []),
    (b"\n", [""]),
    (codecs.BOM_UTF8 + "ein\r\nzwei\r\n".encode(), ["ein", "zwei"]),
    (codecs.BOM_UTF8, []),
    ("猫\n".encode() * 3, ["猫"] * 3),
])
def test_lines_as_the_whole_file_reads_them(data, lines, monkeypatch, tmp_path):
    assert [line for _, chunk in _chunks(data, 2, monkeypatch) for line in chunk] == lines
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    assert read_lines(str(path)) == (str(path), lines)


def test_bad_utf8_names_its_line_and_offset_after_the_chunks_before_it(monkeypatch):
    data = codecs.BOM_UTF8 + b"one\ntwo\nthr\xffee\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    chunks = read_chunks(None, max_lines=1)
    assert next(chunks).lines == ["one"] and next(chunks).lines == ["two"]
    with pytest.raises(InputError, match=r"<stdin>:3: not UTF-8 text \(byte 0xff at byte offset 14\)"):
        next(chunks)


def test_a_pipe_gets_its_lines_before_the_input_ends():
    # a person typing, or a program waiting for each answer: the lines a pipe has delivered are a
    # chunk while the writer keeps the pipe open (the whole input was read before translating)
    r, w = os.pipe()
    stream = os.fdopen(r, "rb")
    got: list[list[str]] = []
    chunks = iter(read_chunks_of(stream))
    os.write(w, "the cat\nthe dog\n".encode())
    reader = threading.Thread(target=lambda: got.append(next(chunks).lines), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert got == [["the cat", "the dog"]], "the first lines waited for the end of the input"
    os.write(w, b"a bird")
    os.close(w)
    assert [c.lines for c in chunks] == [["a bird"]]
    stream.close()


def read_chunks_of(stream):
    from streamnmt.inference.lines import _chunks
    return _chunks("<pipe>", stream, 1024)


def test_a_missing_input_file_names_the_flag(tmp_path):
    with pytest.raises(InputError, match="--input: file not found"):
        list(read_chunks(str(tmp_path / "nope.txt")))


def test_a_long_line_reads_in_linear_time(tmp_path):
    # each read joined and split the whole pending line: quadratic in a line without a newline
    import time
    path = tmp_path / "one.txt"
    path.write_bytes(b"x" * (32 << 20) + b"\ny")
    t0 = time.perf_counter()
    chunks = list(read_chunks(str(path)))
    assert [len(line) for c in chunks for line in c.lines] == [32 << 20, 1]
    assert time.perf_counter() - t0 < 5.0
