"""SentencePiece tokenizers: load a model, or train one from the training split.

The trainer, the decoder and BLEU all need the same two things from a tokenizer: text to ids and
ids back to text, with the special ids fixed by :mod:`streamnmt.models.specials` (pad 0, unk 1,
bos 2, eos 3). Training is seeded (:data:`SPM_SEED`), so the same sample on the same number of
threads gives the same model (SentencePiece splits its sentences over its threads).
:class:`Tokenizer` wraps one SentencePiece model file and refuses a model whose special ids differ;
:func:`train_tokenizer` builds one quietly from a sample of sentences, capping the vocabulary for
small corpora, and writes it atomically; :func:`train_shared_tokenizer` builds one model for both
sides (``--shared-vocab``, for tied source/target embeddings). No torch: the tokenizers may be
trained in a child process that imports none (:mod:`streamnmt.data.tokenizer_child`).
"""

from __future__ import annotations

import hashlib
import io
import os
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from streamnmt import setupclock
from streamnmt.errors import InputError
from streamnmt.fsutil import atomic_write
from streamnmt.models.specials import BOS, EOS, PAD, UNK

# Languages written without spaces between words: SentencePiece keeps rare characters out of the
# vocabulary (they become UNK) and the text is not NFKC-folded, so that decoded output keeps the
# full-width punctuation of the references BLEU compares it with.
# The keys of Chinese, Japanese and Korean: ISO 639-1's, the project's own ``ch``, country codes, ISO
# 639-2/3 codes and FLORES-200's (the part before ``_``: zh_CN, zh-TW, ja_JP, zho_Hans, jpn_Jpan count
# too); BLEU's tokenizer reads the same keys (streamnmt.inference.scoreworker.ALIASES, held together by
# a test).
CJK = {"zh", "ch", "cn", "zho", "chi", "cmn", "yue", "ja", "jp", "jpn", "ko", "kr", "kor"}
# Korean spaces its words: its script takes CJK's settings, but not the rules for text without spaces
SPACED_CJK = {"ko", "kr", "kor"}
SPM_SEED = 0  # SentencePiece's random generator (sentence shuffling, sampling) before each training


