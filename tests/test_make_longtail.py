"""scripts/make_longtail.py: a heavy-tailed corpus whose words translate (the built-in lexicon)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_longtail.py"


def _module():
    spec = importlib.util.spec_from_file_location("make_longtail", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lexicon_sentences_are_word_by_word_translations():
    mod = _module()
    table = dict(mod.lexicon_entries())
    assert table["apple"] == "苹果" and table["twenty-five"] == "二十五" and len(table) > 200
    pairs = mod.make_pairs(3000, seed=0)
    assert pairs == mod.make_pairs(3000, seed=0)  # seeded
    singles = [p for p in pairs if p["en"] in table]
    assert len(singles) > 100 and all(p["ch"] == table[p["en"]] for p in singles)
    for p in pairs:
        assert not re.search(r"[A-Za-z\s]", p["ch"])
    # a sentence's translation is its entries' translations in order: rebuild it from its entries
    entries = sorted(table, key=lambda e: -len(e.split()))
    for p in pairs[:200]:
        words, zh = p["en"].split(), ""
        while words:
            e = next(e for e in entries if words[:len(e.split())] == e.split())
            zh, words = zh + table[e], words[len(e.split()):]
        assert zh == p["ch"]
    lengths = [len(p["en"].split()) for p in pairs]
    assert sorted(lengths)[len(lengths) // 2] < 12 < max(lengths)  # short mostly, with a long tail


def test_cli_writes_the_splits_and_random_words_stay_available(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "lt"), "--pairs", "300"],
                         capture_output=True, text=True, check=True).stdout
    assert "300 training pairs (lexicon words)" in out
    assert [len(json.loads((tmp_path / "lt" / f"{s}.json").read_text())) for s in ("train", "dev", "test")] == \
        [300, 1000, 1000]
    rnd = _module().make_pairs(50, seed=0, words="random")
    assert len(rnd) == 50 and all(len(p["en"].split()) <= 126 for p in rnd)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x"), "--pairs", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--pairs" in bad.stderr and not (tmp_path / "x").exists()
