"""Training a corpus's tokenizers: which SentencePiece models ``prepare_data`` trains, and the training.

:func:`sides` names the models a config's run uses (given by --tokenizer-src/--tokenizer-tgt, else
``DIR/tokenizer/{src,tgt}.model`` (:func:`corpus_model`), or ``shared.model`` with --shared-vocab);
:func:`to_train` those of them not there yet, or not trained for this run's languages, size and training
split (:func:`misfit`, from the record beside each model). :func:`train` trains those: a seeded sample of the
training split read in one streaming pass (and its first pairs again for the word forms,
:func:`~streamnmt.data.writing.corpus_word_forms`), dev and test read through once (a bad record stops the
run before a model is written), the sizes asked (the corpus rule's
:func:`~streamnmt.data.config.auto_vocab` where --src-vocab/--tgt-vocab are not given, a target without
spaces within :func:`target_cap`, the source within :func:`source_within_target`), the two sides at
once on SentencePiece's threads.

No torch here, nor numpy: :mod:`streamnmt.data.tokenizer_child` runs this very code in a child
process started at the command's start, ``prepare_data`` in-process where no child did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from streamnmt.data.config import (LEAN_MIN_PAIRS, RICH_FORMS, SMALL_CORPUS_PIECES_PER_CHARACTER, SOURCE_PER_TARGET,
                                   DataConfig, auto_vocab, lean_target, small_corpus, source_vocab)
from streamnmt.data.readers import ReadStats, SplitSource, find_split, iter_pairs
from streamnmt.data.tokenizer import (Tokenizer, cpu_threads, file_sha256, is_cjk, is_unspaced, min_pieces, train_shared_tokenizer,
                                      train_tokenizer, vocab_cap)
from streamnmt.data.writing import FORM_WINDOW, corpus_word_forms, written_language
from streamnmt.errors import InputError
from streamnmt.fsutil import atomic_write

Log = Callable[[str], None]

# The DataConfig fields that sides() and train() read: a child's models serve a run whose fields agree
FIELDS = ("data", "src_lang", "tgt_lang", "tokenizer_src", "tokenizer_tgt", "shared_vocab", "src_vocab",
          "tgt_vocab", "tokenizer_sample")
# A corpus's own models, by side; before the rename the seeds' English->Chinese names, which a corpus
# folder an older version trained in still holds: found there, they are used as they are.
CORPUS_MODELS = {"source": "src.model", "target": "tgt.model"}
OLDER_CORPUS_MODELS = {"source": "eng.model", "target": "chn.model"}


def corpus_model(directory: Path, role: str) -> Path:
    """The corpus's own model of side ``role`` ("source" or "target") under ``DIR/tokenizer/``: the
    older name where only it is there, else the current one (trained there when absent)."""
    folder = Path(directory) / "tokenizer"
    current, older = folder / CORPUS_MODELS[role], folder / OLDER_CORPUS_MODELS[role]
    return older if older.is_file() and not current.is_file() else current


@dataclass(frozen=True)
class Side:
    """One model a run uses. ``role``: "source", "target" or "shared" (the key of the sizes asked)."""

    role: str
    path: Path
    given: bool  # named by --tokenizer-src/--tokenizer-tgt
    size: int | None  # the size asked; None: the corpus rule's
    name: str  # for log lines
    misfit: str | None = None  # why the model on disk does not serve this run (:func:`misfit`): trained again

    @property
    def found(self) -> bool:
        """Used as it is (given, or on disk and trained for this run's request): not trained."""
        return self.given or (self.path.is_file() and self.misfit is None)


def sides(cfg: DataConfig, directory: Path) -> list[Side]:
    """The source and target models, or with --shared-vocab the one model of both sides (the
    larger of --src-vocab/--tgt-vocab where either is given)."""
    if cfg.shared_vocab:
        given = cfg.tokenizer_src or cfg.tokenizer_tgt
        asked = [v for v in (cfg.src_vocab, cfg.tgt_vocab) if v is not None]
        plan = [Side("shared", Path(given or directory / "tokenizer" / "shared.model"), bool(given),
                     max(asked) if asked else None, "shared tokenizer")]
    else:
        plan = [Side("source", Path(cfg.tokenizer_src or corpus_model(directory, "source")),
                     cfg.tokenizer_src is not None, cfg.src_vocab, "source tokenizer"),
                Side("target", Path(cfg.tokenizer_tgt or corpus_model(directory, "target")),
                     cfg.tokenizer_tgt is not None, cfg.tgt_vocab, "target tokenizer")]
    files = train_files(cfg, directory)
    out: list[Side] = []
    for side in reversed(plan):  # the target first: a source whose size follows it must know its model
        target = _follows(cfg, out[0]) if side.role == "source" else None
        out.insert(0, dataclasses.replace(side, misfit=misfit(side, request(cfg, side, files), target)))
    return out


# What a corpus's model was trained for, written beside it (record_path): a model found on disk serves a
# run only where it was trained for that run's languages, size and training split (misfit); else it is
# trained again, as a fresh corpus folder's would be, and the run's flags take effect.
def record_path(model: Path) -> Path:
    """The record of what ``model`` was trained for: ``src.model.json`` beside ``src.model``."""
    return model.with_name(model.name + ".json")


def train_files(cfg: DataConfig, directory: Path, hashed: bool = False) -> tuple[list | None, list[str]]:
    """The training split's files as a record names them (name, bytes, modification time; ``hashed``:
    their SHA-256 too, which the record keeps: a copied or touched corpus of the same bytes is the same;
    None where there is no split), and where they lie now."""
    try:
        train = find_split(directory, "train", cfg.src_lang, cfg.tgt_lang)
        if train is None:
            return None, []
        return ([[p.name, p.stat().st_size, p.stat().st_mtime_ns, *([file_sha256(p)] if hashed else [])]
                 for p in train.paths], [str(p) for p in train.paths])
    except OSError:
        return None, []


def request(cfg: DataConfig, side: Side, files: tuple[list | None, list[str]]) -> dict:
    """What ``side``'s model is asked to be trained for: the language key(s) of its side(s), the size
    asked (None: the corpus rule's) and the training split's ``files`` (:func:`train_files`)."""
    langs = {"source": [cfg.src_lang], "target": [cfg.tgt_lang]}.get(side.role, [cfg.src_lang, cfg.tgt_lang])
    return {"langs": langs, "size": side.size, "train": files[0], PATHS: files[1]}


PATHS = "paths"  # the request's training files where they lie now: compared, not recorded


def follows_target(cfg: DataConfig) -> bool:
    """The source's size follows the target's pieces (:func:`source_within_target`: neither size given,
    two models; on a small corpus)."""
    return cfg.src_vocab is None and cfg.tgt_vocab is None and not cfg.shared_vocab


def _follows(cfg: DataConfig, target: Side) -> str | None:
    """For a source whose size follows the target's pieces (:func:`follows_target`): the hash of the target
    model it is used beside, "" where that one is trained now; None where the source's size is its own."""
    if not follows_target(cfg) or target.role != "target":
        return None
    return file_sha256(target.path) if target.found and target.path.is_file() else ""


def misfit(side: Side, asked: dict, target: str | None = None) -> str | None:
    """Why the model on disk at ``side.path`` does not serve a run that asks ``asked`` (:func:`request`;
    ``target``: :func:`_follows`); None where it does, or where there is none, or it is given
    (--tokenizer-src/--tokenizer-tgt: used as it is). A model without a record of its bytes (trained by an
    earlier version, or put there by hand) serves as it is and is never overwritten (:func:`unrecorded`);
    one whose training was cut short (its record says pending) is trained again."""
    record = None if side.given or not side.path.is_file() else _record(side.path)
    if record is None:
        return None
    if record.get("pending"):
        return "left by a training cut short"
    if record.get("langs") != asked["langs"]:
        return f"trained for {'/'.join(map(str, record.get('langs') or []))}, not {'/'.join(asked['langs'])}"
    holds = record.get("size") != asked["size"] and _holds(side.path, record.get("size"), asked["size"])
    if record.get("size") != asked["size"] and not holds:
        return f"trained for {_size(record.get('size'))}, not {_size(asked['size'])}"
    if not _same_files(record.get("train"), asked["train"], asked[PATHS]):
        return "trained on another version of the training split"
    if side.role == "source" and record.get("target") != target and not holds:
        if target is None:  # a size of its own now (--src-vocab or --tgt-vocab given)
            return "trained at a size that followed the target's pieces, which no size given now asks"
        return "trained beside another target model (its size follows the target's pieces)"
    return None


def _holds(path: Path, recorded: object, asked: object) -> bool:
    """A model the corpus rule sized that has just the pieces now asked serves that ask: replaying a
    run's config.yaml (which records the sizes the rule chose) trained the tokenizers again, and the
    next run without sizes trained them back."""
    if recorded is not None or not isinstance(asked, int):
        return False
    try:
        return Tokenizer(path).vocab_size == asked
    except InputError:  # not a model SentencePiece reads: trained again
        return False


def _same_files(recorded: object, now: list | None, paths: list[str]) -> bool:
    """The training split's files are those the record names: the same names and sizes, and the same
    modification times or, where those differ (a copy, a touch), the same bytes."""
    if not isinstance(recorded, list) or now is None or len(recorded) != len(now) or len(paths) != len(now):
        return recorded == now
    for old, new, path in zip(recorded, now, paths):
        if not isinstance(old, list) or old[:2] != new[:2]:
            return False
        if old[2:3] != new[2:3] and old[3:] != [file_sha256(Path(path))]:
            return False
    return True


def refresh_record(cfg: DataConfig, directory: Path, side: Side) -> None:
    """A model found whose training files matched their record by their bytes, not their times (a copied
    or touched corpus): the times written into the record, so that later runs compare times, not bytes."""
    record = None if side.given or not side.path.is_file() else _record(side.path)
    old, now = (record or {}).get("train"), train_files(cfg, directory)[0]
    if record is None or record.get("pending") or not isinstance(old, list) or now is None or len(old) != len(now):
        return
    if all(isinstance(o, list) and o[2:3] == n[2:3] for o, n in zip(old, now)):
        return
    record["train"] = [[*n[:3], *o[3:]] for o, n in zip(old, now)]
    atomic_write(record_path(side.path), json.dumps(record))


def _record(model: Path) -> dict | None:
    """The record beside ``model`` where it is this model's (its hash the model's bytes', or pending: a
    training of it began and did not end), else None (none, or another model's: replaced by hand)."""
    try:
        record = json.loads(record_path(model).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return record if record.get("pending") or record.get("sha256") == file_sha256(model) else None


def unrecorded(side: Side) -> str | None:
    """For the log: a model found without a record of its bytes, used as it is although a size asked
    differs from its own (trained by an earlier version, or put there by hand; None otherwise)."""
    if side.given or side.size is None or not side.path.is_file() or _record(side.path) is not None:
        return None
    pieces = Tokenizer(side.path).vocab_size
    return None if pieces == side.size else (
        f"{side.path} has {pieces} pieces, not the {side.size} asked, and no record of what it was trained for "
        f"(an earlier version's, or put there by hand): used as it is; remove it to train one for this run")


def _size(size: int | None) -> str:
    return "the corpus rule's size" if size is None else f"{size} pieces asked"


def write_record(side: Side, tok: Tokenizer | None, asked: dict, target: str | None = None) -> None:
    """Record beside ``side``'s model what it is trained for: pending (``tok`` None) before its training
    begins, so that a run killed before the end leaves a model that is trained again; then the model's
    hash with the request (``target``: the target model's hash, for a source whose size follows it)."""
    done = {"pending": True} if tok is None else {"sha256": tok.sha256, "pieces": tok.vocab_size}
    extra = {} if target is None else {"target": target}
    kept = {k: v for k, v in asked.items() if k != PATHS}
    atomic_write(record_path(side.path), json.dumps({**done, **kept, **extra}))


@contextlib.contextmanager
def models_lock(directory: Path) -> Iterator[None]:
    """Held while a job finds or trains ``directory``'s models: jobs started at once on one corpus take
    turns, the later ones finding the models the first trained (two trainings at once could write
    different bytes, their SentencePiece threads differing). Not held where the folder cannot be
    opened or locked (a read-only folder; NFS, whose locks need a file open for writing): as before."""
    try:
        fd = os.open(directory, os.O_RDONLY)  # the corpus folder itself: no file of its own left behind
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor closes
        except OSError:
            os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def to_train(cfg: DataConfig, directory: Path) -> list[Side]:
    """The models ``prepare_data`` would train now (empty: every one given or found)."""
    return [side for side in sides(cfg, directory) if not side.found]


def spm_threads(models: int) -> int:
    """SentencePiece threads for each of ``models`` trained at once. A model's bytes depend on this
    number (SentencePiece splits its sentences over its threads), so a child process training them
    is given this process's number rather than working out its own."""
    return max(1, cpu_threads() // models)


def run_models(cfg: DataConfig) -> int:
    """The models a run uses (2, or 1 shared), the number :func:`spm_threads` divides by whether both are
    trained or one is found: a model trained again alone has the bytes it has beside its partner."""
    return 1 if cfg.shared_vocab else 2


@dataclass
class Trained:
    tokenizers: dict[str, Tokenizer]  # role -> the model written
    auto: dict[str, int]  # role -> the size the corpus rule asked (a size not given)
    pairs: int  # training pairs read (what the corpus rule counts)
    why: dict[str, str] = field(default_factory=dict)  # role -> why the rule asked or capped it apart from its size


def train(cfg: DataConfig, directory: Path, sources: dict[str, SplitSource | None], missing: list[Side],
          log: Log, threads: int | None = None) -> Trained:
    """Train the models ``missing`` (from :func:`to_train`), on ``threads`` SentencePiece threads
    each (default :func:`spm_threads`), and write them atomically."""
    t0 = time.perf_counter()
    for side in missing:
        if side.misfit:
            log(f"data: {side.name}: {side.path} was {side.misfit}: trained again")
    # what each model is trained for, taken before the training split is read (its records say it after)
    files = train_files(cfg, directory, hashed=True)  # read once for every side's record
    wanted = {side.role: request(cfg, side, files) for side in missing}
    samples, pairs = sample_train(cfg, sources["train"])
    check_other_splits(cfg, sources)
    previous = {side.role: _text(record_path(side.path)) for side in missing}
    models = {side.role: _identity(side.path) for side in missing}
    for side in missing:  # a run killed from here on leaves models that are trained again
        write_record(side, None, wanted[side.role])
    try:
        return _trained(cfg, directory, sources, missing, log, threads, samples, pairs, wanted, t0)
    except Exception:  # a training that fails (not a kill): the records say what the models on disk are again
        for side in missing:
            if _identity(side.path) == models[side.role]:
                _restore(record_path(side.path), previous[side.role])
            elif models[side.role] is None:  # this run's model of a side trained beside one that failed:
                side.path.unlink(missing_ok=True)  # without a record it would be used as it is for good
                record_path(side.path).unlink(missing_ok=True)
            # else: a model replaced by this run keeps its pending record, and is trained again
        raise


def _identity(path: Path) -> tuple[int, int, int] | None:
    """A file's inode, size and mtime (an atomic write makes a new inode), or None if there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _restore(path: Path, text: str | None) -> None:
    if text is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, text)


def _trained(cfg: DataConfig, directory: Path, sources: dict[str, SplitSource | None], missing: list[Side], log: Log,
             threads: int | None, samples: tuple[list[str], list[str]], pairs: int, wanted: dict[str, dict],
             t0: float) -> Trained:
    """:func:`train` once the sample is read and the records say pending."""
    counted = None if cfg.data is None else pairs  # the built-in corpus: None
    training = {side.role for side in missing}  # a side whose model is found keeps the key: nothing to say
    src_lang, tgt_lang = (read_language(key, sample, role, log) if training & {role, "shared"} else key
                          for key, sample, role in ((cfg.src_lang, samples[0], "source"),
                                                    (cfg.tgt_lang, samples[1], "target")))
    forms = None
    if missing[0].role != "shared" and small_corpus(counted) and any(side.size is None for side in missing):
        # a source without spaces would count each run of its letters as one word, and the ratio call any
        # target poor in word forms: not what the lean rule was chosen on
        forms, unspaced = corpus_word_forms(iter_pairs(sources["train"], cfg.src_lang, cfg.tgt_lang), cfg.src_lang)
        if unspaced:
            log(f"data: the source is written without spaces: the word forms are not counted; "
                f"{auto_vocab(counted)} pieces where no size is given")
        if forms is not None:
            log(f"data: the target has {forms:.2f}x the source's word forms (distinct words in the first "
                f"{FORM_WINDOW:,} of each side's); {auto_vocab(counted, forms)} pieces where no size is given "
                f"({'the lean vocabulary' if lean_target(counted, forms) else 'not the lean vocabulary'}: "
                f"it needs under {RICH_FORMS}x and at least {LEAN_MIN_PAIRS:,} pairs)")
    rule = auto_vocab(counted, forms)
    asked = {side.role: side.size or rule for side in missing}
    caps: dict[str, int] = {}  # the target's vocab_cap, counted here once for the rule and its training
    why: dict[str, str] = {}  # role -> why the rule asked or capped that side apart from its size (the start line says it)
    if "target" in asked and small_corpus(counted):
        caps["target"], why["target"] = target_cap(cfg, samples[1], asked["target"], tgt_lang)
    if "source" in asked and small_corpus(counted) and cfg.src_vocab is None:
        asked["source"], why["source"] = source_within_target(cfg, directory, caps.get("target"), asked["source"],
                                                              min_pieces(samples[0], is_cjk(src_lang)), log)
    auto = {side.role: asked[side.role] for side in missing if side.size is None}
    why = {role: reason for role, reason in why.items() if reason}
    threads = threads or spm_threads(run_models(cfg))
    if missing[0].role == "shared":
        (side,) = missing
        tok = train_shared_tokenizer(samples[0], samples[1], side.path, side.size or rule, src_lang,
                                     tgt_lang, threads=threads, log=log)
        write_record(side, tok, wanted[side.role])
        log(f"data: trained the shared tokenizer on both sides of {len(samples[0])} sampled pairs in "
            f"{time.perf_counter() - t0:.1f}s -> {side.path}")
        return Trained({"shared": tok}, auto, pairs, why)
    texts = {"source": samples[0], "target": samples[1]}
    langs = {"source": src_lang, "target": tgt_lang}
    # the target's log line gives the rule's reason for its cap, where the rule (not the corpus's size) set it
    cap_why = why.get("target", "") and f"{why['target']} (the small-corpus rule; --tgt-vocab overrides it)"
    with ThreadPoolExecutor(len(missing)) as pool:  # SentencePiece trains outside the GIL
        jobs = {side.role: pool.submit(train_tokenizer, texts[side.role], side.path, asked[side.role],
                                       langs[side.role], threads=threads, log=log, name=side.name,
                                       cap=caps.get(side.role), cap_why=cap_why if side.role == "target" else "")
                for side in missing}
        toks = {role: job.result() for role, job in jobs.items()}
    target = toks["target"].sha256 if "target" in toks else _follows(cfg, sides(cfg, directory)[1])
    for side in sorted(missing, key=lambda s: s.role != "target"):  # the target's first: the source names it
        follows = side.role == "source" and follows_target(cfg)
        write_record(side, toks[side.role], wanted[side.role], target if follows else None)
    log(f"data: trained {' and '.join(side.name for side in missing)} on {len(samples[0])} sampled "
        f"pairs in {time.perf_counter() - t0:.1f}s -> {directory / 'tokenizer'}")
    return Trained(toks, auto, pairs, why)


def read_language(key: str, sample: list[str], role: str, log: Log) -> str:
    """The language the tokenizers train ``sample`` as: ``key``, or where it names none of Chinese,
    Japanese and Korean but the text is one of them (:func:`~streamnmt.data.writing.written_language`),
    that language, in one log line (BLEU's tokenizer reads the references the same way)."""
    found = written_language(key, sample)
    if found is None:
        return key
    name = {"ja": "Japanese", "ko": "Korean"}.get(found, "Chinese")
    log(f"data: the {role} key {key!r} names none of Chinese, Japanese and Korean, but its text is {name}: "
        f"its tokenizer trains as {found}'s")
    return found


def target_cap(cfg: DataConfig, target_sample: list[str], asked: int, lang: str | None = None) -> tuple[int, str]:
    """The small-corpus target's :func:`~streamnmt.data.tokenizer.vocab_cap` on ``target_sample``
    (``asked``: its size asked), and the cap's reason where the rule set it (the training's log line
    says it): a target without spaces (:func:`~streamnmt.data.tokenizer.is_unspaced`: Chinese, Japanese)
    whose --tgt-vocab is not given keeps at most
    :data:`~streamnmt.data.config.SMALL_CORPUS_PIECES_PER_CHARACTER` pieces per distinct character."""
    lang = lang or cfg.tgt_lang
    cjk = is_cjk(lang)
    if not is_unspaced(lang) or cfg.tgt_vocab is not None:
        return vocab_cap(target_sample, asked, cjk), ""
    cap = vocab_cap(target_sample, asked, True, SMALL_CORPUS_PIECES_PER_CHARACTER)
    if cap >= asked:  # characters enough to fill the size asked: the rule held nothing back
        return cap, ""
    return cap, f"at most {SMALL_CORPUS_PIECES_PER_CHARACTER} per distinct character of a target without spaces"


def source_within_target(cfg: DataConfig, directory: Path, target_pieces: int | None, asked: int, fewest: int,
                         log: Log) -> tuple[int, str]:
    """The source's size where --src-vocab is not given (``asked``: the size the rule asked of it):
    where --tgt-vocab is not given either, within :func:`~streamnmt.data.config.source_vocab` of the
    target's pieces: ``target_pieces`` (the cap of the target trained now, :func:`target_cap`), or None:
    the size of the target model found; never under ``fewest``, the pieces the source's own characters
    need (:func:`~streamnmt.data.tokenizer.min_pieces`: SentencePiece fails below them; a Chinese or
    Japanese source of many characters may need more than the rule asks). Second: why it is not
    ``asked`` (empty where it is)."""
    pieces = None if cfg.tgt_vocab is not None else target_pieces or Tokenizer(sides(cfg, directory)[1].path).vocab_size
    capped = asked if pieces is None else source_vocab(asked, pieces)
    source = max(capped, fewest)
    if source == asked:
        return source, ""
    reason = ", ".join(([f"at most {SOURCE_PER_TARGET}x the target's pieces"] if capped < asked else [])
                       + ([f"raised to the {source} its characters need"] if source > capped else []))
    said = reason.replace("the target's pieces", f"the target's {pieces}")
    hint = ("SentencePiece trains no fewer" if source > capped  # a --src-vocab under them fails, named by file
            else "the small-corpus rule; --src-vocab overrides it")
    log(f"data: the source tokenizer asks {source} pieces, not {asked}: {said} ({hint})")
    return source, reason


def check_other_splits(cfg: DataConfig, sources: dict[str, SplitSource | None]) -> None:
    """Read dev and test through once, so that a bad record stops the run before a tokenizer is written."""
    for split in ("dev", "test"):
        if sources[split] is not None:
            for _ in iter_pairs(sources[split], cfg.src_lang, cfg.tgt_lang):
                pass


def sample_train(cfg: DataConfig, source: SplitSource) -> tuple[tuple[list[str], list[str]], int]:
    """A seeded uniform sample (reservoir) of training pairs, read in one streaming pass, and the
    pairs read (what the corpus rule counts, as the tokenized split's ``read``)."""
    rng = random.Random(0)
    k = cfg.tokenizer_sample
    sample: list[tuple[str, str]] = []
    read = ReadStats()
    for n, pair in enumerate(iter_pairs(source, cfg.src_lang, cfg.tgt_lang, read)):
        if n < k:
            sample.append(pair)
        else:
            j = rng.randrange(n + 1)
            if j < k:
                sample[j] = pair
    return ([p[0] for p in sample], [p[1] for p in sample]), read.read
