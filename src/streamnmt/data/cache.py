"""The on-disk cache of tokenized splits under ``DIR/cache/``, shared by every job that uses DIR.

A cache entry is valid only for the exact bytes it was built from: its key hashes the source
file(s) content, both tokenizer models, ``max_len``, the overlong policy, the language keys and
:data:`CACHE_VERSION` (bumped when the layout changes). Each entry is a directory
``DIR/cache/{split}-{key[:16]}/`` holding one ``.npy`` per array, a ``meta.json`` naming its key
and a ``.lock`` file. An entry is written in a hidden directory and renamed into place whole, so no
process ever sees half of one; an entry without a matching ``meta.json`` is ignored and replaced.

Several jobs share one corpus directory (a sweep over ``--max-len``, a run beside a benchmark), so
entries are kept per key: a new entry evicts nothing of its split. The cache is trimmed by size
instead, to ``STREAMNMT_CACHE_MAX_GB`` (default 20) after each new entry, least recently used
first (a load marks its entry used by touching the entry directory's mtime), and never an entry a
process has open: a process holds a shared ``flock`` on the entry's ``.lock`` for as long as its
:class:`TokenizedCorpus` lives (or until it exits), and the evictor skips every entry on which a
non-blocking exclusive lock fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from streamnmt.data.corpus import ARRAYS, TokenizedCorpus
from streamnmt.data.readers import SplitSource
from streamnmt.data.tokenizer import Tokenizer, file_sha256
from streamnmt.errors import ConfigError
from streamnmt.fsutil import atomic_path, atomic_write

CACHE_VERSION = 1
MAX_GB_ENV = "STREAMNMT_CACHE_MAX_GB"
DEFAULT_MAX_GB = 20.0
LOCK = ".lock"
STALE_BUILD_S = 3600.0  # a build directory lives for the seconds of writing its arrays: older is a dead job's


def cache_key(source: SplitSource, src_tok: Tokenizer, tgt_tok: Tokenizer, *, max_len: int,
              overlong: str, src_lang: str, tgt_lang: str) -> dict[str, Any]:
    """The facts a cache entry depends on; its name is a hash of them."""
    return {
        "version": CACHE_VERSION,
        "split": source.split,
        "format": source.fmt,
        "sources": [file_sha256(p) for p in source.paths],
        "src_tokenizer": src_tok.sha256,
        "tgt_tokenizer": tgt_tok.sha256,
        "max_len": max_len,
        "overlong": overlong,
        "langs": [src_lang, tgt_lang],
    }


def key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def entry_dir(cache_dir: Path, key: dict[str, Any]) -> Path:
    return cache_dir / f"{key['split']}-{key_hash(key)[:16]}"


def max_bytes() -> float:
    """The cache's size limit from ``STREAMNMT_CACHE_MAX_GB`` (decimal gigabytes; 0 keeps only the
    entries in use)."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_GB * 1e9
    try:
        gb = float(raw)
    except ValueError:
        gb = float("nan")
    if not gb >= 0:  # nan too
        raise ConfigError(f"{MAX_GB_ENV}: must be a size in gigabytes, 0 or more; got {raw!r}")
    return gb * 1e9


def load_entry(cache_dir: Path, key: dict[str, Any]) -> tuple[TokenizedCorpus, dict[str, int]] | None:
    """The cached corpus and its build stats, or None when there is no valid entry. The corpus
    holds the entry's shared lock while it lives, so that no other job evicts it."""
    directory = entry_dir(cache_dir, key)
    try:
        hold = _hold(directory)
    except FileNotFoundError:
        return None
    read = _read(directory, key)
    if read is None:
        return None
    corpus, stats = read
    corpus.hold = hold
    with contextlib.suppress(OSError):  # used now: the last to go when the cache is trimmed
        os.utime(directory)
    return corpus, stats


def _read(directory: Path, key: dict[str, Any]) -> tuple[TokenizedCorpus, dict[str, int]] | None:
    """The entry in ``directory`` memory-mapped with its stats, or None where it is not whole: its
    ``meta.json`` names another key, or an array is missing, cut short (a full disk, a copy stopped
    half-way) or disagrees with the others (offsets that do not end at their tokens' count)."""
    try:
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        if meta.get("key") != key:
            return None
        corpus = TokenizedCorpus.load(directory, key["split"])
        pairs = meta["stats"]["pairs"]
        for tokens, offsets in ((corpus.src_tokens, corpus.src_offsets), (corpus.tgt_tokens, corpus.tgt_offsets)):
            if len(offsets) != pairs + 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
                return None
        if len(corpus) != pairs:
            return None
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # missing, half-written, foreign
        return None
    return corpus, meta["stats"]


