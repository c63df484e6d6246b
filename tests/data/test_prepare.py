"""prepare_data: the tokenized cache is reused, invalidated by what it depends on, never partial."""

from __future__ import annotations

import os
import json
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import streamnmt.data as data
from streamnmt.data import DataConfig, Tokenizer, prepare_data, read_pairs, train_tokenizer
from streamnmt.errors import InputError

from .conftest import make_pairs, small_config, write_corpus, write_split


def _quiet(_: str) -> None:
    pass


def _files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (hidden temporaries included) with its mtime."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


def _tokenized_splits(lines: list[str]) -> set[str]:
    return {line.split(":")[1].strip() for line in lines if " tokenized in " in line}


def test_corpus_matches_tokenizers_and_pairs(corpus_dir: Path) -> None:
    cfg = small_config(corpus_dir)
    bundle = prepare_data(cfg, log=_quiet)
    cap = cfg.max_len - 1
    for split, corpus in (("train", bundle.train), ("dev", bundle.dev), ("test", bundle.test)):
        pairs = read_pairs(cfg, split)
        assert len(corpus) == len(pairs) == bundle.stats[split]["pairs"]
        for i in range(0, len(corpus), 7):
            s, t = corpus[i]
            assert s.tolist() == bundle.src_tok.encode(pairs[i][0])[:cap]
            assert t.tolist() == bundle.tgt_tok.encode(pairs[i][1])[:cap]
        assert np.array_equal(corpus.src_lengths, [len(corpus[i][0]) for i in range(len(corpus))])
    assert bundle.data_dir == corpus_dir


def test_second_prepare_uses_the_cache(corpus_dir: Path, logs, monkeypatch) -> None:
    lines, log = logs
    first = prepare_data(small_config(corpus_dir), log=log)
    assert _tokenized_splits(lines) == {"train", "dev", "test"}
    before = _files(corpus_dir)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the cache is valid")

    monkeypatch.setattr(Tokenizer, "encode_batch", no_tokenizing)
    lines.clear()
    second = prepare_data(small_config(corpus_dir), log=log)
    assert _tokenized_splits(lines) == set()
    assert sum(" from cache " in line for line in lines) == 3
    assert _files(corpus_dir) == before  # nothing rewritten
    assert second.train.directory is not None  # memory-mapped from the cache
    for a, b in ((first.train, second.train), (first.dev, second.dev)):
        assert np.array_equal(a.src_tokens, b.src_tokens) and np.array_equal(a.tgt_offsets, b.tgt_offsets)
    assert second.stats == first.stats


def test_changed_source_file_invalidates_its_split(corpus_dir: Path, logs) -> None:
    lines, log = logs
    prepare_data(small_config(corpus_dir), log=log)
    old_entries = {p.name for p in (corpus_dir / "cache").iterdir()}
    pairs = make_pairs(300, 1)
    pairs[5] = ("A different sentence.", "不同的句子。")
    write_split(corpus_dir, "train", pairs, "json")
    lines.clear()
    bundle = prepare_data(small_config(corpus_dir), log=log)
    # the tokenizers follow the training split (as a fresh folder's would), then every split they tokenize
    assert sum("was trained on another version of the training split: trained again" in ln for ln in lines) == 2
    assert "train" in _tokenized_splits(lines)
    assert bundle.src_tok.decode(bundle.train[5][0].tolist()) == "A different sentence."
    new_entries = {p.name for p in (corpus_dir / "cache").iterdir()}
    assert old_entries < new_entries  # the old entries stay until trimmed by size


def test_a_training_split_touched_but_not_changed_keeps_its_models_and_cache(corpus_dir: Path, logs) -> None:
    lines, log = logs
    first = prepare_data(small_config(corpus_dir), log=log)
    train = corpus_dir / "train.json"
    os.utime(train, ns=(train.stat().st_atime_ns, train.stat().st_mtime_ns + 10**9))
    lines.clear()
    again = prepare_data(small_config(corpus_dir), log=log)
    assert not any("trained" in ln for ln in lines)  # the same bytes (the record's hash): found
    assert (again.src_tok.sha256, again.tgt_tok.sha256) == (first.src_tok.sha256, first.tgt_tok.sha256)
    assert _tokenized_splits(lines) == set()  # the same bytes: every split from the cache


