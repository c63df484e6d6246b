"""The corpus's models follow the run's request: a model found on disk serves only the languages, size
and training split it was trained for (its record beside it), else it is trained again; a model without
a record is used as it is and never overwritten; jobs started at once on one corpus take turns."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from streamnmt.data import prepare_data
from streamnmt.data.tokenizer import train_tokenizer
from streamnmt.data.tokenizer_training import models_lock, record_path

from .conftest import make_pairs, small_config, write_corpus


def _quiet(_: str) -> None:
    pass


def _three_languages(directory: Path) -> None:
    """Records of three keys: en, ch and a German-like de (each English word reversed)."""
    directory.mkdir(parents=True)
    for split, (n, seed) in {"train": (300, 1), "dev": (40, 2), "test": (40, 3)}.items():
        rows = [{"en": en, "ch": ch, "de": " ".join(w[::-1] for w in en.split())} for en, ch in make_pairs(n, seed)]
        (directory / f"{split}.json").write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")


def test_another_target_language_trains_the_target_again_and_keeps_the_source(tmp_path: Path) -> None:
    _three_languages(tmp_path / "c")
    first = prepare_data(small_config(tmp_path / "c"), log=_quiet)
    lines: list[str] = []
    german = prepare_data(small_config(tmp_path / "c", tgt_lang="de"), log=lines.append)
    assert any("tgt.model was trained for ch, not de: trained again" in line for line in lines)
    assert german.src_tok.sha256 == first.src_tok.sha256 and german.tgt_tok.sha256 != first.tgt_tok.sha256
    # the German targets read back (up to --max-len): no unknown pieces from a Chinese model
    decoded = german.tgt_tok.decode(german.dev[0][1].tolist()).strip()
    assert len(decoded) > 20 and "\u2047" not in decoded
    assert json.loads((tmp_path / "c" / "dev.json").read_text(encoding="utf-8"))[0]["de"].startswith(decoded)
    assert json.loads(record_path(german.tgt_tok.path).read_text())["langs"] == ["de"]


def test_a_size_asked_that_the_model_was_not_trained_for_trains_it_again(corpus_dir: Path) -> None:
    first = prepare_data(small_config(corpus_dir), log=_quiet)
    lines: list[str] = []
    smaller = prepare_data(small_config(corpus_dir, src_vocab=60), log=lines.append)
    assert any("src.model was trained for 200 pieces asked, not 60 pieces asked: trained again" in line
               for line in lines)
    assert smaller.src_tok.vocab_size == 60 and first.src_tok.vocab_size > 60
    assert smaller.tgt_tok.sha256 == first.tgt_tok.sha256  # the target asked the same: found
    lines.clear()
    prepare_data(small_config(corpus_dir, src_vocab=60), log=lines.append)
    assert not any("trained" in line for line in lines)  # the same request again: found


def test_the_sizes_the_rule_chose_asked_by_number_find_its_models(corpus_dir: Path) -> None:
    # a run's config.yaml records the sizes the corpus rule chose: replaying it trained both models
    # again, and the next run without sizes trained them back
    rule = prepare_data(small_config(corpus_dir, src_vocab=None, tgt_vocab=None), log=_quiet)
    for sizes in ({"src_vocab": rule.src_tok.vocab_size, "tgt_vocab": rule.tgt_tok.vocab_size},
                  {"src_vocab": None, "tgt_vocab": None}):
        lines: list[str] = []
        again = prepare_data(small_config(corpus_dir, **sizes), log=lines.append)
        assert not any("trained" in line for line in lines), lines
        assert (again.src_tok.sha256, again.tgt_tok.sha256) == (rule.src_tok.sha256, rule.tgt_tok.sha256)
    lines = []
    prepare_data(small_config(corpus_dir, src_vocab=rule.src_tok.vocab_size - 7, tgt_vocab=None), log=lines.append)
    assert any("src.model was trained for the corpus rule's size" in line for line in lines)  # another number


def test_a_model_without_a_record_is_used_as_it_is_and_says_so(corpus_dir: Path) -> None:
    """An earlier version's model, or one put there by hand: never overwritten; where its size is not the
    one asked, one line says so and how to train one."""
    model = corpus_dir / "tokenizer" / "src.model"
    own = train_tokenizer([s for s, _ in make_pairs(100, 9)], model, 50, "en", log=_quiet)
    lines: list[str] = []
    bundle = prepare_data(small_config(corpus_dir), log=lines.append)  # asks 200 a side
    assert bundle.src_tok.sha256 == own.sha256 and model.read_bytes() == own.path.read_bytes()
    assert not record_path(model).exists() and record_path(corpus_dir / "tokenizer" / "tgt.model").is_file()
    assert any(f"{model} has 50 pieces, not the 200 asked, and no record of what it was trained for" in line
               for line in lines)


def test_a_job_started_while_another_trains_the_models_waits_and_finds_them(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c")
    done: list[object] = []
    lines: list[str] = []
    with models_lock(tmp_path / "c"):  # as a job training the models now
        worker = threading.Thread(target=lambda: done.append(prepare_data(small_config(tmp_path / "c"), log=lines.append)))
        worker.start()
        time.sleep(0.5)
        assert not done and not (tmp_path / "c" / "tokenizer").exists()  # it waits for its turn
    worker.join(60)
    assert done and any(line.startswith("data: trained source tokenizer") for line in lines)


def test_a_model_whose_training_was_cut_short_is_trained_again(corpus_dir: Path) -> None:
    """The record says pending from before the training until its model is written: a run killed in
    between leaves a model (old, or new without its record) that the next run trains again."""
    first = prepare_data(small_config(corpus_dir), log=_quiet)
    record = record_path(first.src_tok.path)
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "pending": True, "sha256": None}))
    lines: list[str] = []
    again = prepare_data(small_config(corpus_dir), log=lines.append)
    assert any("src.model was left by a training cut short: trained again" in line for line in lines)
    assert again.src_tok.sha256 == first.src_tok.sha256  # the same request: the same bytes
    assert "pending" not in json.loads(record.read_text())


def test_a_copied_corpus_of_the_same_bytes_keeps_its_models(corpus_dir: Path, tmp_path: Path) -> None:
    import shutil

    first = prepare_data(small_config(corpus_dir), log=_quiet)
    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy, copy_function=shutil.copy)  # new modification times
    assert (copy / "train.json").stat().st_mtime_ns != (corpus_dir / "train.json").stat().st_mtime_ns
    lines: list[str] = []
    bundle = prepare_data(small_config(copy), log=lines.append)
    assert not any("trained" in line for line in lines) and bundle.src_tok.sha256 == first.src_tok.sha256
    mtime = (copy / "train.json").stat().st_mtime_ns  # the record now says the copy's times: not hashed again
    assert json.loads(record_path(copy / "tokenizer" / "src.model").read_text())["train"][0][2] == mtime
    (copy / "train.json").write_text((copy / "train.json").read_text().replace("a", "b", 1))  # one letter
    lines.clear()
    prepare_data(small_config(copy), log=lines.append)
    assert any("was trained on another version of the training split: trained again" in line for line in lines)


def test_a_folder_that_cannot_be_locked_is_prepared_unlocked(corpus_dir: Path, monkeypatch) -> None:
    """NFS emulates flock with locks that need a file open for writing: the lock fails, the run goes on."""
    from streamnmt.data import tokenizer_training

    def refuse(fd, op):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(tokenizer_training.fcntl, "flock", refuse)
    assert prepare_data(small_config(corpus_dir), log=_quiet).train_pairs > 0


def test_a_training_that_fails_leaves_the_records_of_the_models_on_disk(corpus_dir: Path, monkeypatch) -> None:
    """Not a kill: the error stops the run, and the next run finds the models it had (no 'cut short')."""
    import pytest

    from streamnmt.data import tokenizer_training

    prepare_data(small_config(corpus_dir), log=_quiet)
    records = {p: p.read_text() for p in (corpus_dir / "tokenizer").glob("*.json")}

    def fails(*args, **kwargs):
        raise RuntimeError("SentencePiece refused")

    monkeypatch.setattr(tokenizer_training, "train_tokenizer", fails)
    with pytest.raises(RuntimeError, match="refused"):
        prepare_data(small_config(corpus_dir, src_vocab=60), log=_quiet)
    assert {p: p.read_text() for p in records} == records
    monkeypatch.undo()
    lines: list[str] = []
    prepare_data(small_config(corpus_dir), log=lines.append)
    assert not any("trained" in line for line in lines)


def test_a_side_trained_beside_one_that_fails_leaves_no_model(corpus_dir: Path, monkeypatch) -> None:
    """The two sides train at once: the target's model written while the source's training fails is
    removed (a model without a record would be used as it is by every later run, on any corpus)."""
    import pytest

    from streamnmt.data import tokenizer_training

    real = tokenizer_training.train_tokenizer

    def source_fails(texts, path, *args, **kwargs):
        if kwargs.get("name", "").startswith("source"):
            time.sleep(0.5)  # the target's model is written first
            raise RuntimeError("SentencePiece refused the source")
        return real(texts, path, *args, **kwargs)

    monkeypatch.setattr(tokenizer_training, "train_tokenizer", source_fails)
    with pytest.raises(RuntimeError, match="refused the source"):
        prepare_data(small_config(corpus_dir), log=_quiet)
    assert sorted(p.name for p in (corpus_dir / "tokenizer").iterdir()) == []
    monkeypatch.undo()
    lines: list[str] = []
    prepare_data(small_config(corpus_dir), log=lines.append)
    assert any("trained source tokenizer and target tokenizer" in line for line in lines), lines


def test_a_source_sized_by_the_target_is_trained_again_when_a_size_is_given(tmp_path: Path) -> None:
    """Where neither size is given the source's follows the target's pieces; --tgt-vocab gives the
    target its own and the source its rule's size, as a fresh folder's would be."""
    write_corpus(tmp_path / "c")
    auto = small_config(tmp_path / "c", src_vocab=None, tgt_vocab=None)
    prepare_data(auto, log=_quiet)
    assert "target" in json.loads(record_path(tmp_path / "c" / "tokenizer" / "src.model").read_text())
    lines: list[str] = []
    prepare_data(small_config(tmp_path / "c", src_vocab=None, tgt_vocab=150), log=lines.append)
    assert any("src.model was trained at a size that followed the target's pieces" in line for line in lines)
    lines.clear()
    prepare_data(small_config(tmp_path / "c", src_vocab=None, tgt_vocab=150), log=lines.append)
    assert not any("trained" in line for line in lines)
