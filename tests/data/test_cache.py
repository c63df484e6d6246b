"""The tokenized cache shared by jobs: entries kept per key, evicted by size (least recently used
first), never while a process holds one; concurrent preparations of one corpus directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from streamnmt.data import Tokenizer, prepare_data
from streamnmt.data.cache import CACHE_VERSION, entry_dir, load_entry, save_entry

from .conftest import small_config


def _quiet(_: str) -> None:
    pass


def _arrays(pairs: int = 100, length: int = 5) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A valid entry's arrays: ``pairs`` pairs of ``length`` tokens a side."""
    offsets = np.arange(0, pairs * length + 1, length, dtype=np.int64)
    tokens = np.ones(pairs * length, np.uint16)
    arrays = {"src_tokens": tokens, "src_offsets": offsets, "tgt_tokens": tokens, "tgt_offsets": offsets,
              "index": np.arange(pairs, dtype=np.int64)}
    return arrays, {"read": pairs, "empty_skipped": 0, "truncated": 0, "dropped": 0, "pairs": pairs}


def _key(max_len: int) -> dict:
    return {"version": CACHE_VERSION, "split": "train", "max_len": max_len}


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))


def test_entries_of_one_split_with_different_keys_are_all_kept(corpus_dir: Path, monkeypatch) -> None:
    prepare_data(small_config(corpus_dir, max_len=24), log=_quiet)
    prepare_data(small_config(corpus_dir, max_len=40), log=_quiet)
    entries = _entries(corpus_dir / "cache")
    assert len(entries) == 6 and sum(e.startswith("train-") for e in entries) == 2

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although a cache entry for this --max-len exists")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_tokenizing)
    for max_len in (24, 40):  # both still served from the cache
        assert prepare_data(small_config(corpus_dir, max_len=max_len), log=_quiet).train.directory is not None


