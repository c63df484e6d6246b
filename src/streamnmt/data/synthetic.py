"""The built-in English->Chinese corpus: sentence pairs generated from a seed, nothing downloaded.

``streamnmt train`` with no ``--data`` needs a corpus that exists on every machine, costs nothing
to fetch, and is still a translation task: word translation from a small bilingual lexicon,
reordering (Chinese puts times, dates, places and durations before the verb, comparisons take
比) and numeral conversion (English number words to Chinese numerals and measure words). This
module fills 27 sentence templates about numbers, dates, clock times, quantities and prices
with ``random.Random(seed)``, so ``(size, seed)`` names one corpus exactly, cuts the stream into
train/dev/test and writes them. The templates are in :mod:`streamnmt.data.templates`, the
renderings and their conventions in :mod:`streamnmt.data.grammar`, the numerals and the word
tables in :mod:`streamnmt.data.lexicon`.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

from streamnmt.data.lexicon import Pair
from streamnmt.data.templates import TEMPLATES
from streamnmt.fsutil import atomic_write

MANIFEST_NAME = "synthetic-manifest.json"
SPLITS = ("train", "dev", "test")
# The generator's other modules, named in full: ``from streamnmt.data import grammar`` would run the
# package's ``__init__`` (torch, numpy), which the tokenizers' child process writing this corpus
# (streamnmt.data.tokenizer_child) holds back
GENERATOR_MODULES = ("streamnmt.data.templates", "streamnmt.data.grammar", "streamnmt.data.lexicon")
SEED = 0  # the seed of the built-in corpus ``streamnmt train`` writes (prepare_data, tokenizer_child)


def _pair_stream(rng: random.Random) -> Iterator[Pair]:
    samplers = list(TEMPLATES.values())
    while True:
        yield rng.choice(samplers)(rng)


def generate_pairs(n: int, seed: int) -> list[Pair]:
    """``n`` (English, Chinese) pairs; the same ``(n, seed)`` always gives the same list, and a
    longer list for the same seed starts with the shorter one."""
    return list(itertools.islice(_pair_stream(random.Random(seed)), n))


def builtin_splits(n_train: int, seed: int = 0) -> dict[str, list[Pair]]:
    """Train/dev/test pairs; dev and test hold ``max(200, n_train // 20)`` pairs each.

    One stream is cut in order test, dev, train. Dev and test hold distinct English sentences,
    and train skips every sentence they hold, so no evaluation sentence is seen in training
    (train itself keeps repeats: they are part of the template distribution).
    """
    if n_train < 1:
        raise ValueError(f"builtin_splits: n_train must be positive; got {n_train}")
    n_eval = max(200, n_train // 20)
    stream = _pair_stream(random.Random(seed))
    held: set[str] = set()
    out: dict[str, list[Pair]] = {}
    for name in ("test", "dev"):
        out[name] = []
        while len(out[name]) < n_eval:
            pair = next(stream)
            if pair[0] not in held:
                held.add(pair[0])
                out[name].append(pair)
    out["train"] = list(itertools.islice((p for p in stream if p[0] not in held), n_train))
    return {name: out[name] for name in SPLITS}


def _to_json(pairs: list[Pair]) -> str:
    # One object per line: valid JSON that still reads and diffs like a line-based file.
    lines = ",\n".join(json.dumps({"en": en, "ch": zh}, ensure_ascii=False) for en, zh in pairs)
    return f"[\n{lines}\n]\n"


def _source_digest() -> str:
    # Any change to the generator's files (this one, the templates, the grammar and the lexicon: words,
    # templates, conventions) invalidates written corpora.
    h = hashlib.sha256(Path(__file__).read_bytes())
    for name in GENERATOR_MODULES:
        h.update(Path(importlib.import_module(name).__file__).read_bytes())
    return h.hexdigest()[:16]


def _is_current(directory: Path, params: dict) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
        return (all(manifest.get(k) == v for k, v in params.items())
                and all((directory / f"{name}.json").stat().st_size == manifest["bytes"][name]
                        for name in SPLITS))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def builtin_written(directory: Path, n_train: int, seed: int = 0) -> bool:
    """Whether :func:`write_builtin` would find ``directory`` current (and write nothing)."""
    return _is_current(Path(directory), {"generator": __name__, "source": _source_digest(), "n_train": n_train,
                                         "seed": seed})


def write_builtin(directory: Path, n_train: int, seed: int = 0) -> None:
    """Write ``train.json``, ``dev.json`` and ``test.json`` (arrays of ``{"en", "ch"}``) to
    ``directory``, unless its manifest says this code already wrote them with these parameters
    and the files still have the sizes it recorded."""
    directory = Path(directory)
    params = {"generator": __name__, "source": _source_digest(), "n_train": n_train, "seed": seed}
    if _is_current(directory, params):
        return
    directory.mkdir(parents=True, exist_ok=True)
    # The manifest goes first and comes back last: an interrupted write is never taken as done.
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    sizes = {}
    for name, pairs in builtin_splits(n_train, seed).items():
        data = _to_json(pairs).encode("utf-8")
        atomic_write(directory / f"{name}.json", data)
        sizes[name] = len(data)
    atomic_write(directory / MANIFEST_NAME, json.dumps({**params, "bytes": sizes}, indent=2) + "\n")