def cpu_threads() -> int:
    """SentencePiece's threads: the cores this process may run on."""
    return setupclock.usable_cores()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Tokenizer:
    """One SentencePiece model: ``encode`` gives ids without bos/eos; ``decode`` undoes it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"{self.path}: tokenizer model not found") from None
        except OSError as e:
            raise InputError(f"{self.path}: cannot read tokenizer model: {e.strerror}") from None
        self._load(data)

    @classmethod
    def from_bytes(cls, data: bytes, name: str) -> Tokenizer:
        """A tokenizer from a model's bytes (e.g. embedded in a checkpoint); ``name`` is for messages."""
        tok = cls.__new__(cls)
        tok.path = Path(name)
        tok._load(data)
        return tok

    def model_bytes(self) -> bytes:
        """The SentencePiece model as loaded (the bytes of its .model file, whose hash is ``sha256``)."""
        return self._bytes

    def _load(self, data: bytes) -> None:
        self.sha256 = hashlib.sha256(data).hexdigest()
        self._bytes = data
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as e:
            raise InputError(f"{self.path}: not a SentencePiece model ({e})") from None
        ids = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if ids != (PAD, UNK, BOS, EOS):
            raise InputError(f"{self.path}: special ids are pad={ids[0]} unk={ids[1]} bos={ids[2]} "
                             f"eos={ids[3]}; streamnmt needs pad=0 unk=1 bos=2 eos=3 (retrain with "
                             f"--pad_id=0 --unk_id=1 --bos_id=2 --eos_id=3)")
        self.vocab_size: int = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """Encode many sentences in SentencePiece's C++ threads (``threads`` 0 = all cores)."""
        return self._sp.encode(list(texts), num_threads=threads or cpu_threads())

    def decode(self, ids: Iterable[int] | Any) -> str:
        """Text of ``ids`` (a list, array or tensor): stops at EOS, skips PAD and BOS."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()  # note: a host sync if ``ids`` is a CUDA tensor
        out = []
        for i in ids:
            if i == EOS:
                break
            if i not in (PAD, BOS):
                out.append(int(i))
        return self._sp.decode(out)

    def piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    # Picklable (e.g. into DataLoader workers): the model travels as its path.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])


def is_cjk(lang: str) -> bool:
    """``lang`` (a language key: ``zh``, ``zh_CN``, ``zh-TW``, ``ja_JP`` alike) names a language of
    :data:`CJK`."""
    return _language(lang) in CJK


def is_unspaced(lang: str) -> bool:
    """``lang`` names a language of :data:`CJK` written without spaces between words (not Korean)."""
    return is_cjk(lang) and _language(lang) not in SPACED_CJK


def _language(key: str) -> str:
    return key.lower().replace("-", "_").split("_")[0]


def train_tokenizer(sentences: Sequence[str], target: Path, vocab_size: int, lang: str, *,
                    threads: int = 0, log: Callable[[str], None] = print, name: str = "",
                    cap: int | None = None, cap_why: str = "") -> Tokenizer:
    """Train a unigram SentencePiece model on ``sentences`` and write it atomically to ``target``.

    ``vocab_size`` is capped at :func:`vocab_cap` (``cap``: that cap, where the caller has counted it
    already; ``cap_why``: its reason, where not the corpus's size) and passed as a soft limit
    (``hard_vocab_limit=False``): a small corpus gets a smaller vocabulary, reported in one log line.
    """
    cjk = is_cjk(lang)
    cap = vocab_cap(sentences, vocab_size, cjk) if cap is None else cap
    return _train(sentences, target, vocab_size, cap, cjk, threads=threads, log=log, name=name, cap_why=cap_why)


def train_shared_tokenizer(src: Sequence[str], tgt: Sequence[str], target: Path, vocab_size: int,
                           src_lang: str, tgt_lang: str, *, threads: int = 0,
                           log: Callable[[str], None] = print) -> Tokenizer:
    """One model for both sides (``--shared-vocab``), trained on both sides' sentences.

    The cap is the sum of each side's :func:`vocab_cap`; when either side is written without
    spaces, the CJK settings apply (no NFKC folding, character coverage 0.9995), so that the
    target's full-width punctuation survives as it does with a target-only model.
    """
    src_cjk, tgt_cjk = is_cjk(src_lang), is_cjk(tgt_lang)
    cap = min(vocab_size, vocab_cap(src, vocab_size, src_cjk) + vocab_cap(tgt, vocab_size, tgt_cjk))
    return _train([*src, *tgt], target, vocab_size, cap, src_cjk or tgt_cjk, threads=threads, log=log,
                  name="shared tokenizer")


def _train(sentences: Sequence[str], target: Path, vocab_size: int, cap: int, cjk: bool, *,
           threads: int, log: Callable[[str], None], name: str, cap_why: str = "") -> Tokenizer:
    model = io.BytesIO()
    if hasattr(spm, "set_random_generator_seed"):  # sentencepiece >= 0.1.92
        spm.set_random_generator_seed(SPM_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model,
            model_type="unigram", vocab_size=cap, hard_vocab_limit=False,
            character_coverage=0.9995 if cjk else 1.0,
            normalization_rule_name="identity" if cjk else "nmt_nfkc",
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            input_sentence_size=len(sentences) if len(sentences) > 100 else 0,  # its minimum is 101
            shuffle_input_sentence=True,
            num_threads=threads or cpu_threads(), minloglevel=2)
    except RuntimeError as e:
        raise InputError(f"{target}: SentencePiece training failed: {e}") from None
    data = model.getvalue()
    try:
        atomic_write(target, data)
    except OSError as e:
        raise InputError(f"{target}: cannot write the tokenizer ({e.strerror}); pass existing models "
                         f"with --tokenizer-src/--tokenizer-tgt or use a writable data directory") from None
    tok = Tokenizer(target)
    if tok.vocab_size < vocab_size:
        log(f"data: {name or target.name}: vocabulary capped at {tok.vocab_size} pieces (asked for "
            f"{vocab_size}): {cap_why or 'the corpus is too small to use more'}")
    return tok


# Pieces per distinct character of text without spaces: the WMT recipes' vocabulary over the characters
# of real Chinese text (docs/PERFORMANCE.md, "The recipe on real text", the block on the pieces per
# character); the small-corpus rule asks fewer (data.config).
PIECES_PER_CHARACTER = 4


def vocab_cap(sentences: Sequence[str], vocab_size: int, cjk: bool = False,
              per_character: int = PIECES_PER_CHARACTER) -> int:
    """``vocab_size``, or less for a corpus too small to use it; never below its characters.

    Space-separated text: distinct words + distinct characters (+4 specials). A vocabulary that
    can hold every word whole gains nothing from more pieces; SentencePiece's unigram trainer,
    which prunes only down to the size asked for, would fill the rest with unused substrings.
    Text without spaces (``cjk``): ``per_character`` pieces per distinct character.
    """
    words: set[str] = set()
    # the space counts as a character even in text without any: SentencePiece's word-boundary mark
    # starts every sentence, and a cap of one piece per character must leave it a place
    chars: set[str] = {" "}
    for k, s in enumerate(sentences):
        if not cjk:
            words.update(s.split())
        chars.update(s)
        if k % 1024 == 1023 and _cap(words, chars, cjk, per_character) >= vocab_size:
            return vocab_size
    return min(vocab_size, _cap(words, chars, cjk, per_character))


def min_pieces(sentences: Sequence[str], cjk: bool = False) -> int:
    """The fewest pieces a model of ``sentences`` trains with where every character is needed (full
    character coverage, or every character frequent): one per distinct character, the word-boundary
    mark among them (see :func:`vocab_cap`), and the 4 specials. Text with spaces is NFKC-folded before
    SentencePiece counts its characters, and folding can make new ones (``½`` -> ``1⁄2``): both
    forms are counted."""
    chars: set[str] = {" "}
    for s in sentences:
        chars.update(s)
        if not cjk:
            chars.update(unicodedata.normalize("NFKC", s))
    return _cap(set(), chars, True, 1)


def _cap(words: set[str], chars: set[str], cjk: bool, per_character: int) -> int:
    return (per_character * len(chars) if cjk else len(words) + len(chars)) + 4