def test_over_the_size_limit_the_least_recently_used_unheld_entry_goes(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    arrays, stats = _arrays()
    save_entry(cache, _key(1), arrays, stats)  # not kept: nobody holds it
    held = save_entry(cache, _key(2), arrays, stats)  # this process keeps it open: locked
    save_entry(cache, _key(3), arrays, stats)
    for i in (1, 2, 3):  # used long ago, 1 first; then 1 is loaded again: 3 is now the least recently used
        os.utime(entry_dir(cache, _key(i)), (i * 1000, i * 1000))
    assert load_entry(cache, _key(1)) is not None
    size = _size(entry_dir(cache, _key(1)))
    monkeypatch.setenv("STREAMNMT_CACHE_MAX_GB", str(3.5 * size / 1e9))  # room for 3 entries of 4
    save_entry(cache, _key(4), arrays, stats)
    assert not entry_dir(cache, _key(3)).exists()
    for i in (1, 2, 4):
        assert load_entry(cache, _key(i)) is not None, i
    assert len(held) == 100 and held[0][0].tolist() == [1] * 5  # its arrays are still there to read

    monkeypatch.setenv("STREAMNMT_CACHE_MAX_GB", "0")  # everything over the limit: only the held ones stay
    kept = save_entry(cache, _key(5), arrays, stats)
    assert _entries(cache) == sorted(entry_dir(cache, _key(i)).name for i in (2, 5))
    assert len(kept) == 100


def test_a_second_build_of_one_key_keeps_a_valid_entry_and_replaces_an_invalid_one(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    arrays, stats = _arrays()
    first = save_entry(cache, _key(1), arrays, stats)
    lock = entry_dir(cache, _key(1)) / ".lock"
    inode = lock.stat().st_ino
    second = save_entry(cache, _key(1), arrays, stats)  # as a job that lost the race to build it
    assert lock.stat().st_ino == inode and len(second) == len(first)  # the first entry stays
    assert sorted(p.name for p in cache.iterdir()) == [entry_dir(cache, _key(1)).name]  # no build left
    del first, second
    (entry_dir(cache, _key(1)) / "meta.json").unlink()  # as a build an older version left half done
    assert load_entry(cache, _key(1)) is None
    assert len(save_entry(cache, _key(1), arrays, stats)) == 100
    assert lock.stat().st_ino != inode and load_entry(cache, _key(1)) is not None


@pytest.mark.parametrize("damage", ["cut", "zeroed offsets"])
def test_a_damaged_entry_is_not_read_and_the_next_build_replaces_it(tmp_path: Path, damage: str) -> None:
    """An array cut short (a full disk, a copy stopped half-way) or offsets that no longer end at their
    tokens' count: not read, and replaced by the next build rather than kept beside it forever."""
    cache = tmp_path / "cache"
    arrays, stats = _arrays()
    save_entry(cache, _key(1), arrays, stats)
    path = entry_dir(cache, _key(1)) / ("tgt_tokens.npy" if damage == "cut" else "tgt_offsets.npy")
    if damage == "cut":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # the same size, its values gone
        np.save(path, np.zeros(len(arrays["tgt_offsets"]), np.int64))
    assert load_entry(cache, _key(1)) is None
    assert len(save_entry(cache, _key(1), arrays, stats)) == 100
    hit = load_entry(cache, _key(1))
    assert hit is not None and hit[0][99][1].tolist() == [1] * 5


def test_a_bad_size_limit_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch) -> None:
    from streamnmt.errors import ConfigError

    monkeypatch.setenv("STREAMNMT_CACHE_MAX_GB", "lots")
    arrays, stats = _arrays()
    with pytest.raises(ConfigError, match="STREAMNMT_CACHE_MAX_GB"):
        save_entry(tmp_path / "cache", _key(1), arrays, stats)


PREPARE = """
import sys
from streamnmt.data import DataConfig, prepare_data
cfg = DataConfig(data=sys.argv[1], max_len=int(sys.argv[2]), src_vocab=200, tgt_vocab=200, batch_size=8,
                 overlong="truncate")
bundle = prepare_data(cfg, log=lambda _: None)
assert bundle.train.directory is not None, "not cached"
"""


def test_concurrent_jobs_with_different_max_len_keep_each_others_entries(corpus_dir: Path, monkeypatch) -> None:
    """A --max-len sweep on one corpus directory: two processes prepare it at once (the tokenizers
    exist, as after a first run); both finish and every entry of every job is still there."""
    prepare_data(small_config(corpus_dir, max_len=24), log=_quiet)
    jobs = [subprocess.Popen([sys.executable, "-c", PREPARE, str(corpus_dir), str(n)], stderr=subprocess.PIPE,
                             text=True) for n in (32, 40)]
    for job in jobs:
        _, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-2000:]
    assert len(_entries(corpus_dir / "cache")) == 9  # 3 splits x 3 lengths

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although a cache entry for this --max-len exists")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_tokenizing)
    for max_len in (24, 32, 40):
        prepare_data(small_config(corpus_dir, max_len=max_len), log=_quiet)


def test_a_slow_build_that_its_job_still_holds_is_not_taken_for_a_dead_one(tmp_path: Path) -> None:
    """Leftover builds older than STALE_BUILD_S are removed unless their job still holds the lock."""
    import fcntl
    import time

    from streamnmt.data import cache

    held, dead = tmp_path / ".build-train-1-aaaa", tmp_path / ".build-train-2-bbbb"
    for build in (held, dead):
        build.mkdir()
        (build / cache.LOCK).touch()
        (build / "src_tokens.npy").write_bytes(b"half")
        old = time.time() - cache.STALE_BUILD_S - 60
        os.utime(build, (old, old))
    with open(held / cache.LOCK, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # as the writing job holds it
        cache._remove_leftovers(tmp_path)
        assert held.exists() and not dead.exists()
    cache._remove_leftovers(tmp_path)
    assert not held.exists()