def test_changed_tokenizer_invalidates_every_split(corpus_dir: Path, logs) -> None:
    lines, log = logs
    prepare_data(small_config(corpus_dir), log=log)
    other = train_tokenizer([s for s, _ in make_pairs(100, 9)], corpus_dir / "tokenizer" / "src.model", 50,
                            "en", log=_quiet)
    lines.clear()
    bundle = prepare_data(small_config(corpus_dir), log=log)
    assert _tokenized_splits(lines) == {"train", "dev", "test"}
    assert bundle.src_tok.sha256 == other.sha256
    assert bundle.src_tok.encode(read_pairs(small_config(corpus_dir), "dev")[0][0])[:23] == \
        bundle.dev[0][0].tolist()


def test_changed_max_len_or_overlong_invalidates(corpus_dir: Path, logs) -> None:
    lines, log = logs
    prepare_data(small_config(corpus_dir), log=log)
    lines.clear()
    prepare_data(small_config(corpus_dir, max_len=40), log=log)
    assert _tokenized_splits(lines) == {"train", "dev", "test"}
    lines.clear()
    prepare_data(small_config(corpus_dir, max_len=40, overlong="drop"), log=log)
    assert _tokenized_splits(lines) == {"train"}  # dev/test are always truncated


def test_truncate_and_drop_counts(corpus_dir: Path) -> None:
    assert DataConfig().overlong == "drop"  # the training default: a cut pair's halves no longer match
    cfg = small_config(corpus_dir)
    truncated = prepare_data(cfg, log=_quiet)
    pairs = read_pairs(cfg, "train")
    cap = cfg.max_len - 1
    over = [i for i, (s, t) in enumerate(pairs)
            if len(truncated.src_tok.encode(s)) > cap or len(truncated.tgt_tok.encode(t)) > cap]
    assert over, "the test corpus must have overlong pairs"
    assert truncated.stats["train"]["truncated"] == len(over)
    assert int(max(truncated.train.src_lengths.max(), truncated.train.tgt_lengths.max())) == cap

    dropped = prepare_data(small_config(corpus_dir, overlong="drop"), log=_quiet)
    assert dropped.stats["train"]["dropped"] == len(over)
    assert len(dropped.train) == len(pairs) - len(over)
    assert set(dropped.train.index.tolist()) == set(range(len(pairs))) - set(over)
    assert len(dropped.dev) == len(read_pairs(cfg, "dev"))  # eval splits keep every pair


def test_missing_test_split_is_optional(tmp_path: Path, logs) -> None:
    write_corpus(tmp_path)
    (tmp_path / "test.json").unlink()
    lines, log = logs
    bundle = prepare_data(small_config(tmp_path), log=log)
    assert bundle.test is None and "test" not in bundle.stats
    assert any("no test split" in line for line in lines)


@pytest.mark.parametrize("bad_split", ["train", "dev", "test"])
def test_bad_input_leaves_no_tokenizer_or_cache(tmp_path: Path, bad_split: str) -> None:
    write_corpus(tmp_path)
    path = tmp_path / f"{bad_split}.json"
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: len(text) * 2 // 3], encoding="utf-8")  # cut off mid-file
    before = _files(tmp_path)
    with pytest.raises(InputError, match=str(path)):
        prepare_data(small_config(tmp_path), log=_quiet)
    assert _files(tmp_path) == before


