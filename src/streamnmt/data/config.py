"""Data settings: where the corpus is, how it is tokenized, batched and loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamnmt.configbase import check, check_choice, opt
from streamnmt.fsutil import streamnmt_home

# The corpus rule's vocabulary: a --data corpus under SMALL_CORPUS_PAIRS training pairs trains its
# tokenizers with half the 32k of the WMT recipes, the size the real-text grid favoured; larger corpora
# and the built-in one keep 32k (docs/PERFORMANCE.md, "The recipe on real text").
SMALL_CORPUS_PAIRS = 1_000_000
SMALL_CORPUS_VOCAB = 16000
CORPUS_VOCAB = 32000
# Within the small-corpus recipe, a corpus of at least LEAN_MIN_PAIRS pairs whose target has few more
# word forms than its source (under RICH_FORMS times the source's distinct words in the same number of
# words: a target language whose words inflect little) trains separate tokenizers of LEAN_VOCAB a side.
# LEAN_VOCAB is the size the real-text grid chose for such targets; targets rich in forms kept
# SMALL_CORPUS_VOCAB, and CJK targets (no spaces between words) count as rich (docs/PERFORMANCE.md,
# "The recipe on real text": the tables of the vocabulary by the target's word forms and the rule's own runs).
LEAN_VOCAB = 4000
LEAN_MIN_PAIRS = 20_000
RICH_FORMS = 1.3
# Within the small-corpus recipe, where neither --src-vocab nor --tgt-vocab is given, the source's
# tokenizer asks at most SOURCE_PER_TARGET times the target's pieces. A target written without spaces
# is capped low (tokenizer.vocab_cap: a few pieces per character), and an English source at the full
# size beside it keeps nearly whole words that the corpus sees too few times to learn; on Japanese the
# capped source scored above the defaults on every seed, on Chinese within noise of them. Every spaced
# target measured has at least its source's pieces, so there it changes nothing (docs/PERFORMANCE.md,
# "The recipe on real text", the block on the source's cap, has the runs).
SOURCE_PER_TARGET = 1.5
# Within the small-corpus recipe, a target written without spaces (Chinese, Japanese: tokenizer.is_unspaced)
# whose --tgt-vocab is not given (and no --shared-vocab: one tokenizer of both sides keeps the tokenizer's
# own cap) keeps at most SMALL_CORPUS_PIECES_PER_CHARACTER pieces per distinct character of its text, not
# the tokenizer's PIECES_PER_CHARACTER: its characters and the few merges that the rarest characters
# (outside SentencePiece's character coverage) leave room for. Halving the vocabulary twice from 4 per
# character, each step scored above the step before on Japanese (the grid) and no lower on Chinese (held
# out); one per character is the floor (fewer pieces would leave characters out). The source follows it
# through SOURCE_PER_TARGET (docs/PERFORMANCE.md, "The recipe on real text", the blocks on the pieces per
# character).
SMALL_CORPUS_PIECES_PER_CHARACTER = 1
# Sentences per batch where --batch-size is not given (batches by sentences: --max-tokens 0, the CPU
# default): SENTENCE_BATCH, the seed trainer's, on a GPU; CPU_SENTENCE_BATCH on the CPU, where the
# built-in corpus's run reached a lower validation loss in less time with it than with half or twice as many
# (docs/PERFORMANCE.md, "CPU: the bare `streamnmt train`").
SENTENCE_BATCH = 32
CPU_SENTENCE_BATCH = 64
# Model presets sized for a GPU: the larger built-in corpus, the paper's warm-up. Declared here, below
# streamnmt.config, because the tokenizers' child (torch-free, in data/) guesses the corpus's size too.
GPU_PRESETS = ("base", "big", "iwslt")


def builtin_size_for(preset: str) -> int:
    """The built-in corpus's training pairs where --builtin-size is not given, for the model preset
    run (resolved: "auto" is base on a GPU, small on CPU)."""
    return 40000 if preset in GPU_PRESETS else 16000


def small_corpus(pairs: int | None) -> bool:
    """A --data corpus (``pairs`` its training pairs; None: the built-in one) the small-corpus recipe fits."""
    return pairs is not None and pairs < SMALL_CORPUS_PAIRS


def auto_vocab(pairs: int | None, forms: float | None = None) -> int:
    """Pieces per tokenizer when --src-vocab/--tgt-vocab are not given (``pairs`` None: the built-in
    corpus); ``forms``: the target's word forms over the source's (:func:`lean_target`), None where
    not counted (a shared tokenizer)."""
    if not small_corpus(pairs):
        return CORPUS_VOCAB
    return LEAN_VOCAB if lean_target(pairs, forms) else SMALL_CORPUS_VOCAB


def source_vocab(asked: int, target_pieces: int) -> int:
    """The source's pieces asked by the small-corpus rule: ``asked`` (:func:`auto_vocab`'s), at most
    SOURCE_PER_TARGET times the ``target_pieces`` of the target's tokenizer."""
    return min(asked, round(SOURCE_PER_TARGET * target_pieces))


