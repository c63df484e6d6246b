"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Everything streamnmt writes that a later run reads (checkpoints, caches, tokenizers, config) goes
through :func:`atomic_write` or :func:`atomic_path`: write to a temporary file in the same
directory, fsync, then ``os.replace`` over the target.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


_UMASK = os.umask(0)
os.umask(_UMASK)


def streamnmt_home() -> Path:
    """``$STREAMNMT_HOME`` (default ``~/.cache/streamnmt``): the built-in corpus, tokenizers taken
    from checkpoints and the compile cache live under it."""
    return Path(os.environ.get("STREAMNMT_HOME", "~/.cache/streamnmt")).expanduser()


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it replaces ``target``.

    On an exception the temporary file is removed and ``target`` is left as it was, and so are its
    missing parent folders (made for the write, removed again).
    """
    target = Path(target)
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # the deepest first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=target.parent)
        os.close(fd)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
        tmp_path = Path(tmp)
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        _fsync_dir(target.parent)
    except BaseException:
        if tmp_path is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()
        for folder in made:
            with contextlib.suppress(OSError):  # not empty (another writer's): kept
                folder.rmdir()
        raise


# /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N, /proc/PID/fd/N: a descriptor this process
# has open (a shell's redirection, perhaps of a file with >>): written through that descriptor, never
# reopened (which would truncate the file) nor renamed over (which would unlink it)
_OWN_FD = re.compile(r"^/dev/(?:(std)(in|out|err)|fd/(\d+))$|^/proc/(?:self|\d+)/fd/(\d+)$")


def write_output(target: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` where a user's output flag points: a regular file atomically
    (:func:`atomic_path`), through a symbolic link (the file it names replaced, the link kept), a
    descriptor this process holds (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``) by writing to it,
    and a device or a pipe (``/dev/null``, a FIFO) by a plain write, neither of which a rename can
    replace."""
    text = os.fspath(target)
    own = _OWN_FD.match(text)
    if own is not None:
        fd = {"in": 0, "out": 1, "err": 2}[own.group(2)] if own.group(1) else int(own.group(3) or own.group(4))
        if not text.startswith("/proc/") or text.startswith(("/proc/self/", f"/proc/{os.getpid()}/")):
            for stream in (sys.stdout, sys.stderr):  # what the process printed before comes first
                with contextlib.suppress(Exception):
                    stream.flush()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            return
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        with open(target, "wb") as f:
            f.write(data)
        return
    path = Path(os.path.realpath(target)) if Path(target).is_symlink() else Path(target)
    atomic_write(path, data)


def atomic_write(target: str | os.PathLike, data: bytes | str, encoding: str = "utf-8") -> None:
    """Write ``data`` to ``target`` atomically."""
    with atomic_path(target) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding=encoding)
        else:
            tmp.write_bytes(data)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
