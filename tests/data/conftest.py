"""Small corpora for the data-pipeline tests, written in each of the supported layouts.

The pairs come from a seeded generator (English-like words, Chinese characters, lengths from 1 to
~60 words so that some pairs run past a small ``max_len``); every layout writes the same pairs, so
a test can compare what a reader returns with what was written.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from streamnmt.data import DataConfig, prepare_data

WORDS = ("the a cat dog sees runs big small red house tree river quickly water bird city "
         "morning evening under over walks finds green old young train station").split()
HANZI = "猫狗看跑大小红房子树河快的一个水鸟城市早晚上下走找绿老年轻火车站，。"

Pair = tuple[str, str]


def make_pairs(n: int, seed: int = 1, long_every: int = 10) -> list[Pair]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(1, 12) if i % long_every else rng.randint(30, 60)
        en = " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
        zh = "".join(rng.choice(HANZI[:-2]) for _ in range(rng.randint(1, 2 * k))) + "。"
        out.append((en, zh))
    return out


def write_split(directory: Path, split: str, pairs: list[Pair], fmt: str,
                src: str = "en", tgt: str = "ch") -> list[Path]:
    """Write ``pairs`` as ``split`` in ``fmt``: json, jsonl, tsv, or text:<src ext>:<tgt ext>."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "json":
        path = directory / f"{split}.json"
        path.write_text(json.dumps([{src: s, tgt: t} for s, t in pairs], ensure_ascii=False, indent=1),
                        encoding="utf-8")
        return [path]
    if fmt == "jsonl":
        path = directory / f"{split}.jsonl"
        path.write_text("".join(json.dumps({src: s, tgt: t}, ensure_ascii=False) + "\n" for s, t in pairs),
                        encoding="utf-8")
        return [path]
    if fmt == "tsv":
        path = directory / f"{split}.tsv"
        path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
        return [path]
    _, se, te = fmt.split(":")
    a, b = directory / f"{split}.{se}", directory / f"{split}.{te}"
    a.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    b.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return [a, b]


def write_corpus(directory: Path, fmt: str = "json", n_train: int = 300, n_eval: int = 40,
                 src: str = "en", tgt: str = "ch") -> dict[str, list[Pair]]:
    splits = {"train": make_pairs(n_train, 1), "dev": make_pairs(n_eval, 2), "test": make_pairs(n_eval, 3)}
    for split, pairs in splits.items():
        write_split(directory, split, pairs, fmt, src, tgt)
    return splits


def small_config(directory: Path, **kw) -> DataConfig:
    # truncate: these tests read every pair back (the training default, drop, is tested by name)
    values = dict(data=str(directory), max_len=24, src_vocab=200, tgt_vocab=200, batch_size=8, overlong="truncate")
    values.update(kw)
    return DataConfig(**values)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    write_corpus(tmp_path / "corpus")
    return tmp_path / "corpus"


@pytest.fixture
def logs() -> tuple[list[str], Callable[[str], None]]:
    lines: list[str] = []
    return lines, lines.append


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    """One prepared corpus shared by the batching tests (they only read it); length buckets (the
    packing tests turn ``pack`` on)."""
    directory = tmp_path_factory.mktemp("prepared")
    write_corpus(directory, n_train=400)
    cfg = small_config(directory, pack=False)
    return cfg, prepare_data(cfg, log=lambda _: None)
