"""An incremental parser for a file holding one JSON array, yielding its elements one by one.

``json.load`` would hold the whole file as one string plus every record as a dict: twice the
corpus in Python objects. This parser decodes the file in chunks (strict UTF-8, a bad byte reported
by its offset) and calls :meth:`json.JSONDecoder.raw_decode` on each element, keeping only the
unparsed tail in memory and counting lines and columns so that errors point into the file.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from streamnmt.errors import InputError

CHUNK = 1 << 20
# An element still failing to parse with this much text after its start is malformed, not cut
# by a chunk boundary (records are sentence pairs: far smaller).
MAX_ELEMENT = 16 << 20
_WS = " \t\n\r"


class _Text:
    """A sliding window over the decoded file that knows the line and column of its first char."""

    def __init__(self, path: Path, chunk: int) -> None:
        self.path = path
        self.chunk = chunk
        self.buf = ""
        self.line0, self.col0 = 1, 1  # position of buf[0] in the file (1-based)
        self.eof = False
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._dec = codecs.getincrementaldecoder("utf-8")()
        self._offset = 0  # bytes read so far
        self._first = True
        self._cur_pos, self._cur_line = 0, 1  # a line-count cursor, so counting stays linear

    def close(self) -> None:
        self._f.close()

    def refill(self, pos: int) -> int:
        """Drop ``buf[:pos]`` and append the next chunk; return the new position of ``pos``."""
        self._drop(pos)
        if self.eof:
            return 0
        data = self._f.read(self.chunk)
        pending = len(self._dec.getstate()[0])  # bytes of a split character held from before
        try:
            text = self._dec.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise InputError(f"{self.path}: invalid UTF-8 at byte offset "
                             f"{self._offset - pending + e.start}") from None
        self._offset += len(data)
        if not data:
            self.eof = True
        if self._first and text:
            self._first = False
            text = text.removeprefix("\ufeff")
        self.buf += text
        return 0

    def _drop(self, pos: int) -> None:
        if pos <= 0:
            return
        n = self.buf.count("\n", 0, pos)
        if n:
            self.line0 += n
            self.col0 = pos - self.buf.rfind("\n", 0, pos)
        else:
            self.col0 += pos
        self.buf = self.buf[pos:]
        if self._cur_pos >= pos:
            self._cur_pos -= pos
        else:
            self._cur_pos, self._cur_line = 0, self.line0

    def where(self, pos: int) -> str:
        n = self.buf.count("\n", 0, pos)
        col = pos - self.buf.rfind("\n", 0, pos) if n else self.col0 + pos
        return f"{self.path}:{self.line0 + n}:{col}"

    def line_of(self, pos: int) -> int:
        if pos < self._cur_pos:
            self._cur_pos, self._cur_line = 0, self.line0
        self._cur_line += self.buf.count("\n", self._cur_pos, pos)
        self._cur_pos = pos
        return self._cur_line

    def skip_ws(self, pos: int) -> int:
        """Position of the next non-whitespace char (refilling as needed); len(buf) at EOF."""
        while True:
            while pos < len(self.buf) and self.buf[pos] in _WS:
                pos += 1
            if pos < len(self.buf) or self.eof:
                return pos
            pos = self.refill(pos)


def iter_json_array(path: Path, chunk: int = CHUNK, decoder: json.JSONDecoder | None = None
                    ) -> Iterator[tuple[int, int, Any]]:
    """Yield ``(index, line, element)`` for each element of the JSON array in ``path`` (decoded by
    ``decoder``, default a plain :class:`json.JSONDecoder`)."""
    try:
        text = _Text(path, chunk)
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror}") from None
    try:
        yield from _parse(text, decoder or json.JSONDecoder())
    finally:
        text.close()


def _parse(t: _Text, decoder: json.JSONDecoder) -> Iterator[tuple[int, int, Any]]:
    pos = t.skip_ws(0)
    if pos >= len(t.buf):
        raise InputError(f"{t.path}: empty file (expected a JSON array of records)")
    if t.buf[pos] != "[":
        raise InputError(f"{t.where(pos)}: malformed JSON: expected '[' (a JSON array of records)")
    pos = t.skip_ws(pos + 1)
    index = 0
    if pos < len(t.buf) and t.buf[pos] == "]":
        _expect_end(t, pos + 1)
        return
    while True:
        if pos >= len(t.buf):
            raise InputError(f"{t.where(pos)}: malformed JSON: unexpected end of file inside the array")
        obj, start, pos = _decode_one(t, decoder, pos)
        yield index, t.line_of(start), obj
        index += 1
        pos = t.skip_ws(pos)
        if pos >= len(t.buf):
            raise InputError(f"{t.where(pos)}: malformed JSON: unexpected end of file, expected ',' or ']'")
        ch = t.buf[pos]
        if ch == "]":
            _expect_end(t, pos + 1)
            return
        if ch != ",":
            raise InputError(f"{t.where(pos)}: malformed JSON: expected ',' or ']' after record {index - 1}")
        pos = t.skip_ws(pos + 1)


def _decode_one(t: _Text, decoder: json.JSONDecoder, pos: int) -> tuple[Any, int, int]:
    """Decode the element at ``pos``, reading more text while it may be cut off.

    Returns the element and its (possibly moved, by a refill) start and end positions.
    """
    while True:
        try:
            obj, end = decoder.raw_decode(t.buf, pos)
        except json.JSONDecodeError as e:
            if not t.eof and len(t.buf) - pos < MAX_ELEMENT:
                pos = t.refill(pos)
                continue
            raise InputError(f"{t.where(e.pos)}: malformed JSON: {e.msg}") from None
        if end == len(t.buf) and not t.eof:
            # A number or literal at the very end of the window may continue in the next chunk.
            pos = t.refill(pos)
            continue
        return obj, pos, end


def _expect_end(t: _Text, pos: int) -> None:
    pos = t.skip_ws(pos)
    if pos < len(t.buf):
        raise InputError(f"{t.where(pos)}: malformed JSON: extra data after the array")
