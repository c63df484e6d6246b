"""A real English->LANG corpus of human translations, made from the gettext catalogues on this machine.

Debian packages carry their programs' messages translated by people: compiled gettext catalogues
(``.mo``: English ``msgid`` -> translated ``msgstr``) under ``/usr/share/locale/<dir>/LC_MESSAGES``.
This reads them (and ``/usr/share/locale-langpack`` where present; ``--download`` adds the
catalogues of a list of packages fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``
into a scratch folder, never into /) and writes ``train/dev/test.json`` arrays of
``{"en": ..., "<lang>": ...}`` records, the layout ``streamnmt train --data DIR`` reads::

    python3 scripts/make_real_corpus.py --lang de corpora/de
    python3 scripts/make_real_corpus.py --lang de --max-pairs 10000 corpora/de-10k
    python3 scripts/make_real_corpus.py --lang de,fr,es,ru corpora/mul   # one target-tagged corpus
    python3 scripts/make_real_corpus.py --lang fr --download --packages pkgs.txt corpora/fr-big
    streamnmt train --data corpora/de --src-lang en --tgt-lang de

Languages: ``--lang`` names locale directories exactly (``de``, ``zh_CN``, ``pt_BR``, ``sr@latin``);
``--variants`` also reads the same language's regional ones (``de`` -> ``de_CH``, ``de_AT``...,
read after ``de``), in the same script only (not ``sr@latin`` beside ``sr``; ``zh`` reads ``zh_CN`` and
``zh_SG``, not the Traditional ``zh_TW``, ``zh_HK``). The record key is the language part of the name (``zh_CN`` -> ``zh``, so that
the project scores Chinese with sacrebleu's ``zh`` tokenizer). Several comma-separated languages
make one corpus whose target key is ``mul`` and whose sources start with the target's tag
(``<2de> Open file``); each language is deduplicated on its own, and an English sentence falls
into the same split for every language (no test sentence is seen in training through another).

What is kept, in order (each rule counted in the summary):

- A catalogue is read once even where two packages or roots install the same file (same bytes).
- Dropped: the header (empty ``msgid``), plural entries (``msgid`` or ``msgstr`` holding NUL-
  separated forms). A context (``msgctxt``, before ``\\x04``) is stripped, the entry kept.
- Both sides: a menu accelerator is removed (a parenthesised ``(_F)``/``(&F)``, and a ``_`` or
  ``&`` that starts a word (``_Quit``, ``Save &As``) when it is the only such one in the text;
  ``LC_ALL``, ``AT&T``, ``&amp;`` and ``a_b c_d`` stay), and whitespace runs (newlines too) become
  one space.
- Dropped: an empty side, a target equal to its source (untranslated), and non-sentences: a
  source with no run of two letters once placeholders (``%s``, ``%1$d``, ``%(name)s``, ``{0}``,
  ``$VAR``, ``<tag>``) are removed, or a target with no letter once they are.
- One pair per source: its most common translation over all catalogues read, ties to the
  smallest string, so the result does not depend on the order catalogues are read in.

Split: sources are ranked by the SHA-1 of their text; test takes the first, dev the next, until
each holds ``--eval-size`` pairs (default: 1 % of the pairs, at least 500 and at most 1000, at
most a tenth of the corpus), train the rest. The split depends only on the set of sources.
``--max-pairs N`` keeps a seeded sample (``--seed``) of N training pairs; dev and test stay those of
the full corpus, so a subsampled corpus is scored on the same sentences as the full one. Each split
is ordered by the hash. Files are written to temporary names and renamed; a directory that already
holds splits is refused without ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOTS = ("/usr/share/locale", "/usr/share/locale-langpack")
SPLITS = ("train", "dev", "test")
MULTI_KEY = "mul"  # ISO 639-2 "multiple languages": the target key of a target-tagged corpus
EVAL_FRACTION, EVAL_MIN, EVAL_MAX = 0.01, 500, 1000
MO_MAGIC = 0x950412DE


class CorpusError(Exception):
    """Bad input: one line, printed by main() with a non-zero exit."""


# ---- .mo catalogues ---------------------------------------------------------------------------

def read_mo(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The (msgid, msgstr) byte strings of a compiled gettext catalogue, either byte order.

    Raises CorpusError for a file that is not a catalogue or is cut short.
    """
    if len(data) < 28:
        raise CorpusError("too short for a .mo header")
    for order in ("<", ">"):
        if struct.unpack(order + "I", data[:4])[0] == MO_MAGIC:
            break
    else:
        raise CorpusError("not a .mo file (bad magic number)")
    _, count, orig_at, trans_at = struct.unpack(order + "4I", data[4:20])
    for i in range(count):
        try:
            olen, ooff = struct.unpack_from(order + "2I", data, orig_at + 8 * i)
            tlen, toff = struct.unpack_from(order + "2I", data, trans_at + 8 * i)
        except struct.error:
            raise CorpusError(f"string table cut short at entry {i}") from None
        if ooff + olen > len(data) or toff + tlen > len(data):
            raise CorpusError(f"entry {i} points past the end of the file")
        yield data[ooff:ooff + olen], data[toff:toff + tlen]


