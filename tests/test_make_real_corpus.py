"""scripts/make_real_corpus.py: English->LANG corpora from gettext catalogues the test writes itself."""

from __future__ import annotations

import gettext
import importlib.util
import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_real_corpus.py"


def _module():
    spec = importlib.util.spec_from_file_location("make_real_corpus", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod


mrc = _module()

HEADER = "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n != 1);\n"


def mo_bytes(entries: list[tuple[str, str]], order: str = "<", header: str = HEADER) -> bytes:
    """A compiled gettext catalogue (msgfmt's layout, no hash table): ``entries`` are (msgid, msgstr),
    with msgfmt's encodings: context as ``ctx\\x04id``, plural forms NUL-separated."""
    items = sorted([("", header)] + entries, key=lambda kv: kv[0].encode())
    ids = [k.encode() for k, _ in items]
    strs = [v.encode() for _, v in items]
    n = len(items)
    orig_at, trans_at = 28, 28 + 8 * n
    data_at = trans_at + 8 * n
    tables, blob = [], b""
    for group in (ids, strs):
        table = b""
        for s in group:
            table += struct.pack(order + "2I", len(s), data_at + len(blob))
            blob += s + b"\x00"
        tables.append(table)
    head = struct.pack(order + "7I", 0x950412DE, 0, n, orig_at, trans_at, 0, data_at)
    return head + tables[0] + tables[1] + blob


def write_mo(root: Path, lang: str, name: str, entries: list[tuple[str, str]], order: str = "<") -> Path:
    path = root / lang / "LC_MESSAGES" / f"{name}.mo"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(mo_bytes(entries, order))
    return path


def run(root: Path, out: Path, *flags: str, lang: str = "de") -> str:
    buf = io.StringIO()
    args = mrc.parser().parse_args([str(out), "--lang", lang, "--locale-root", str(root), *flags])
    mrc.build(args, log=lambda *a, **k: print(*a, file=buf))
    return buf.getvalue()


def splits(out: Path) -> dict[str, list[dict[str, str]]]:
    return {s: json.loads((out / f"{s}.json").read_text(encoding="utf-8")) for s in mrc.SPLITS}


def many(n: int, lang: str = "de", offset: int = 0) -> list[tuple[str, str]]:
    return [(f"Open file number {k}", f"{lang} Datei {k} öffnen") for k in range(offset, offset + n)]


def test_writer_is_read_by_stdlib_gettext_and_by_the_parser_in_both_byte_orders(tmp_path):
    entries = [("Open", "Öffnen"), ("menu\x04Close", "Schließen"), ("%d file\x00%d files", "%d Datei\x00%d Dateien")]
    for order in "<>":
        data = mo_bytes(entries, order)
        t = gettext.GNUTranslations(io.BytesIO(data))  # the test's writer writes what gettext reads
        assert t.gettext("Open") == "Öffnen" and t.pgettext("menu", "Close") == "Schließen"
        assert t.ngettext("%d file", "%d files", 2) == "%d Dateien"
        counts = mrc.Counts()
        got = list(mrc.catalogue_entries(data, counts))
        # header dropped, context stripped, plural dropped
        assert sorted(got) == [("Close", "Schließen"), ("Open", "Öffnen")]
        assert (counts.entries, counts.header, counts.plural) == (4, 1, 1)
    with pytest.raises(mrc.CorpusError, match="magic"):
        list(mrc.read_mo(b"\x00" * 40))
    with pytest.raises(mrc.CorpusError, match="past the end"):
        list(mrc.read_mo(mo_bytes(entries)[:-30]))


def test_cleaning_rules():
    assert mrc.clean("_Save As…") == "Save As…" and mrc.clean("Save _As") == "Save As"
    assert mrc.clean("名前を付けて保存(_A)") == "名前を付けて保存" and mrc.clean("&Open") == "Open"
    for kept in ("LC_ALL is unset", "AT&T", "&amp; more", "_a and _b", "__init__"):
        assert mrc.clean(kept) == kept
    assert mrc.clean("  two\n lines\t") == "two lines"
    assert not mrc.is_sentence("%s: %s", "%s : %s") and not mrc.is_sentence("...", "…")
    assert not mrc.is_sentence("{0} <b>%1$d</b>", "{0}") and not mrc.is_sentence("Open", "%s")
    assert mrc.is_sentence("Cannot open %s", "%s kann nicht geöffnet werden") and mrc.is_sentence("OK", "确定")
    assert mrc.lang_key("zh_CN") == "zh" and mrc.lang_key("sr@latin") == "sr" and mrc.lang_key("pt_BR") == "pt"


def test_corpus_keeps_one_pair_per_source_and_drops_the_rest(tmp_path):
    root, out = tmp_path / "locale", tmp_path / "out"
    write_mo(root, "de", "a", many(40) + [
        ("Quit", "Beenden"), ("Close", "Zu"), ("Help", "Hilfe"),
        ("_Print", "_Drucken"),           # accelerators stripped on both sides
        ("Linux", "Linux"),               # identical: untranslated
        ("%s: %s", "%s: %s"), ("%d%%", "%d %%"),  # identical / no words
        ("Empty", ""), ("   ", "x"),      # empty sides
        ("ctx\x04Quit", "Verlassen"),     # a context: the same source again
        ("%d item\x00%d items", "%d Eintrag\x00%d Einträge"),  # plural
    ])
    write_mo(root, "de", "b", [("Close", "Schließen"), ("Quit", "Verlassen"), ("Help", "Hilfe")], order=">")
    write_mo(root, "de", "c", [("Close", "Schließen"), ("Quit", "Beenden")])
    (root / "de" / "LC_MESSAGES" / "broken.mo").write_bytes(b"not a catalogue at all, no" * 3)
    write_mo(root, "fr", "a", [("Quit", "Quitter")])
    log = run(root, out)
    pairs = {r["en"]: r["de"] for s in splits(out).values() for r in s}
    assert set(next(iter(splits(out)["train"])).keys()) == {"en", "de"}
    # most common translation: Close 2x Schließen; Quit 2:2 tie -> the smaller string; Help once per file
    assert pairs["Close"] == "Schließen" and pairs["Quit"] == "Beenden" and pairs["Help"] == "Hilfe"
    assert pairs["Print"] == "Drucken"
    assert len(pairs) == 44 and not {"Linux", "%s: %s", "%d%%", "Empty", ""} & set(pairs)
    assert "3 catalogues read" in log and "1 unreadable" in log and "plural 1" in log
    assert "identical 2" in log and "non-sentence 1" in log and "empty 2" in log
    assert "streamnmt train --data" in log and "--tgt-lang de" in log
    info = json.loads((out / "corpus_info.json").read_text())
    assert info["languages"]["de"]["pairs"] == 44 and info["target_key"] == "de"
    sizes = [len(splits(out)[s]) for s in ("train", "dev", "test")]
    assert sizes == [44 - 2 * 4, 4, 4]  # a tenth of the corpus each, below the default minimum


def test_split_is_stable_and_does_not_depend_on_file_order(tmp_path):
    entries = many(300) + [(f"Close window {k}", f"Fenster {k} schließen") for k in range(100)]
    a, b = tmp_path / "a", tmp_path / "b"
    write_mo(a, "de", "one", entries[:200])
    write_mo(a, "de", "two", entries[200:] + [("Open file number 3", "anders")])
    write_mo(b, "de", "zzz", entries[:200])  # same catalogues, read in the other order
    write_mo(b, "de", "aaa", entries[200:] + [("Open file number 3", "anders")])
    run(a, tmp_path / "out1", "--eval-size", "20")
    run(b, tmp_path / "out2", "--eval-size", "20")
    run(a, tmp_path / "out3", "--eval-size", "20")
    for s in mrc.SPLITS:
        text = (tmp_path / "out1" / f"{s}.json").read_bytes()
        assert text == (tmp_path / "out2" / f"{s}.json").read_bytes() == (tmp_path / "out3" / f"{s}.json").read_bytes()
    got = splits(tmp_path / "out1")
    assert [len(got[s]) for s in ("train", "dev", "test")] == [360, 20, 20]
    pairs = {r["en"]: r["de"] for r in got["train"] + got["dev"] + got["test"]}
    assert pairs["Open file number 3"] == "anders"  # a 1:1 tie: the smaller string, whichever file is read first
    # test holds the sources of smallest hash, then dev
    ranked = sorted((r["en"] for s in got.values() for r in s), key=mrc.source_hash)
    assert [r["en"] for r in got["test"]] == ranked[:20] and [r["en"] for r in got["dev"]] == ranked[20:40]
    # adding a catalogue moves no sentence into test from the smaller corpus's train or dev
    write_mo(a, "de", "three", [(f"Delete item {k}", f"Element {k} löschen") for k in range(200)])
    run(a, tmp_path / "out4", "--eval-size", "20")
    bigger_test = {r["en"] for r in splits(tmp_path / "out4")["test"]}
    assert bigger_test & set(ranked) <= {r["en"] for r in got["test"]}


def test_max_pairs_samples_training_only_seeded(tmp_path):
    root = tmp_path / "locale"
    write_mo(root, "de", "a", many(500))
    run(root, tmp_path / "full", "--eval-size", "30")
    log = run(root, tmp_path / "s1", "--eval-size", "30", "--max-pairs", "100", "--seed", "1")
    run(root, tmp_path / "s1b", "--eval-size", "30", "--max-pairs", "100", "--seed", "1")
    run(root, tmp_path / "s2", "--eval-size", "30", "--max-pairs", "100", "--seed", "2")
    full, s1, s1b, s2 = (splits(tmp_path / d) for d in ("full", "s1", "s1b", "s2"))
    assert "train 100 pairs (a seeded sample of 440)" in log
    assert len(s1["train"]) == 100 and s1 == s1b and s1["train"] != s2["train"]
    assert all(r in full["train"] for r in s1["train"])
    assert s1["dev"] == full["dev"] and s1["test"] == full["test"] == s2["test"]
    order = [r["en"] for r in full["train"]]
    assert [r["en"] for r in s1["train"]] == [e for e in order if e in {r["en"] for r in s1["train"]}]


def test_several_languages_make_one_tagged_corpus(tmp_path):
    root = tmp_path / "locale"
    write_mo(root, "de", "a", many(100, "de"))
    write_mo(root, "fr", "a", many(60, "fr") + [("Only French", "Seulement")])
    write_mo(root, "zh_CN", "a", many(30, "zh"))
    log = run(root, tmp_path / "mul", "--eval-size", "10", lang="de,fr,zh_CN")
    got = splits(tmp_path / "mul")
    records = [r for s in got.values() for r in s]
    assert all(set(r) == {"en", "mul"} for r in records) and len(records) == 100 + 61 + 30
    assert {"en": "<2fr> Only French", "mul": "Seulement"} in records
    assert {"en": "<2zh> Open file number 5", "mul": "zh Datei 5 öffnen"} in records
    assert "--tgt-lang mul" in log
    # an English sentence is in the same split for every language
    where = {}
    for s, rows in got.items():
        for r in rows:
            src = r["en"].split(" ", 1)[1]
            assert where.setdefault(src, s) == s
    assert 10 <= len(got["test"]) <= 12  # whole sources: all their languages go together


def test_variants_are_read_only_when_asked(tmp_path):
    root = tmp_path / "locale"
    write_mo(root, "de", "a", many(30))
    write_mo(root, "de_CH", "a", [("Street", "Strasse"), ("Open file number 1", "anders")])
    run(root, tmp_path / "plain")
    run(root, tmp_path / "var", "--variants")
    plain = {r["en"] for s in splits(tmp_path / "plain").values() for r in s}
    var = {r["en"]: r["de"] for s in splits(tmp_path / "var").values() for r in s}
    assert "Street" not in plain and var["Street"] == "Strasse" and len(var) == 31
    assert var["Open file number 1"] == "anders"  # 1:1 tie -> smaller string, whatever the dir


def test_variants_keep_to_the_languages_script():
    dirs = {"de", "de_AT", "de_CH", "de@hebrew", "sr", "sr_RS", "sr@latin", "sr_RS@latin", "zh_CN", "zh_SG",
            "zh_TW", "zh_HK", "zh_Hant", "zh_Hans", "deu", "de_DE.UTF-8"}
    locale_dirs = mrc.locale_dirs
    assert locale_dirs("de", True, dirs) == ["de", "de_AT", "de_CH", "de_DE.UTF-8"]
    assert locale_dirs("sr", True, dirs) == ["sr", "sr_RS"]
    assert locale_dirs("zh", True, dirs) == ["zh_CN", "zh_SG"]
    assert locale_dirs("de", False, dirs) == ["de"]


def test_a_catalogue_whose_charset_fails_to_decode_is_counted_not_fatal(tmp_path):
    root = tmp_path / "locale"
    write_mo(root, "de", "a", many(30))
    odd = "Content-Type: text/plain; charset=punycode\n"
    path = root / "de" / "LC_MESSAGES" / "odd.mo"
    path.write_bytes(mo_bytes([("Street", "abc-.x")], header=odd))  # ASCII that punycode cannot decode
    run(root, tmp_path / "out")
    records = {r["en"] for s in splits(tmp_path / "out").values() for r in s}
    assert len(records) == 30 and "Street" not in records


def test_errors_are_one_line_and_leave_files_alone(tmp_path):
    root = tmp_path / "locale"
    write_mo(root, "de", "a", many(40))

    def cli(*args):
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)

    r = cli(str(tmp_path / "x"), "--lang", "ja", "--locale-root", str(root))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--lang ja: no catalogues" in r.stderr
    assert not (tmp_path / "x").exists()
    for bad, flag in ((["--lang", "en_GB"], "--lang"), (["--lang", "de", "--max-pairs", "-1"], "--max-pairs"),
                      (["--lang", "de", "--download"], "--packages"), (["--lang", "de/.."], "--lang")):
        r = cli(str(tmp_path / "x"), "--locale-root", str(root), *bad)
        assert r.returncode == 2 and flag in r.stderr and not (tmp_path / "x").exists(), (bad, r.stderr)
    out = tmp_path / "out"
    assert cli(str(out), "--lang", "de", "--locale-root", str(root)).returncode == 0
    before = (out / "train.json").read_bytes()
    write_mo(root, "de", "b", many(10, offset=40))
    r = cli(str(out), "--lang", "de", "--locale-root", str(root))
    assert r.returncode == 2 and "--force" in r.stderr and (out / "train.json").read_bytes() == before
    assert cli(str(out), "--lang", "de", "--locale-root", str(root), "--force").returncode == 0
    assert len(json.loads((out / "train.json").read_text())) == 50 - 2 * 5
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_package_lists(tmp_path):
    f = tmp_path / "pkgs.txt"
    f.write_text("# comment\nlibreoffice-l10n-{lang}\ngimp-data  # inline\n\n")
    assert mrc.read_packages(str(f), ["de", "pt_BR"]) == ["libreoffice-l10n-de", "libreoffice-l10n-pt", "gimp-data"]
    assert mrc.read_packages("a-b, cc", ["de"]) == ["a-b", "cc"]
    with pytest.raises(mrc.CorpusError, match="--packages"):
        mrc.read_packages("ok,Bad Name", ["de"])


def test_unpacked_package_catalogues_are_found_anywhere_in_the_tree(tmp_path):
    # as dpkg-deb -x leaves them: /usr/share/locale and a program's own resource tree
    root = tmp_path / "root"
    write_mo(root / "usr" / "share" / "locale", "de", "a", many(20))
    write_mo(root / "usr" / "lib" / "office" / "resource", "de", "b", [("Insert Table", "Tabelle einfügen")])
    found = mrc.find_catalogues([root], "de", False)
    assert sorted(p.name for p in found) == ["a.mo", "b.mo"]


@pytest.mark.parametrize("script", ["make_real_corpus.py", "eole_compare.py"])
def test_help_prints_every_flag(script):
    out = subprocess.run([sys.executable, str(SCRIPT.parent / script), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr.strip().splitlines()[-1:]
    assert "--" in out.stdout and "usage:" in out.stdout
