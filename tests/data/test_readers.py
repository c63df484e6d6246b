"""Readers: every layout gives the same pairs; every kind of bad input gives one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamnmt.data import prepare_data, read_pairs
from streamnmt.data.jsonstream import iter_json_array
from streamnmt.errors import InputError

from .conftest import make_pairs, small_config, write_corpus, write_split

FORMATS = ["json", "jsonl", "tsv", "text:en:zh", "text:en:ch"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_the_same_pairs(tmp_path: Path, fmt: str) -> None:
    written = write_corpus(tmp_path, fmt)
    cfg = small_config(tmp_path)
    for split in ("train", "dev", "test"):
        assert read_pairs(cfg, split) == written[split]


def test_json_layout_under_json_subdirectory(tmp_path: Path) -> None:
    written = write_corpus(tmp_path / "json", "json")
    assert read_pairs(small_config(tmp_path), "dev") == written["dev"]


def test_language_keys_and_extensions_are_configurable(tmp_path: Path) -> None:
    pairs = make_pairs(30)
    write_split(tmp_path / "a", "train", pairs, "json", "de", "fr")
    write_split(tmp_path / "b", "train", pairs, "text:de:fr")
    for sub in ("a", "b"):
        cfg = small_config(tmp_path / sub, src_lang="de", tgt_lang="fr")
        assert read_pairs(cfg, "train") == pairs


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
@pytest.mark.parametrize("asked, written", [("ch", "zh"), ("zh", "ch")])
def test_chinese_records_read_under_either_key(tmp_path: Path, fmt: str, asked: str, written: str) -> None:
    # the default --tgt-lang ch (the original trainer's) found train.zh but not records keyed "zh"
    pairs = make_pairs(30)
    write_split(tmp_path, "train", pairs, fmt, "en", written)
    assert read_pairs(small_config(tmp_path, tgt_lang=asked), "train") == pairs


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_json_array_parser_across_chunk_boundaries(tmp_path: Path, chunk: int) -> None:
    records = [{"en": f"héllo {i}", "ch": "你好" * (i % 5), "x": [i, 1.5, None, True]} for i in range(60)]
    text = json.dumps(records, ensure_ascii=False, indent=2)
    path = tmp_path / "a.json"
    path.write_text("\ufeff" + text, encoding="utf-8")
    got = list(iter_json_array(path, chunk))
    assert [obj for _, _, obj in got] == records
    assert [i for i, _, _ in got] == list(range(60))
    starts = [n for n, line in enumerate(text.split("\n"), 1) if line == "  {"]
    assert [line for _, line, _ in got] == starts


def test_empty_sentences_are_skipped_and_counted(tmp_path: Path) -> None:
    pairs = make_pairs(50)
    records = [{"en": s, "ch": t} for s, t in pairs]
    blanks = {3: ("", "x"), 10: ("   ", "y"), 20: ("z", None), 30: ("w", " \t")}
    for k, (s, t) in blanks.items():
        records[k] = {"en": s, "ch": t}
    for split in ("train", "dev"):
        (tmp_path / f"{split}.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    cfg = small_config(tmp_path)
    expected = [p for k, p in enumerate(pairs) if k not in blanks]
    assert read_pairs(cfg, "train") == expected
    bundle = prepare_data(cfg, log=lambda _: None)
    assert bundle.stats["train"]["empty_skipped"] == len(blanks)
    assert bundle.stats["train"]["read"] == len(records)
    assert len(bundle.train) == len(expected)


# ---- bad input --------------------------------------------------------------------------------

def _error(cfg, split: str = "train") -> str:
    with pytest.raises(InputError) as info:
        read_pairs(cfg, split)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_directory(tmp_path: Path) -> None:
    assert str(tmp_path / "nope") in _error(small_config(tmp_path / "nope"))


@pytest.mark.parametrize("split", ["train", "dev"])
def test_missing_split(tmp_path: Path, split: str) -> None:
    write_corpus(tmp_path)
    (tmp_path / f"{split}.json").unlink()
    message = _error(small_config(tmp_path), split)
    assert f"no {split} split" in message and str(tmp_path) in message
    if split == "dev":  # prepare_data needs dev too
        with pytest.raises(InputError, match="no dev split"):
            prepare_data(small_config(tmp_path), log=lambda _: None)


def test_text_pair_with_one_half_missing(tmp_path: Path) -> None:
    write_split(tmp_path, "train", make_pairs(5), "text:en:zh")
    (tmp_path / "train.zh").unlink()
    message = _error(small_config(tmp_path))
    assert "train.en" in message and "train.zh" in message


def test_one_half_found_names_the_splits_other_files(tmp_path: Path) -> None:
    write_split(tmp_path, "train", make_pairs(5), "text:en:de")  # an en-de folder run without --tgt-lang
    message = _error(small_config(tmp_path))
    assert "train.ch or train.zh" in message and "other files here: train.de" in message and "--tgt-lang" in message


def test_fairseqs_valid_split_is_the_dev_split(tmp_path: Path) -> None:
    pairs = make_pairs(8)
    write_split(tmp_path, "valid", pairs, "text:en:zh")
    assert read_pairs(small_config(tmp_path), "dev") == pairs


def test_a_split_in_two_formats_is_an_error_naming_both(tmp_path: Path) -> None:
    write_split(tmp_path, "train", make_pairs(5), "json")
    write_split(tmp_path, "train", make_pairs(6, 2), "text:en:ch")
    message = _error(small_config(tmp_path))
    assert "the train split is there twice" in message and "train.json" in message and "train.en" in message
    write_split(tmp_path, "dev", make_pairs(5), "json")
    write_split(tmp_path, "valid", make_pairs(5), "json")
    assert "the dev split is there twice" in _error(small_config(tmp_path), "dev")


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_a_key_given_twice_names_the_record(tmp_path: Path, fmt: str) -> None:
    rows = ['{"en": "a", "ch": "b"}', '{"en": "hello", "ch": "x", "ch": ""}']
    text = "[" + ", ".join(rows) + "]" if fmt == "json" else "\n".join(rows) + "\n"
    (tmp_path / f"train.{fmt}").write_text(text)
    message = _error(small_config(tmp_path))
    assert "key 'ch' given twice" in message and ("record 1" in message or ":2" in message)
    (tmp_path / f"train.{fmt}").write_text(text.replace('"ch": ""', '"note": 1, "note": 2'))
    assert read_pairs(small_config(tmp_path), "train") == [("a", "b"), ("hello", "x")]  # other keys: no matter


def test_a_lone_surrogate_names_the_record(tmp_path: Path) -> None:
    (tmp_path / "train.json").write_text('[{"en": "a", "ch": "b"}, {"en": "bad \\ud800 x", "ch": "c"}]')
    message = _error(small_config(tmp_path))
    assert "record 1" in message and "'en' is not valid Unicode" in message


@pytest.mark.parametrize("chunk_kb", [None, 1])
def test_malformed_json_names_line_and_column(tmp_path: Path, monkeypatch, chunk_kb) -> None:
    if chunk_kb:
        monkeypatch.setattr("streamnmt.data.jsonstream.CHUNK", chunk_kb * 1024)
    path = write_split(tmp_path, "train", make_pairs(80), "json")[0]
    text = path.read_text(encoding="utf-8")
    cut = text.index("},", len(text) // 2) + 1  # drop the comma after a record in the middle
    bad = text[:cut] + text[cut + 1:]
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(bad)
    message = _error(small_config(tmp_path))
    assert f"{path}:{ref.value.lineno}:{ref.value.colno}:" in message


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_malformed_json_on_one_long_line(tmp_path: Path, chunk: int) -> None:
    path = tmp_path / "train.json"
    text = json.dumps([{"en": s, "ch": t} for s, t in make_pairs(40)], ensure_ascii=False)
    cut = text.index('"ch"', len(text) // 2) + 4
    bad = text[:cut] + text[cut + 1:]  # drop a colon
    path.write_text(bad, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError) as ref:
        json.loads(bad)
    with pytest.raises(InputError) as info:
        list(iter_json_array(path, chunk))
    assert f"{path}:1:{ref.value.colno}:" in str(info.value)


def test_malformed_jsonl_names_line(tmp_path: Path) -> None:
    path = write_split(tmp_path, "train", make_pairs(30), "jsonl")[0]
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[16] = lines[16].replace('"ch":', '"ch"')
    path.write_text("".join(lines), encoding="utf-8")
    assert f"{path}:17:" in _error(small_config(tmp_path))


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_missing_language_key_names_record_index(tmp_path: Path, fmt: str) -> None:
    pairs = make_pairs(30)
    write_split(tmp_path, "train", pairs, fmt)
    path = tmp_path / f"train.{fmt}"
    records = [{"en": s, "ch": t} for s, t in pairs]
    records[12] = {"en": pairs[12][0], "cn": pairs[12][1]}
    if fmt == "json":
        path.write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    message = _error(small_config(tmp_path))
    assert str(path) in message and "record 12" in message and "'ch'" in message


def test_non_string_value(tmp_path: Path) -> None:
    (tmp_path / "train.json").write_text('[{"en": "a", "ch": "b"}, {"en": 5, "ch": "c"}]')
    assert "record 1" in _error(small_config(tmp_path))


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path: Path) -> None:
    a, b = write_split(tmp_path, "train", make_pairs(20), "text:en:zh")
    b.write_text("".join(b.read_text(encoding="utf-8").splitlines(keepends=True)[:17]), encoding="utf-8")
    message = _error(small_config(tmp_path))
    assert f"{a} has 20 lines" in message and f"{b} has 17 lines" in message


def test_tsv_with_wrong_field_count(tmp_path: Path) -> None:
    path = write_split(tmp_path, "train", make_pairs(10), "tsv")[0]
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[4] = "only one field\n"
    path.write_text("".join(lines), encoding="utf-8")
    message = _error(small_config(tmp_path))
    assert f"{path}:5:" in message and "got 1" in message


@pytest.mark.parametrize("fmt", ["json", "jsonl", "tsv", "text:en:zh"])
def test_invalid_utf8_names_byte_offset(tmp_path: Path, fmt: str) -> None:
    paths = write_split(tmp_path, "train", make_pairs(40), fmt)
    path = paths[-1]
    data = path.read_bytes()
    offset = data.index("。".encode(), len(data) // 2)  # the first byte of a 3-byte character
    path.write_bytes(data[:offset] + b"\xff" + data[offset + 1:])
    message = _error(small_config(tmp_path))
    assert str(path) in message and f"byte offset {offset}" in message


@pytest.mark.parametrize("content", ["", "[]", '[{"en": "", "ch": "x"}, {"en": " ", "ch": ""}]'])
def test_empty_corpus_names_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / "train.json").write_text(content)
    message = _error(small_config(tmp_path))
    assert str(tmp_path / "train.json") in message