def charset_of(header: bytes) -> str:
    m = re.search(rb"charset=([A-Za-z0-9_.:-]+)", header)
    name = m.group(1).decode("ascii") if m else "utf-8"
    try:
        "".encode(name)
    except LookupError:
        return "utf-8"
    return name


@dataclass
class Counts:
    """What happened to each catalogue entry: the summary's numbers."""

    catalogues: int = 0
    duplicate_files: int = 0
    unreadable: int = 0
    entries: int = 0
    header: int = 0
    plural: int = 0
    undecodable: int = 0
    empty: int = 0
    identical: int = 0
    non_sentence: int = 0
    pairs: int = 0  # unique sources kept
    duplicate_sources: int = 0
    warnings: list[str] = field(default_factory=list)


def catalogue_entries(data: bytes, counts: Counts) -> Iterator[tuple[str, str]]:
    """(source, target) texts of one catalogue: header and plurals dropped, contexts stripped."""
    raw = list(read_mo(data))
    header = next((t for o, t in raw if o == b""), b"")
    charset = charset_of(header)
    for msgid, msgstr in raw:
        counts.entries += 1
        if msgid == b"":
            counts.header += 1
            continue
        if b"\x04" in msgid:
            msgid = msgid.split(b"\x04", 1)[1]
        if b"\x00" in msgid or b"\x00" in msgstr:
            counts.plural += 1
            continue
        try:
            src = msgid.decode("utf-8")
        except UnicodeDecodeError:
            src = None
        try:
            src = src if src is not None else msgid.decode(charset)
            tgt = msgstr.decode(charset)
        except UnicodeError:  # UnicodeDecodeError, and a codec the header names that fails otherwise
            counts.undecodable += 1
            continue
        yield src, tgt


# ---- cleaning ---------------------------------------------------------------------------------

_PAREN_ACCEL = re.compile(r"\s*\((?:_|&)[^\W_]\)")
# A marker at a word's start (``_Quit``, ``Save _As``), not inside one (``LC_ALL``, ``AT&T``, ``&amp;``).
_ACCEL = {"_": re.compile(r"(?<![\w&])_(?=[^\W_])"), "&": re.compile(r"(?<![\w&])&(?![#\w]+;)(?=[^\W_])")}
_PLACEHOLDER = re.compile(r"%(?:\(\w+\)|\d+\$)?[-#0 +'I]*(?:\*|\d+)?(?:\.(?:\*|\d+))?"
                          r"(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGaAcspnm%]"
                          r"|\{[^{}]*\}|\$\{?\w+\}?|</?\w[\w:.-]*(?:\s+[\w:-]+=[^<>]*)?/?>")
_WORD2 = re.compile(r"[^\W\d_]{2}")
_SPACE = re.compile(r"\s+")


