"""Corpus readers: find a split's file(s) and stream its sentence pairs, whatever the format.

A corpus directory holds one file (or one pair of files) per split. Four layouts are accepted and
told apart by extension: a JSON array of ``{"en": ..., "ch": ...}`` records (``train.json``, the
original system's layout, also under ``DIR/json/``), JSON Lines (``train.jsonl``), TSV
(``train.tsv``: ``source<TAB>target``) and line-aligned text pairs (``train.en`` + ``train.zh``).

Every reader streams: a corpus of millions of pairs is never held as Python objects twice. JSON
arrays are parsed incrementally with :meth:`json.JSONDecoder.raw_decode` over decoded chunks. Bad
input raises :class:`~streamnmt.errors.InputError` with one line naming the file and the line and
column, the record index or the byte offset; empty sentences are skipped and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamnmt.data.jsonstream import iter_json_array
from streamnmt.errors import InputError

SPLITS = ("train", "dev", "test")
# Language codes that name the same files: tgt_lang "ch" (the original keys) also finds train.zh.
_ALIASES = {"ch": ("ch", "zh"), "zh": ("zh", "ch")}
# File names of a split: fairseq and OpenNMT name the development split "valid"
_STEMS = {"dev": ("dev", "valid")}


@dataclass(frozen=True)
class SplitSource:
    """Where one split lives: a format and one file (or, for text pairs, source and target files)."""

    split: str
    fmt: str  # "json" | "jsonl" | "tsv" | "text"
    paths: tuple[Path, ...]

    def describe(self) -> str:
        return " + ".join(str(p) for p in self.paths)


@dataclass
class ReadStats:
    """Counts kept while streaming one split."""

    read: int = 0  # records (JSON) or lines (TSV, text pairs) read
    empty_skipped: int = 0  # pairs with an empty side, skipped


def lang_exts(lang: str) -> tuple[str, ...]:
    return _ALIASES.get(lang, (lang,))


def find_split(data_dir: Path, split: str, src_lang: str, tgt_lang: str) -> SplitSource | None:
    """The split's source in ``data_dir`` (then ``data_dir/json``), or None if there is none.

    The formats are json, jsonl, tsv and text pairs (``dev`` also as ``valid``, fairseq's name); a
    folder holding a split in two of them is an error (which one a run trained on would be a guess).
    """
    for base in (data_dir, data_dir / "json"):
        found: list[SplitSource] = []
        for stem in _STEMS.get(split, (split,)):
            for fmt in ("json", "jsonl", "tsv"):
                path = base / f"{stem}.{fmt}"
                if path.is_file():
                    found.append(SplitSource(split, fmt, (path,)))
            src = _first_file(base, stem, lang_exts(src_lang))
            tgt = _first_file(base, stem, lang_exts(tgt_lang))
            if src and tgt:
                found.append(SplitSource(split, "text", (src, tgt)))
            elif (src or tgt) and not found:
                have, lang = (src, tgt_lang) if src else (tgt, src_lang)
                wanted = " or ".join(f"{stem}.{e}" for e in lang_exts(lang))
                others = sorted(p.name for p in base.glob(f"{stem}.*") if p != have and p.is_file())
                hint = (f"; the split's other files here: {', '.join(others[:4])} (--src-lang/--tgt-lang name "
                        f"the extensions)" if others else "")
                raise InputError(f"{have}: found this half of a text pair but not its other half "
                                 f"({wanted} in {base}){hint}")
        if len(found) > 1:
            raise InputError(f"{base}: the {split} split is there twice ({' and '.join(s.describe() for s in found)}): "
                             "remove or move one, so that the run reads the one meant")
        if found:
            return found[0]
    return None


def _first_file(base: Path, split: str, exts: tuple[str, ...]) -> Path | None:
    for ext in exts:
        if (base / f"{split}.{ext}").is_file():
            return base / f"{split}.{ext}"
    return None


def require_split(data_dir: Path, split: str, src_lang: str, tgt_lang: str) -> SplitSource:
    """Like :func:`find_split`, but a missing directory or split is an InputError naming it."""
    if not data_dir.is_dir():
        raise InputError(f"{data_dir}: data directory not found")
    source = find_split(data_dir, split, src_lang, tgt_lang)
    if source is None:
        pair = " + ".join(f"{split}.{lang_exts(lang)[0]}" for lang in (src_lang, tgt_lang))
        raise InputError(f"{data_dir}: no {split} split found (looked for {split}.json, {split}.jsonl, "
                         f"{split}.tsv or {pair}{', or the same named valid' if split == 'dev' else ''}, here "
                         f"and in {data_dir / 'json'})")
    return source


def find_sources(data_dir: Path, src_lang: str, tgt_lang: str) -> dict[str, SplitSource | None]:
    """A corpus's splits: train and dev are required (:func:`require_split`); test is optional (None)."""
    return {
        "train": require_split(data_dir, "train", src_lang, tgt_lang),
        "dev": require_split(data_dir, "dev", src_lang, tgt_lang),
        "test": find_split(data_dir, "test", src_lang, tgt_lang),
    }


def iter_pairs(source: SplitSource, src_lang: str, tgt_lang: str,
               stats: ReadStats | None = None) -> Iterator[tuple[str, str]]:
    """Stream ``(source, target)`` text pairs, stripped, empty ones skipped and counted.

    Raises InputError at the end if the split had no usable pair.
    """
    stats = stats if stats is not None else ReadStats()
    if source.fmt == "json":
        raw = _json_pairs(source.paths[0], src_lang, tgt_lang, stats)
    elif source.fmt == "jsonl":
        raw = _jsonl_pairs(source.paths[0], src_lang, tgt_lang, stats)
    elif source.fmt == "tsv":
        raw = _tsv_pairs(source.paths[0], stats)
    else:
        raw = _text_pairs(source.paths[0], source.paths[1], stats)
    yielded = 0
    for s, t in raw:
        s, t = s.strip(), t.strip()
        if not s or not t:
            stats.empty_skipped += 1
            continue
        yielded += 1
        yield s, t
    if yielded == 0:
        raise InputError(f"{source.describe()}: no usable sentence pairs ({stats.read} read, "
                         f"{stats.empty_skipped} with an empty side)")


# ---- JSON array -------------------------------------------------------------------------------

def _json_pairs(path: Path, src_key: str, tgt_key: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    for index, line, obj in iter_json_array(path, decoder=record_decoder()):
        stats.read += 1
        yield _record_pair(obj, path, f"record {index} (line {line})", src_key, tgt_key)


class _Record(dict):
    """A JSON object as read, with the first key it held twice (None: none)."""

    duplicate: str | None = None


def _record(pairs: list[tuple[str, Any]]) -> _Record:
    obj = _Record(pairs)
    if len(obj) != len(pairs):  # json keeps the last value of a repeated key without a word
        seen: set[str] = set()
        obj.duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return obj


def record_decoder() -> json.JSONDecoder:
    """The JSON decoder of corpus records: objects remember a key given twice."""
    return json.JSONDecoder(object_pairs_hook=_record)


def _record_pair(obj: Any, path: Path, where: str, src_key: str, tgt_key: str) -> tuple[str, str]:
    if not isinstance(obj, dict):
        raise InputError(f"{path}: {where}: expected an object like "
                         f'{{"{src_key}": ..., "{tgt_key}": ...}}, got {type(obj).__name__}')
    duplicate = getattr(obj, "duplicate", None)
    if duplicate in (src_key, tgt_key):  # which of its values is the sentence meant?
        raise InputError(f"{path}: {where}: key {duplicate!r} given twice")
    out = []
    for key in (src_key, tgt_key):
        if key not in obj:  # Chinese keyed by the other name (the default --tgt-lang ch, records "zh")
            key = next((alias for alias in lang_exts(key) if alias in obj), key)
        if key not in obj:
            present = ", ".join(map(repr, list(obj)[:6])) or "none"
            raise InputError(f"{path}: {where}: missing key {key!r} (keys present: {present}; "
                             f"set --src-lang/--tgt-lang to the corpus's keys)")
        value = obj[key]
        if value is None:
            value = ""  # counted as an empty sentence
        if not isinstance(value, str):
            raise InputError(f"{path}: {where}: {key!r} must be a string, got {type(value).__name__}")
        if not value.isascii():
            try:  # JSON's \ud800-style escapes can name half a character, which no tokenizer takes
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"{path}: {where}: {key!r} is not valid Unicode (a lone surrogate "
                                 f"{value[e.start]!r} at character {e.start})") from None
        out.append(value)
    return out[0], out[1]


# ---- line formats -----------------------------------------------------------------------------

def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Stream ``(line number, text)`` from a UTF-8 file; bad bytes are reported by byte offset."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror}") from None
    with f:
        offset = 0
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}: line {number}: invalid UTF-8 at byte offset "
                                 f"{offset + e.start}") from None
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            offset += len(raw)
            yield number, text.rstrip("\r\n")