def save_entry(cache_dir: Path, key: dict[str, Any], arrays: dict[str, np.ndarray], stats: dict[str, int],
               log: Callable[[str], None] | None = None) -> TokenizedCorpus:
    """Write an entry, then trim the cache to its size limit; return the entry memory-mapped.

    On any failure nothing of the entry is left behind. An OSError (e.g. the entry evicted before
    this process could open it) means: not cached, use the arrays in memory.
    """
    limit = max_bytes()  # a bad value stops the run before anything is written
    directory = entry_dir(cache_dir, key)
    build, hold = _write_build(cache_dir, directory.name, key, arrays, stats)
    try:
        _install(build, directory, key)
        hit = load_entry(cache_dir, key)
    finally:
        hold.close()
        shutil.rmtree(build, ignore_errors=True)  # nothing left once installed
    if hit is None:
        raise OSError(f"the new entry {directory.name} could not be opened")
    evicted = trim(cache_dir, limit)
    if evicted and log is not None:
        log(f"data: cache over {MAX_GB_ENV}={limit / 1e9:g}: removed {len(evicted)} least recently used "
            f"entr{'y' if len(evicted) == 1 else 'ies'} ({', '.join(p.name for p in evicted)})")
    return hit[0]


def trim(cache_dir: Path, limit: float) -> list[Path]:
    """Evict the least recently used entries until the cache holds at most ``limit`` bytes; an
    entry some process holds is skipped. Returns the evicted entries."""
    _remove_leftovers(cache_dir)
    entries = []
    for path in _entries(cache_dir):
        with contextlib.suppress(FileNotFoundError):  # another job evicted it meanwhile
            entries.append((path.stat().st_mtime, path, _size(path)))
    total = sum(size for _, _, size in entries)
    evicted = []
    for _, path, size in sorted(entries):
        if total <= limit:
            break
        if _evict(path):
            total -= size
            evicted.append(path)
    return evicted


def _hold(directory: Path) -> IO[bytes] | None:
    """The entry's lock file, open with a shared lock (released when the file is closed or
    garbage collected). None where the lock file cannot be made (a corpus directory this user
    cannot write): the entry is then read without protection. Raises FileNotFoundError when the
    entry does not exist, or was evicted while this process waited for the lock."""
    path = directory / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except FileNotFoundError:
        raise
    except OSError:  # no right to create it, a read-only file system
        return None
    f = os.fdopen(fd, "rb")
    fcntl.flock(f, fcntl.LOCK_SH)  # waits only while an evictor moves the entry away
    if not _names(f, path):
        f.close()
        raise FileNotFoundError(path)
    return f


def _names(f: IO[bytes], path: Path) -> bool:
    """Whether ``path`` is still the file ``f`` has open (an evicted entry's lock file is not)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(f.fileno())
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _write_build(cache_dir: Path, name: str, key: dict[str, Any], arrays: dict[str, np.ndarray],
                 stats: dict[str, int]) -> tuple[Path, IO[bytes]]:
    """The entry complete in a hidden directory, and its lock file held shared, so that the entry
    cannot be evicted between its rename into place and this process opening it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    build = cache_dir / f".build-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    build.mkdir()
    hold = None
    try:
        hold = _hold(build)
        if hold is None:
            raise OSError(f"cannot create {build / LOCK}")
        for array in ARRAYS:
            with atomic_path(build / f"{array}.npy") as tmp, open(tmp, "wb") as f:
                np.save(f, np.ascontiguousarray(arrays[array]))
        atomic_write(build / "meta.json", json.dumps({"key": key, "stats": stats}, indent=1))
    except BaseException:
        if hold is not None:
            hold.close()
        shutil.rmtree(build, ignore_errors=True)
        raise
    return build, hold


def _install(build: Path, directory: Path, key: dict[str, Any]) -> None:
    """Rename ``build`` to ``directory``. Where an entry is there already, a valid one (another job
    built the same key meanwhile) stays and ``build`` is dropped; an invalid one is replaced."""
    try:
        os.rename(build, directory)
        return
    except OSError:
        if not directory.is_dir():
            raise
    if _valid(directory, key) or not _evict(directory):
        return
    os.rename(build, directory)


def _valid(directory: Path, key: dict[str, Any]) -> bool:
    """The entry there is whole (:func:`_read`): a damaged one is replaced, not kept forever."""
    return _read(directory, key) is not None


def _evict(directory: Path) -> bool:
    """Remove an entry unless a process holds it; whether it was removed."""
    try:
        f = os.fdopen(os.open(directory / LOCK, os.O_RDONLY | os.O_CREAT, 0o666), "rb")
    except OSError:
        return False
    trash = directory.with_name(f".trash-{directory.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use
        if not _names(f, directory / LOCK):
            return False  # evicted (and maybe rebuilt) by another job since we opened it
        try:
            os.rename(directory, trash)  # gone for every new loader at once, then deleted at leisure
        except OSError:
            return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _entries(cache_dir: Path) -> list[Path]:
    try:
        return [p for p in cache_dir.iterdir() if not p.name.startswith(".") and p.is_dir()]
    except OSError:
        return []


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def _remove_leftovers(cache_dir: Path) -> None:
    """What killed jobs left: evicted entries not yet deleted, and builds that never finished."""
    now = time.time()
    for path in cache_dir.glob(".trash-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in cache_dir.glob(".build-*"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > STALE_BUILD_S and not _held(path / LOCK):
                shutil.rmtree(path, ignore_errors=True)


def _held(lock: Path) -> bool:
    """A process holds ``lock`` (a build still being written, however long it takes)."""
    try:
        f = os.fdopen(os.open(lock, os.O_RDONLY), "rb")
    except OSError:
        return False  # no lock file: nobody can hold it
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False  # closing the file releases the lock just taken