def strip_accelerators(text: str) -> str:
    """Menu accelerators removed: ``(_F)``/``(&F)``, and a word-starting ``_x``/``&x`` (the only one)."""
    text = _PAREN_ACCEL.sub("", text)
    for marker, pattern in _ACCEL.items():
        if len(pattern.findall(text)) == 1 and marker * 2 not in text:
            text = pattern.sub("", text)
    return text


def clean(text: str) -> str:
    return _SPACE.sub(" ", strip_accelerators(text)).strip()


def is_sentence(src: str, tgt: str) -> bool:
    """A source with a run of two letters outside placeholders, and a target with a letter outside them."""
    return bool(_WORD2.search(_PLACEHOLDER.sub(" ", src))) and any(c.isalpha() for c in _PLACEHOLDER.sub(" ", tgt))


# ---- languages and catalogues -----------------------------------------------------------------

def lang_key(lang: str) -> str:
    """The record key of a locale directory name: its language part (``zh_CN`` -> ``zh``)."""
    return re.split(r"[_@.]", lang, maxsplit=1)[0].lower()


def parse_langs(spec: str) -> list[str]:
    langs = [s.strip() for s in spec.split(",") if s.strip()]
    if not langs:
        raise CorpusError(f"--lang: no language given in {spec!r}")
    for lang in langs:
        if not re.fullmatch(r"[A-Za-z]{2,3}(?:_[A-Za-z0-9]+)?(?:@\w+)?", lang):
            raise CorpusError(f"--lang: {lang!r} is not a locale directory name like de, zh_CN or sr@latin")
        if lang_key(lang) == "en":
            raise CorpusError(f"--lang: {lang!r} is English, the source language")
    keys = [lang_key(x) for x in langs]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise CorpusError(f"--lang: language {dup!r} named twice ({spec}): its records would share the tag "
                          f"<2{dup}> (--variants merges one name's regional directories)")
    return langs


# Chinese regions that write Traditional characters (zh_CN, zh_SG: Simplified)
_TRADITIONAL = {"TW", "HK", "MO"}


def locale_dirs(lang: str, variants: bool, names: set[str]) -> list[str]:
    """The locale directory names read for ``lang``: itself, then (``variants``) its regional ones
    (``de`` -> ``de_AT``, ``de_CH``), in the same script: not a script's own directory (``sr@latin``,
    ``zh_Hant``) and, for Chinese, only the regions of the script ``lang`` writes."""
    out = [lang] if lang in names else []
    if variants:
        regional = re.compile(re.escape(lang) + r"_([A-Z]{2}|\d{3})(?:\.[\w-]+)?")
        traditional = lang_key(lang) == "zh" and lang.partition("_")[2][:2] in _TRADITIONAL
        out += sorted(n for n in names if n != lang and (m := regional.fullmatch(n))
                      and (lang_key(lang) != "zh" or (m.group(1) in _TRADITIONAL) == traditional))
    return out


def find_catalogues(roots: list[Path], lang: str, variants: bool) -> list[Path]:
    """``.mo`` files of ``lang`` under each root: ``ROOT/<dir>/LC_MESSAGES/*.mo`` and, deeper (unpacked
    packages keep catalogues elsewhere too), any ``.../<dir>/LC_MESSAGES/*.mo``; exact dir first."""
    by_dir: dict[str, list[Path]] = defaultdict(list)
    for root in roots:
        if not root.is_dir():
            continue
        for msgdir in sorted(root.rglob("LC_MESSAGES")):
            if msgdir.is_dir():
                by_dir[msgdir.parent.name] += sorted(msgdir.glob("*.mo"))
    out: list[Path] = []
    for d in locale_dirs(lang, variants, set(by_dir)):
        out += by_dir[d]
    return out