def count_lines(path: Path) -> int:
    """Lines in a file, a last line without a newline included."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _jsonl_pairs(path: Path, src_key: str, tgt_key: str, stats: ReadStats) -> Iterator[tuple[str, str]]:
    decoder = record_decoder()
    index = 0
    for number, text in iter_lines(path):
        if not text.strip():
            continue
        try:
            obj = decoder.decode(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}:{e.colno}: malformed JSON: {e.msg}") from None
        stats.read += 1
        yield _record_pair(obj, path, f"record {index} (line {number})", src_key, tgt_key)
        index += 1


def _tsv_pairs(path: Path, stats: ReadStats) -> Iterator[tuple[str, str]]:
    for number, text in iter_lines(path):
        stats.read += 1
        if not text.strip():
            yield "", ""  # a blank line: counted as an empty pair
            continue
        fields = text.split("\t")
        if len(fields) != 2:
            raise InputError(f"{path}:{number}: expected 2 tab-separated fields (source<TAB>target), "
                             f"got {len(fields)}")
        yield fields[0], fields[1]


def _text_pairs(src: Path, tgt: Path, stats: ReadStats) -> Iterator[tuple[str, str]]:
    # Counting first costs one fast binary pass and reports a mismatch before anything is built.
    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise InputError(f"line counts differ: {src} has {n_src} lines, {tgt} has {n_tgt} lines")
    for (_, s), (_, t) in zip(iter_lines(src), iter_lines(tgt)):
        stats.read += 1
        yield s, t

