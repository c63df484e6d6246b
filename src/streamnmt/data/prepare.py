"""prepare_data: from a corpus directory (or the built-in corpus) to tokenized, cached splits.

This is the one entry point the trainer calls before training. It finds each split, gets the two
tokenizers (given, found beside the data, or trained from a sample of the training split: here, or
in the child process ``streamnmt train`` started for them, :mod:`streamnmt.data.tokenizer_child`,
which writes the built-in corpus too where it is not yet) and
returns each split tokenized, from ``DIR/cache/`` when an entry matches. Every input is checked
before anything is written: a malformed file stops the run with one InputError line and leaves no
tokenizer or cache file behind.

Dev and test are always truncated, never dropped, so that their pairs match ``read_pairs`` one to
one (BLEU references); ``overlong=drop`` applies to the training split only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from streamnmt.data import tokenizer_child
from streamnmt.data.cache import cache_key, entry_dir, load_entry, save_entry
from streamnmt.data.config import DataConfig, builtin_dir
from streamnmt.data.corpus import BuildStats, TokenizedCorpus, tokenize_pairs
from streamnmt.data.readers import ReadStats, SplitSource, find_sources, iter_pairs, require_split
from streamnmt.data.tokenizer import Tokenizer
from streamnmt.data.tokenizer_training import models_lock, refresh_record, sides, train, unrecorded
from streamnmt.data.writing import corpus_word_forms
from streamnmt.dist import several_hosts
from streamnmt.errors import InputError

if TYPE_CHECKING:
    from streamnmt.dist import Dist

Log = Callable[[str], None]
T = TypeVar("T")


class NotPrepared(Exception):
    """``prepare_data(build=False)`` found something it would have to write (the built-in corpus, a
    tokenizer, a tokenized split): the data is not prepared yet."""


@dataclass
class DataBundle:
    """Everything the trainer needs from the data. ``test`` is None when the corpus has no test split."""

    train: TokenizedCorpus
    dev: TokenizedCorpus
    test: TokenizedCorpus | None
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    data_dir: Path
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    cache_keys: dict[str, str] = field(default_factory=dict)  # split -> its cache entry's key
    # the sizes the corpus rule asked of tokenizers trained now (--src-vocab/--tgt-vocab not given):
    # "source", "target" or "shared" -> pieces
    auto_vocab: dict[str, int] = field(default_factory=dict)
    auto_why: dict[str, str] = field(default_factory=dict)  # role -> why the rule asked or capped it apart from its size
    builtin: bool = False  # the built-in corpus (the corpus rule is for --data corpora)
    train_source: SplitSource | None = None  # the training split's files: its raw text (word_forms)
    langs: tuple[str, str] = ("en", "ch")  # the source's and the target's keys in them

    @property
    def train_pairs(self) -> int | None:
        """Training pairs read from a --data corpus (None: the built-in corpus), as the corpus rule counts them."""
        return None if self.builtin else self.stats.get("train", {}).get("read")

    def word_forms(self) -> float | None:
        """The training target's word forms over its source's, counted on the raw text of the split's first
        pairs as the tokenizers' training counts them (streamnmt.data.writing.corpus_word_forms: None
        for a source without spaces): the same number whether the tokenizers were trained now or found,
        the split cached or not."""
        if self.train_source is None:
            return None
        return corpus_word_forms(iter_pairs(self.train_source, *self.langs), self.langs[0])[0]

    def fingerprint(self) -> dict[str, str]:
        """What every rank must share: the tokenizers' hashes and each split's cache key."""
        return {"src tokenizer sha256": self.src_tok.sha256, "tgt tokenizer sha256": self.tgt_tok.sha256,
                **{f"{split} cache key": key for split, key in sorted(self.cache_keys.items())}}


def resolve_data_dir(cfg: DataConfig, build: bool = True) -> Path:
    """``cfg.data``, or the built-in corpus's directory (written there first if absent; with
    ``build=False`` :class:`NotPrepared` instead)."""
    if cfg.data is None:
        from streamnmt.data import synthetic  # written by its own module; imported only when used

        directory = builtin_dir(cfg)
        if not build and not synthetic.builtin_written(directory, cfg.builtin_pairs, seed=synthetic.SEED):
            raise NotPrepared(f"{directory}: the built-in corpus is not written")
        synthetic.write_builtin(directory, cfg.builtin_pairs, seed=synthetic.SEED)
        return directory
    directory = Path(cfg.data).expanduser()
    if not directory.is_dir():
        raise InputError(f"{directory}: data directory not found")
    return directory


def read_pairs(cfg: DataConfig, split: str, stats: ReadStats | None = None,
               records: list[int] | None = None) -> list[tuple[str, str]]:
    """The usable ``(source, target)`` text pairs of a split, in order (e.g. BLEU references).

    For dev and test, pair ``k`` here is pair ``k`` of ``prepare_data``'s corpus of that split.
    ``stats`` (if given) receives the counts of the read, e.g. the pairs skipped for an empty side;
    ``records`` (if given) each pair's number in the split's file (its JSON record or line, from 1).
    """
    directory = resolve_data_dir(cfg)
    stats = stats if stats is not None else ReadStats()
    pairs = []
    for pair in iter_pairs(require_split(directory, split, cfg.src_lang, cfg.tgt_lang), cfg.src_lang,
                           cfg.tgt_lang, stats):
        pairs.append(pair)
        if records is not None:
            records.append(stats.read)  # the reader counts a record as it hands it on
    return pairs


def prepare_data(cfg: DataConfig, log: Log = print, build: bool = True) -> DataBundle:
    """Tokenizers and tokenized splits for ``cfg``; see the module docstring. ``build=False``: only
    what is already on disk, writing nothing; :class:`NotPrepared` where anything is missing (the
    other ranks of a host load an earlier run's files beside local rank 0, see prepare_once)."""
    t0 = time.perf_counter()
    # The child's work first, before looking for the files it writes (the built-in corpus among them:
    # this process then writes none of them while the child may)
    early = tokenizer_child.take(cfg, log) if build else None
    directory = resolve_data_dir(cfg, build)
    if cfg.data is None:
        log(f"data: built-in corpus ({cfg.builtin_pairs} training pairs) in {directory}")
    sources = find_sources(directory, cfg.src_lang, cfg.tgt_lang)
    src_tok, tgt_tok, auto, why = _tokenizers(cfg, directory, sources, log, build, early)
    corpora: dict[str, TokenizedCorpus] = {}
    stats: dict[str, dict[str, int]] = {}
    keys: dict[str, str] = {}
    for split in ("dev", "test", "train"):  # the small splits first: their errors surface at once
        source = sources[split]
        if source is None:
            log(f"data: {split}: no {split} split in {directory}; skipped")
            continue
        corpora[split], stats[split], keys[split] = _tokenized(cfg, directory / "cache", source, src_tok, tgt_tok,
                                                               log, build)
    log(f"data: ready in {time.perf_counter() - t0:.1f}s (vocab {src_tok.vocab_size} source, "
        f"{tgt_tok.vocab_size} target)")
    return DataBundle(train=corpora["train"], dev=corpora["dev"], test=corpora.get("test"),
                      src_tok=src_tok, tgt_tok=tgt_tok, data_dir=directory, stats=stats, cache_keys=keys,
                      auto_vocab=auto, auto_why=why, builtin=cfg.data is None, train_source=sources["train"],
                      langs=(cfg.src_lang, cfg.tgt_lang))


def _tokenizers(cfg: DataConfig, directory: Path, sources: dict[str, SplitSource | None],
                log: Log, build: bool = True, early: tokenizer_child.Result | None = None
                ) -> tuple[Tokenizer, Tokenizer, dict[str, int], dict[str, str]]:
    """Given models as they are; else ``DIR/tokenizer/{src,tgt}.model`` or an older version's names
    (:func:`~streamnmt.data.tokenizer_training.corpus_model`; ``shared.model`` with --shared-vocab),
    trained when absent: by the child process the command started for them
    (:mod:`streamnmt.data.tokenizer_child`; ``early``: what it did, waited for by the caller), else
    now. Third: the sizes the corpus rule asked of those trained, by role (empty: sizes given, or
    none trained); fourth: why it asked or capped a side apart from its size, by role."""
    # jobs started at once on one corpus take turns: a later one finds what the first trained
    with models_lock(directory) if build else contextlib.nullcontext():
        by_child = set(early.trained) if early is not None else set()
        plan = sides(cfg, directory)
        loaded = {side.role: Tokenizer(side.path) for side in plan if side.found and str(side.path) not in by_child}
        missing = [side for side in plan if side.role not in loaded]
        if missing and not build:
            raise NotPrepared(f"{missing[0].path}: not trained yet")
        for side in plan:
            if side.role in loaded:
                log(f"data: {side.name}: {loaded[side.role].path} (vocab {loaded[side.role].vocab_size})")
                if (why := unrecorded(side)) is not None:
                    log(f"data: {side.name}: {why}")
                elif build and not side.given:
                    refresh_record(cfg, directory, side)  # under the lock: a copied corpus is hashed once
        auto: dict[str, int] = {}
        why: dict[str, str] = {}
        if early is not None and missing and {str(side.path) for side in missing} == by_child:
            for line in early.lines:
                log(line)
            loaded.update({side.role: Tokenizer(side.path) for side in missing})
            auto, why = early.auto, early.why
        elif missing:
            trained = train(cfg, directory, sources, missing, log)
            loaded.update(trained.tokenizers)
            auto, why = trained.auto, trained.why
    if cfg.shared_vocab:
        return loaded["shared"], loaded["shared"], auto, why
    return loaded["source"], loaded["target"], auto, why


def _tokenized(cfg: DataConfig, cache_dir: Path, source: SplitSource, src_tok: Tokenizer,
               tgt_tok: Tokenizer, log: Log, build: bool = True) -> tuple[TokenizedCorpus, dict[str, int], str]:
    """One split from its cache entry, or tokenized now and cached."""
    split = source.split
    overlong = cfg.overlong if split == "train" else "truncate"
    t0 = time.perf_counter()
    key = cache_key(source, src_tok, tgt_tok, max_len=cfg.max_len, overlong=overlong,
                    src_lang=cfg.src_lang, tgt_lang=cfg.tgt_lang)
    hit = load_entry(cache_dir, key)
    if hit is not None:
        corpus, stats = hit
        log(f"data: {split}: {_summary(stats, cfg.max_len)} from cache {entry_dir(cache_dir, key)} "
            f"in {time.perf_counter() - t0:.1f}s")
        return corpus, stats, key
    if not build:
        raise NotPrepared(f"{split}: not in the tokenized cache {cache_dir}")
    read = ReadStats()
    built = BuildStats()
    arrays = tokenize_pairs(iter_pairs(source, cfg.src_lang, cfg.tgt_lang, read), src_tok, tgt_tok,
                            max_len=cfg.max_len, overlong=overlong, stats=built)
    built.read, built.empty_skipped = read.read, read.empty_skipped
    stats = built.as_dict()
    try:
        corpus = save_entry(cache_dir, key, arrays, stats, log)
        where = f"cached in {entry_dir(cache_dir, key)}"
    except OSError as e:
        corpus = TokenizedCorpus(arrays, split)
        where = f"not cached ({cache_dir}: {e.strerror or e})"
    log(f"data: {split}: {_summary(stats, cfg.max_len)} from {source.describe()} tokenized in "
        f"{time.perf_counter() - t0:.1f}s, {where}")
    return corpus, stats, key


def _summary(stats: dict[str, int], max_len: int) -> str:
    notes = [f"{stats['read']} read"]
    if stats["empty_skipped"]:
        notes.append(f"{stats['empty_skipped']} with an empty side skipped")
    if stats["truncated"]:
        notes.append(f"{stats['truncated']} truncated to {max_len} tokens")
    if stats["dropped"]:
        notes.append(f"{stats['dropped']} over {max_len} tokens dropped")
    return f"{stats['pairs']} pairs ({', '.join(notes)})"


def prepare_once(d: Dist, prepare: Callable[[], T], fingerprint: Callable[[T], dict[str, str]],
                 prepared: Callable[[], T] | None = None) -> T:
    """Run ``prepare`` (tokenizers, tokenized cache) on rank 0 first while the other ranks wait at
    a barrier; on several hosts then on each other host's local rank 0 while the rest wait again
    (on a shared data directory they find rank 0's files, on a host's own one each host prepares
    its own, one process a host: two local rank 0s never write one folder at once); then on the
    remaining ranks (they find their host's files); then every rank checks that its
    ``fingerprint`` (tokenizer hashes, cache keys) equals rank 0's. ``prepared``: what the other
    ranks try beside local rank 0 first, the files an earlier run left, read without writing
    anything (``prepare_data(build=False)``); where it finds them (it raises NotPrepared where it
    does not) they wait at the barrier with their data already loaded instead of loading it after
    (a part of a multi-GPU run's set-up on a large corpus: docs/PERFORMANCE.md).
    One process: just ``prepare``. A mismatch (e.g. hosts that do not share the data directory and
    hold other tokenizers) stops every rank with the same line."""
    if not d.active:
        return prepare()
    result = None
    if d.rank == 0:
        result = prepare()
    elif prepared is not None:
        try:
            result = prepared()
        except (NotPrepared, InputError, OSError):  # not there yet, or an error prepare() will say after
            result = None
    d.barrier("dist.data")
    if several_hosts(d.world):
        if result is None and d.local_rank == 0:
            result = prepare()
        d.barrier("dist.data")
    if result is None:
        result = prepare()
    prints = d.gather(fingerprint(result), "dist.data", long_wait=True)  # the others may tokenize afresh
    for rank, got in enumerate(prints):
        diff = sorted(k for k in set(got) | set(prints[0]) if got.get(k) != prints[0].get(k))
        if diff:
            k = diff[0]
            raise InputError(f"rank {rank} of {d.world} prepared other data than rank 0: {k} "
                             f"{str(got.get(k))[:16]} vs rank 0's {str(prints[0].get(k))[:16]} (every rank must "
                             f"see the same data directory and tokenizers)")
    return result