def collect(paths: list[Path], counts: Counts) -> dict[str, Counter]:
    """source -> Counter of its kept translations, over the catalogues ``paths`` (identical files once)."""
    seen_files: set[str] = set()
    table: dict[str, Counter] = defaultdict(Counter)
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as e:
            counts.unreadable += 1
            counts.warnings.append(f"{path}: cannot read: {e.strerror}")
            continue
        digest = hashlib.sha1(data).hexdigest()
        if digest in seen_files:
            counts.duplicate_files += 1
            continue
        seen_files.add(digest)
        try:
            entries = list(catalogue_entries(data, counts))
        except CorpusError as e:
            counts.unreadable += 1
            counts.warnings.append(f"{path}: skipped: {e}")
            continue
        counts.catalogues += 1
        for src, tgt in entries:
            src, tgt = clean(src), clean(tgt)
            if not src or not tgt:
                counts.empty += 1
            elif src == tgt:
                counts.identical += 1
            elif not is_sentence(src, tgt):
                counts.non_sentence += 1
            else:
                table[src][tgt] += 1
    return table


def choose(table: dict[str, Counter], counts: Counts) -> dict[str, str]:
    """One translation per source: the most common, ties to the smallest string."""
    out = {}
    for src, tgts in table.items():
        counts.duplicate_sources += sum(tgts.values()) - 1
        out[src] = min(tgts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
    counts.pairs = len(out)
    return out


# ---- download ---------------------------------------------------------------------------------

def read_packages(spec: str, langs: list[str]) -> list[str]:
    """Package names from a file (one a line, ``#`` comments) or a comma-separated list; ``{lang}``
    in a name becomes each language's key (``libreoffice-l10n-{lang}``)."""
    path = Path(spec)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        names = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    else:
        names = [s.strip() for s in spec.split(",")]
    out: list[str] = []
    for name in filter(None, names):
        for n in ([name.replace("{lang}", lang_key(x)) for x in langs] if "{lang}" in name else [name]):
            if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-]+", n):
                raise CorpusError(f"--packages: {n!r} is not a Debian package name")
            if n not in out:
                out.append(n)
    if not out:
        raise CorpusError(f"--packages: no package names in {spec!r}")
    return out