def test_failure_while_writing_the_cache_leaves_nothing(corpus_dir: Path, monkeypatch) -> None:
    calls = []
    real_save = np.save

    def failing_save(f, arr, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real_save(f, arr, *a, **kw)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(RuntimeError, match="disk on fire"):
        prepare_data(small_config(corpus_dir), log=_quiet)
    cache = corpus_dir / "cache"
    leftovers = [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert leftovers == []
    monkeypatch.setattr(np, "save", real_save)
    lines: list[str] = []
    prepare_data(small_config(corpus_dir), log=lines.append)  # a later run builds it cleanly
    assert _tokenized_splits(lines) == {"train", "dev", "test"}


def test_unwritable_cache_falls_back_to_memory(corpus_dir: Path, logs) -> None:
    (corpus_dir / "cache").write_text("a file where the cache directory should be")
    lines, log = logs
    bundle = prepare_data(small_config(corpus_dir), log=log)
    assert len(bundle.train) == 300 and bundle.train.directory is None
    assert sum("not cached" in line for line in lines) == 3


def test_memory_mapped_corpus_pickles_by_path(corpus_dir: Path) -> None:
    bundle = prepare_data(small_config(corpus_dir), log=_quiet)
    blob = pickle.dumps(bundle.train)
    assert len(blob) < 2000  # the directory, not the arrays
    copy = pickle.loads(blob)
    assert len(copy) == len(bundle.train) and np.array_equal(copy[17][1], bundle.train[17][1])


def test_builtin_corpus_directory(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def write_builtin(directory: Path, n_train: int, seed: int = 0) -> None:
        calls.append((directory, n_train, seed))
        directory.mkdir(parents=True, exist_ok=True)
        for seed, (split, n) in enumerate((("train", n_train), ("dev", 20), ("test", 20))):
            pairs = make_pairs(n, seed)
            (directory / f"{split}.json").write_text(
                json.dumps([{"en": s, "ch": t} for s, t in pairs], ensure_ascii=False), encoding="utf-8")

    fake = types.ModuleType("streamnmt.data.synthetic")
    fake.write_builtin, fake.SEED = write_builtin, 0
    monkeypatch.setitem(sys.modules, "streamnmt.data.synthetic", fake)
    monkeypatch.setattr(data, "synthetic", fake, raising=False)
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    cfg = DataConfig(builtin_size=150, src_vocab=100, tgt_vocab=100)
    bundle = prepare_data(cfg, log=_quiet)
    expected = tmp_path / "home" / "builtin-150"
    assert calls[0] == (expected, 150, 0)
    assert bundle.data_dir == expected and len(bundle.train) == 150
    assert (expected / "tokenizer" / "tgt.model").is_file() and (expected / "cache").is_dir()
    assert read_pairs(cfg, "dev") == json_pairs(expected / "dev.json")


def json_pairs(path: Path) -> list[tuple[str, str]]:
    return [(r["en"], r["ch"]) for r in json.loads(path.read_text(encoding="utf-8"))]


def test_prepared_only_reads_what_an_earlier_preparation_wrote(corpus_dir: Path, tmp_path: Path,
                                                               monkeypatch) -> None:
    """build=False writes nothing and says NotPrepared while a tokenizer, a tokenized split or the
    built-in corpus is missing; after a preparation it loads the same data (the other ranks of a
    host load it so beside local rank 0)."""
    from streamnmt.data.prepare import NotPrepared

    cfg = small_config(corpus_dir)
    before = _files(corpus_dir)
    with pytest.raises(NotPrepared):
        prepare_data(cfg, log=_quiet, build=False)
    assert _files(corpus_dir) == before  # nothing written
    built = prepare_data(cfg, log=_quiet)
    loaded = prepare_data(cfg, log=_quiet, build=False)
    assert loaded.fingerprint() == built.fingerprint()
    assert np.array_equal(loaded.train.tgt_lengths, built.train.tgt_lengths)
    other = small_config(corpus_dir, max_len=32)  # another tokenized cache key
    with pytest.raises(NotPrepared):
        prepare_data(other, log=_quiet, build=False)
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    with pytest.raises(NotPrepared):
        prepare_data(DataConfig(builtin_size=300), log=_quiet, build=False)
    assert not (tmp_path / "home").exists()


class _Ranks:
    """A stand-in process group of 2 on one host, seen from local rank 1."""

    active, rank, local_rank, world = True, 1, 1, 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def barrier(self, name: str) -> None:
        self.calls.append("barrier")

    def gather(self, obj, name: str, long_wait: bool = False):
        return [obj, obj]


def test_other_ranks_load_prepared_data_beside_local_rank_0() -> None:
    """prepare_once on a rank other than local rank 0: data already prepared is loaded before the
    barrier (no waiting for rank 0 to load it first); data not prepared yet is prepared after it."""
    from streamnmt.data.prepare import prepare_once
    from streamnmt.data.prepare import NotPrepared

    def fp(result: str) -> dict[str, str]:
        return {"src tokenizer sha256": result}

    ranks = _Ranks()
    assert prepare_once(ranks, lambda: ranks.calls.append("prepare") or "tok", fp,
                             lambda: ranks.calls.append("prepared") or "tok") == "tok"
    assert ranks.calls == ["prepared", "barrier"]

    def missing() -> str:
        ranks.calls.append("prepared")
        raise NotPrepared("train: not in the tokenized cache")

    ranks.calls.clear()
    assert prepare_once(ranks, lambda: ranks.calls.append("prepare") or "tok", fp, missing) == "tok"
    assert ranks.calls == ["prepared", "barrier", "prepare"]
