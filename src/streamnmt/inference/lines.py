"""The ``translate`` command's input, read as a stream of line chunks.

A chunk ends at ``max_lines`` lines, at the end of the input, or where the input has no more bytes
ready (a pipe that has delivered what it has, a person typing at a terminal): so a file or a fast
pipe is decoded in large batches, while an interactive session gets each line's translation as
soon as it is typed (as fairseq-interactive and Marian do), and no input is held in memory whole.
Lines are UTF-8; a byte-order mark at the start is skipped, ``\\r\\n`` read as ``\\n``, and a final
newline ends the last line (it does not start another).
"""

from __future__ import annotations

import codecs
import io
import select
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from streamnmt.errors import InputError

READ_BYTES = 1 << 16  # above BufferedReader's buffer (8 KiB): one read empties it, so select sees the rest


@dataclass
class Chunk:
    first: int  # the index of its first line in the whole input (0-based)
    lines: list[str]


def open_input(path: str | None) -> tuple[str, BinaryIO, bool]:
    """(name for messages, binary stream, whether to close it) of a file, or stdin for None / '-'."""
    if path in (None, "-"):
        return "<stdin>", getattr(sys.stdin, "buffer", sys.stdin), False
    try:
        return path, open(path, "rb"), True
    except FileNotFoundError:
        raise InputError(f"--input: file not found: {path}") from None
    except OSError as e:
        raise InputError(f"--input: cannot read {path}: {e.strerror}") from None


def _more_ready(stream: BinaryIO) -> bool:
    """Whether the stream has bytes to read without waiting; a stream without a descriptor (an
    in-memory one) always has, or says it ended."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # a descriptor select cannot watch (a Windows file): read on
        return True


def read_chunks(path: str | None, max_lines: int = 1024) -> Iterator[Chunk]:
    """The input's lines in chunks (see the module's doc). A line that is not UTF-8 raises
    InputError naming the input, the line and the byte offset when it is reached (the chunks before
    it have been yielded)."""
    name, stream, close = open_input(path)
    try:
        yield from _chunks(name, stream, max_lines)
    except OSError as e:
        raise InputError(f"{name}: cannot read: {e.strerror}") from None
    finally:
        if close:
            stream.close()


def _chunks(name: str, stream: BinaryIO, max_lines: int) -> Iterator[Chunk]:
    read = getattr(stream, "read1", stream.read)
    # pending: the bytes after the last newline (a bytearray: a long line grows in amortised linear
    # time, and is split only once a read brings its newline); consumed: the input's bytes before it
    pending, consumed, emitted, ready = bytearray(), 0, 0, []
    started = False
    while True:
        data = read(READ_BYTES)
        eof = not data
        pending += data
        if not started and (eof or not codecs.BOM_UTF8.startswith(pending[:len(codecs.BOM_UTF8)])
                            or len(pending) >= len(codecs.BOM_UTF8)):
            started = True
            if pending.startswith(codecs.BOM_UTF8):
                del pending[:len(codecs.BOM_UTF8)]
                consumed = len(codecs.BOM_UTF8)
        if not started or (not eof and b"\n" not in data):
            continue  # no line ended in this read
        parts = bytes(pending).split(b"\n")
        pending = bytearray() if eof else bytearray(parts.pop())
        if eof and parts and parts[-1] == b"":
            parts.pop()  # the final newline ends the last line
        error = None
        for part in parts:
            try:
                ready.append(_decode(part, name, emitted + len(ready) + 1, consumed))
            except InputError as e:  # raised once the lines before it are out
                error = e
                break
            consumed += len(part) + 1
        while len(ready) >= max_lines or (ready and (eof or error or not _more_ready(stream))):
            n = min(max_lines, len(ready))
            yield Chunk(emitted, ready[:n])
            emitted, ready = emitted + n, ready[n:]
        if error:
            raise error
        if eof:
            return


def _decode(part: bytes, name: str, line: int, offset: int) -> str:
    try:
        return part.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError as e:
        at = offset + e.start
        raise InputError(f"{name}:{line}: not UTF-8 text (byte 0x{part[e.start]:02x} at byte offset {at})") from None


def read_lines(path: str | None) -> tuple[str, list[str]]:
    """(name for messages, lines) of a UTF-8 file or stdin, whole."""
    name = "<stdin>" if path in (None, "-") else path
    return name, [line for chunk in read_chunks(path, max_lines=1 << 30) for line in chunk.lines]
