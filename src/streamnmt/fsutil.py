"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Everything streamnmt writes that a later run reads (checkpoints, caches, tokenizers, config) goes
through :func:`atomic_write` or :func:`atomic_path`: write to a temporary file in the same
directory, fsync, then ``os.replace`` over the target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
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

    On an exception the temporary file is removed and ``target`` is left as it was. A symbolic link
    is written through (the file it names is replaced, the link kept); a device or a pipe
    (``/dev/null``, ``/dev/stdout``, a FIFO) cannot be renamed over, so it receives the finished
    bytes by a plain write instead.
    """
    target = Path(target)
    if _is_stream(target):
        fd, tmp = tempfile.mkstemp(prefix=".streamnmt.", suffix=suffix + ".tmp")
        os.close(fd)
        try:
            yield Path(tmp)
            with open(tmp, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix + ".tmp", dir=target.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the usual permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
        _fsync_dir(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def _is_stream(path: Path) -> bool:
    """Whether ``path`` (through links) exists and is neither a regular file nor a folder."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


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