def lean_target(pairs: int | None, forms: float | None) -> bool:
    """A corpus the lean vocabulary (LEAN_VOCAB a side) fits: at least LEAN_MIN_PAIRS pairs, a target with under
    RICH_FORMS times the source's word forms."""
    return pairs is not None and pairs >= LEAN_MIN_PAIRS and forms is not None and forms < RICH_FORMS


@dataclass(kw_only=True)
class DataConfig:
    data: str | None = opt(None, "corpus directory (train/dev/test .json, .jsonl, .tsv or .en/.zh pairs); "
                                 "none = the built-in English->Chinese corpus")
    src_lang: str = opt("en", "source-language key in JSON records / file extension")
    tgt_lang: str = opt("ch", "target-language key in JSON records / file extension")
    # --tokenizer-eng/--tokenizer-chn: the seeds' names for these flags (English->Chinese), still read
    tokenizer_src: str | None = opt(None, "existing SentencePiece model for the source side (default: "
                                          "DIR/tokenizer/src.model, trained there when absent)",
                                    aliases=("tokenizer_eng",))
    tokenizer_tgt: str | None = opt(None, "existing SentencePiece model for the target side (default: "
                                          "DIR/tokenizer/tgt.model, trained there when absent)",
                                    aliases=("tokenizer_chn",))
    shared_vocab: bool = opt(False, "one SentencePiece model for both sides, trained on both sides' text "
                                    "(DIR/tokenizer/shared.model; needed by --tie-embeddings all)")
    src_vocab: int | None = opt(None, "source SentencePiece vocabulary size when training one (capped for "
                                      f"small corpora); default: {SMALL_CORPUS_VOCAB} for a --data corpus under "
                                      f"{SMALL_CORPUS_PAIRS:,} training pairs ({LEAN_VOCAB} from {LEAN_MIN_PAIRS:,} "
                                      "pairs where the target has few more word forms than the source; "
                                      f"where --tgt-vocab is not given either, at most {SOURCE_PER_TARGET}x the "
                                      f"target's pieces), else {CORPUS_VOCAB}")
    tgt_vocab: int | None = opt(None, "target SentencePiece vocabulary size when training one (capped for "
                                      "small corpora); default: as --src-vocab's, and for a --data corpus under "
                                      f"{SMALL_CORPUS_PAIRS:,} pairs whose target is written without spaces (no "
                                      f"--shared-vocab) at most {SMALL_CORPUS_PIECES_PER_CHARACTER} per "
                                      "distinct character")
    batch_size: int | None = opt(None, "sentences per batch (when --max-tokens is 0); default: "
                                       f"{CPU_SENTENCE_BATCH} on the CPU, {SENTENCE_BATCH} on a GPU")
    max_tokens: int | None = opt(None, "token budget per batch (padded tokens, the longer side); 0 = batch by "
                                       "sentences; default: on a GPU a budget sized for it (see "
                                       "streamnmt.config.recipe_max_tokens), on CPU 0")
    max_len: int = opt(128, "longest sentence in tokens (bos/eos included) the model is fed")
    overlong: str = opt("drop", "training pairs with a side over --max-len: drop them (their halves would no "
                                "longer match if cut) or truncate them; dev and test pairs are always truncated",
                        choices=("truncate", "drop"))
    pack: bool | None = opt(None, "pack several sentence pairs into each training row (one batch shape, little "
                                  "padding; validation stays one sentence per row); --no-pack = length buckets; "
                                  "default: on with a token budget (--max-tokens), off when batching by sentences "
                                  "(a packed row holds as many sentences as fit, not --batch-size)")
    pad_multiple: int = opt(8, "padded lengths are rounded up to a multiple of this (bounds batch shapes)")
    pack_width: int | None = opt(None, "target positions of a packed row (rounded up to --pad-multiple; at least "
                                       "the longest training target); default --max-len. Narrow rows were "
                                       "slower on a GPU: attention kernels work in tiles of 64-128 positions "
                                       "(docs/PERFORMANCE.md, 'The packed shape')")
    workers: int = opt(0, "DataLoader worker processes (0 = load in the main process, except under the "
                          "strategies that load in workers, 'full' (the CPU's default) and 'graph' (CUDA's): "
                          "they take min(4, cores))")
    prefetch_factor: int = opt(4, "batches each worker loads ahead")
    builtin_size: int | None = opt(None, "sentence pairs in the built-in corpus's training split "
                                         "(default: 40000; 16000 for the CPU presets)")
    tokenizer_sample: int = opt(300000, "training pairs sampled (seeded) to train a SentencePiece model "
                                        "when none exists; more is slower and rarely better")

    def __post_init__(self) -> None:
        check(self.src_vocab is None or self.src_vocab >= 16, "src_vocab", f"must be at least 16; got {self.src_vocab}")
        check(self.tgt_vocab is None or self.tgt_vocab >= 16, "tgt_vocab", f"must be at least 16; got {self.tgt_vocab}")
        check(self.batch_size is None or self.batch_size > 0, "batch_size",
              f"must be a positive integer; got {self.batch_size}")
        check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
              f"must be 0 (off) or a positive integer; got {self.max_tokens}")
        check(self.max_len >= 4, "max_len", f"must be at least 4; got {self.max_len}")
        check(_key(self.src_lang) != _key(self.tgt_lang), "tgt_lang", f"must differ from --src-lang "
              f"({self.src_lang}): one key pairs each sentence with itself")
        check_choice(self.overlong, "overlong", ("truncate", "drop"))
        check(self.pad_multiple >= 1, "pad_multiple", f"must be a positive integer; got {self.pad_multiple}")
        check(not self.max_tokens or self.max_tokens >= self.max_len, "max_tokens",
              f"must be at least --max-len ({self.max_len}) so the longest sentence fits; got {self.max_tokens}")
        check(self.pack_width is None or 2 <= self.pack_width <= self.max_len, "pack_width",
              f"must be from 2 to --max-len ({self.max_len}); got {self.pack_width}")
        check(self.workers >= 0, "workers", f"must be 0 or more; got {self.workers}")
        check(self.prefetch_factor >= 1, "prefetch_factor", f"must be at least 1; got {self.prefetch_factor}")
        check(self.builtin_size is None or self.builtin_size >= 100, "builtin_size",
              f"must be at least 100; got {self.builtin_size}")
        check(not (self.shared_vocab and self.tokenizer_src and self.tokenizer_tgt
                   and self.tokenizer_src != self.tokenizer_tgt), "shared_vocab",
              "uses one SentencePiece model for both sides, but --tokenizer-src and --tokenizer-tgt name two "
              "files: give the shared model once (--tokenizer-src) or drop --shared-vocab")
        check(self.tokenizer_sample >= 100, "tokenizer_sample",
              f"must be at least 100; got {self.tokenizer_sample}")

    @property
    def packs(self) -> bool:
        """Whether training batches are packed (``pack`` resolved)."""
        return self.pack if self.pack is not None else bool(self.max_tokens)

    @property
    def sentences(self) -> int:
        """Sentences per batch (``batch_size`` resolved: the run's recipe sets it by device)."""
        return self.batch_size or SENTENCE_BATCH

    @property
    def builtin_pairs(self) -> int:
        return self.builtin_size or 40000


def builtin_dir(cfg: DataConfig) -> Path:
    """Where the built-in corpus of ``cfg``'s size is written (and its tokenizers trained)."""
    return streamnmt_home() / f"builtin-{cfg.builtin_pairs}"


def _key(lang: str) -> str:
    """A record key as the readers take it (``ch`` and ``zh`` name one language's files and records)."""
    return "zh" if lang == "ch" else lang