def download(packages: list[str], scratch: Path, log=print) -> Path:
    """Fetch ``packages`` with ``apt-get download`` into ``scratch/debs`` and unpack each with
    ``dpkg-deb -x`` into ``scratch/root``; returns that root. A missing package is a warning."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusError(f"--download: {tool} not found (a Debian-based system is needed)")
    debs, root = scratch / "debs", scratch / "root"
    if root.resolve() == Path("/"):
        raise CorpusError(f"--scratch: {scratch} would unpack into /")
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    apt = ["apt-get", "download", "-q", "-o", f"Dir::Cache={scratch / 'apt-cache'}", "-o", "Debug::NoLocking=1"]
    # One call for all; where one name fails, the whole call fails, so fetch them one by one.
    if subprocess.run(apt + packages, cwd=debs, capture_output=True, text=True).returncode != 0:
        for name in packages:
            r = subprocess.run(apt + [name], cwd=debs, capture_output=True, text=True)
            if r.returncode != 0:
                err = (r.stderr.strip().splitlines() or ["failed"])[-1]
                log(f"warning: apt-get download {name}: {err}", file=sys.stderr)
    files = sorted(debs.glob("*.deb"))
    if not files:
        raise CorpusError("--download: no package could be downloaded (apt-get update may be needed)")
    for deb in files:
        r = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True, text=True)
        if r.returncode != 0:
            log(f"warning: dpkg-deb -x {deb.name}: {r.stderr.strip()}", file=sys.stderr)
    log(f"downloaded and unpacked {len(files)} packages into {root}")
    return root


# ---- split and write --------------------------------------------------------------------------

def source_hash(src: str) -> str:
    return hashlib.sha1(src.encode("utf-8")).hexdigest()


def eval_size(n_pairs: int) -> int:
    return max(1, min(max(round(n_pairs * EVAL_FRACTION), EVAL_MIN), EVAL_MAX, n_pairs // 10))


def split_pairs(per_lang: dict[str, dict[str, str]], size: int) -> dict[str, list[tuple[str, str, str]]]:
    """(lang, source, target) triples per split: sources ranked by hash fill test, then dev, to ``size``
    pairs each (a source goes whole, with all its languages), the rest is train; each in hash order."""
    by_src: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for lang in sorted(per_lang):
        for src, tgt in per_lang[lang].items():
            by_src[src].append((lang, src, tgt))
    ranked = sorted(by_src, key=lambda s: (source_hash(s), s))
    out: dict[str, list[tuple[str, str, str]]] = {s: [] for s in SPLITS}
    for src in ranked:
        split = "test" if len(out["test"]) < size else "dev" if len(out["dev"]) < size else "train"
        out[split] += by_src[src]
    return out


def subsample(train: list, n: int, seed: int) -> list:
    """A seeded sample of ``n`` training pairs, in their order."""
    if n >= len(train):
        return train
    keep = sorted(random.Random(seed).sample(range(len(train)), n))
    return [train[i] for i in keep]


def records(triples: list[tuple[str, str, str]], tagged: bool) -> list[dict[str, str]]:
    if tagged:
        return [{"en": f"<2{lang}> {src}", MULTI_KEY: tgt} for lang, src, tgt in triples]
    return [{"en": src, lang: tgt} for lang, src, tgt in triples]


def dump_json(items: list[dict[str, str]]) -> str:
    """A JSON array, one record a line."""
    return "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in items) + "\n]\n"


def write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def mean_len(texts: list[str]) -> str:
    if not texts:
        return "-"
    words = sum(len(t.split()) for t in texts) / len(texts)
    chars = sum(len(t) for t in texts) / len(texts)
    return f"{words:.1f} words / {chars:.1f} chars"


# ---- command line -----------------------------------------------------------------------------

def build(args: argparse.Namespace, log=print) -> dict:
    """Read, clean, split and write; returns the summary that is also written as ``corpus_info.json``."""
    langs = parse_langs(args.lang)
    out = Path(args.outdir)
    if out.exists() and not out.is_dir():
        raise CorpusError(f"{out}: exists and is not a directory")
    if not args.force and any((out / f"{s}.json").exists() for s in SPLITS):
        raise CorpusError(f"{out}: already holds train/dev/test.json (--force replaces them)")
    roots = [Path(r) for r in (args.locale_root or DEFAULT_ROOTS)]
    scratch_tmp = None
    try:
        if args.download:
            packages = read_packages(args.packages, langs)
            if args.scratch:
                scratch = Path(args.scratch)
            else:
                scratch = scratch_tmp = Path(tempfile.mkdtemp(prefix="realcorpus-"))
            roots.append(download(packages, scratch, log))
        per_lang: dict[str, dict[str, str]] = {}
        info: dict = {"languages": {}, "roots": [str(r) for r in roots], "seed": args.seed,
                      "max_pairs": args.max_pairs}
        for lang in langs:
            paths = find_catalogues(roots, lang, args.variants)
            if not paths:
                raise CorpusError(f"--lang {lang}: no catalogues (*.mo) for {lang!r} under "
                                  f"{', '.join(map(str, roots))}")
            counts = Counts()
            per_lang[lang_key(lang)] = choose(collect(paths, counts), counts)
            for w in counts.warnings:
                log(f"warning: {w}", file=sys.stderr)
            if not counts.pairs:
                raise CorpusError(f"--lang {lang}: {counts.catalogues} catalogues read, but no usable pair")
            summary = {k: v for k, v in vars(counts).items() if k != "warnings"}
            info["languages"][lang] = summary
            log(f"{lang}: {counts.catalogues} catalogues read ({counts.duplicate_files} duplicate files, "
                f"{counts.unreadable} unreadable), {counts.entries} entries -> {counts.pairs} pairs; dropped: "
                f"header {counts.header}, plural {counts.plural}, empty {counts.empty}, identical "
                f"{counts.identical}, non-sentence {counts.non_sentence}, undecodable {counts.undecodable}, "
                f"duplicate source {counts.duplicate_sources}")
    finally:
        if scratch_tmp is not None and not args.keep_scratch:
            shutil.rmtree(scratch_tmp, ignore_errors=True)
    total = sum(len(p) for p in per_lang.values())
    if total < 3:
        raise CorpusError(f"--lang {args.lang}: only {total} pairs, too few for train/dev/test")
    size = args.eval_size or eval_size(total)
    if 2 * size >= total:
        raise CorpusError(f"--eval-size {size}: leaves no training pairs of {total}")
    splits = split_pairs(per_lang, size)
    full_train = len(splits["train"])
    if args.max_pairs:
        splits["train"] = subsample(splits["train"], args.max_pairs, args.seed)
    tagged = len(langs) > 1
    tgt_key = MULTI_KEY if tagged else lang_key(langs[0])
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        write_atomic(out / f"{split}.json", dump_json(records(splits[split], tagged)))
    info.update({"target_key": tgt_key, "tagged": tagged, "train_pairs_before_sample": full_train,
                 **{f"{s}_pairs": len(splits[s]) for s in SPLITS}})
    write_atomic(out / "corpus_info.json", json.dumps(info, indent=1, ensure_ascii=False) + "\n")
    train = splits["train"]
    note = f" (a seeded sample of {full_train})" if len(train) < full_train else ""
    log(f"wrote {out}: train {len(train)} pairs{note}, dev {len(splits['dev'])}, test {len(splits['test'])}; "
        f"mean train length: en {mean_len([s for _, s, _ in train])}, "
        f"{tgt_key} {mean_len([t for _, _, t in train])}")
    if (out / "tokenizer").exists() or (out / "cache").exists():
        log(f"note: {out}/tokenizer and {out}/cache were made from the splits before; remove them to retrain",
            file=sys.stderr)
    log(f"train with: streamnmt train --data {out} --src-lang en --tgt-lang {tgt_key}")
    return info


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("outdir", help="corpus directory to write (train/dev/test.json, corpus_info.json)")
    ap.add_argument("--lang", required=True,
                    help="locale directory name(s): de, zh_CN, pt_BR; comma-separated for one tagged corpus")
    ap.add_argument("--variants", action="store_true", help="also read LANG_REGION directories in LANG's script (de: de_AT, de_CH; zh: zh_CN, zh_SG)")
    ap.add_argument("--locale-root", action="append", metavar="DIR",
                    help=f"where locale directories are (repeatable; default {' and '.join(DEFAULT_ROOTS)})")
    ap.add_argument("--download", action="store_true", help="also read the catalogues of --packages")
    ap.add_argument("--packages", metavar="FILE|LIST",
                    help="packages for --download: a file (one a line) or a comma-separated list; "
                         "{lang} expands to each language")
    ap.add_argument("--scratch", metavar="DIR", help="where --download puts and unpacks packages "
                                                     "(default: a temporary folder, removed at the end)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the temporary scratch folder")
    ap.add_argument("--max-pairs", type=int, default=0, metavar="N",
                    help="keep a seeded sample of N training pairs (dev/test unchanged)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the --max-pairs sample")
    ap.add_argument("--eval-size", type=int, default=0, metavar="N",
                    help=f"pairs in dev and in test each (default {EVAL_FRACTION * 100:.0f}%% of the pairs, "
                         f"{EVAL_MIN}-{EVAL_MAX}, at most a tenth)")
    ap.add_argument("--force", action="store_true", help="replace splits already in OUTDIR")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.max_pairs < 0:
        ap.error(f"--max-pairs must be at least 1 (0: all); got {args.max_pairs}")
    if args.eval_size < 0:
        ap.error(f"--eval-size must be at least 1 (0: automatic); got {args.eval_size}")
    if args.download and not args.packages:
        ap.error("--download needs --packages FILE|LIST")
    if args.packages and not args.download:
        ap.error("--packages is read only with --download")
    try:
        build(args)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
