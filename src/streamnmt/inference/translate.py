"""Use a trained checkpoint: the ``translate`` and ``eval`` commands.

Loading a checkpoint for inference with the tokenizers it was trained with
(:func:`load_for_inference`), reading input lines, and the two commands: the CLI builds
:class:`TranslateConfig` / :class:`EvalConfig` from flags and calls :func:`run_translate` /
:func:`run_eval`. Text to encoder input, detokenizing and scoring live in
:mod:`streamnmt.inference.scoring`, which the trainer shares (its per-epoch BLEU); they are re-exported
here. On CUDA both commands decode through CUDA graphs (:mod:`streamnmt.inference.graph_search`) unless
``--no-graph`` is given.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamnmt.checkpoint import embedded_tokenizer, load_checkpoint, load_model_weights
from streamnmt.config import RunConfig
from streamnmt.configbase import check, check_choice, from_dict, opt, pick
from streamnmt.data import DataConfig, Tokenizer, read_pairs
from streamnmt.data.readers import ReadStats
from streamnmt.inference.decoding import DTYPES, SearchOptions, decode_dtype, dtype_name
from streamnmt.errors import ConfigError, InputError
from streamnmt.fsutil import write_output
from streamnmt.inference.lines import read_chunks, read_lines
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.devices import resolve_device
from streamnmt.inference.scoring import (CHINESE, bleu_on_pairs, encode_sources, score, translate_texts,
                                        translate_texts_nbest)

__all__ = ["CHINESE", "EvalConfig", "InferenceConfig", "TranslateConfig", "bleu_on_pairs", "encode_sources",
           "load_for_inference", "read_lines", "run_eval", "run_translate", "score", "translate_texts"]
MAX_WARNINGS = 10  # truncation warnings printed before they are only counted
STREAM_LINES = 1024  # the most input lines decoded at once (fewer where the input has no more ready)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# -- configs ---------------------------------------------------------------------------------


@dataclass(kw_only=True)
class InferenceConfig:
    """Settings shared by ``translate`` and ``eval``."""

    weights: str | None = opt(None, "checkpoint written by streamnmt train, e.g. runs/train/exp/weights/best.pt "
                                    "(required)")
    tokenizer_src: str | None = opt(None, "source SentencePiece model; none = the one embedded in the checkpoint "
                                          "(older checkpoints: the file it names)")
    tokenizer_tgt: str | None = opt(None, "target SentencePiece model; none = the one embedded in the checkpoint "
                                          "(older checkpoints: the file it names)")
    beam_size: int = opt(3, "beam size (1 = greedy search)")
    len_penalty: float = opt(0.6, "length penalty alpha: finished hypotheses are ranked by "
                                  "log-prob / ((5 + length) / 6) ** alpha; 0 = plain log-prob")
    max_len_a: float = opt(1.5, "an output stops at max_len_a * source tokens + max_len_b tokens")
    max_len_b: int = opt(10, "see --max-len-a")
    batch_size: int = opt(64, "sentences per decoding batch")
    device: str | None = opt(None, "cpu, cuda or cuda:N; none = cuda if present")
    cached: bool = opt(True, "incremental decoding with cached keys/values; --no-cached re-runs the "
                             "decoder over the whole prefix at each step (slow; for checking)")
    sync_every: int = opt(0, "look for finished sentences every N decoding steps, one host-GPU sync "
                             "each; 0 = every step on CPU, every 4th on CUDA")
    dtype: str = opt("auto", "weights' dtype for decoding: auto (bf16 on a GPU that has it natively, else fp32), "
                             "bf16, fp16 (CUDA only) or fp32", choices=DTYPES)
    graph: bool = opt(True, "on CUDA, decode with a preallocated cache and each step replayed from a CUDA "
                            "graph (same results, faster); --no-graph runs the eager cached search. The CPU "
                            "always runs the eager search")

    def __post_init__(self) -> None:
        check(bool(self.weights), "weights", "is required: the checkpoint to use, "
                                             "e.g. --weights runs/train/exp/weights/best.pt")
        check(self.beam_size >= 1, "beam_size", f"must be at least 1; got {self.beam_size}")
        check(self.len_penalty >= 0, "len_penalty", f"must be 0 or more; got {self.len_penalty}")
        check(self.max_len_a >= 0, "max_len_a", f"must be 0 or more; got {self.max_len_a}")
        check(self.max_len_b >= 0, "max_len_b", f"must be 0 or more; got {self.max_len_b}")
        check(self.max_len_a > 0 or self.max_len_b > 0, "max_len_b",
              "must be positive when --max-len-a is 0 (outputs would have no room)")
        check(self.batch_size >= 1, "batch_size", f"must be a positive integer; got {self.batch_size}")
        check(self.sync_every >= 0, "sync_every", f"must be 0 (auto) or positive; got {self.sync_every}")
        check_choice(self.dtype, "dtype", DTYPES)
        RunConfig(device=self.device)  # the trainer's --device check

    def search_options(self) -> SearchOptions:
        return SearchOptions(beam_size=self.beam_size, len_penalty=self.len_penalty, max_len_a=self.max_len_a,
                             max_len_b=self.max_len_b, cached=self.cached, sync_every=self.sync_every,
                             graph=self.graph and self.cached)


@dataclass(kw_only=True)
class TranslateConfig(InferenceConfig):
    input: str | None = opt(None, "text file, one sentence a line; none or '-' = stdin")
    output: str | None = opt(None, "file for the translations, one a line; none or '-' = stdout")
    max_input_len: int = opt(256, "longest input in tokens (EOS included); longer lines are truncated "
                                  "with a warning")
    nbest: int = opt(0, "write each line's N best translations (N <= --beam-size), best first, as "
                        "'LINE ||| TRANSLATION ||| F0= SCORE ||| SCORE' lines (Moses' and Marian's n-best "
                        "format; LINE counts from 0; SCORE = log-prob / length penalty), decoded by the eager "
                        "search; 0 = the best translation only, one line each")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.max_input_len >= 2, "max_input_len", f"must be at least 2; got {self.max_input_len}")
        check(0 <= self.nbest <= self.beam_size, "nbest",
              f"must be 0 (off) or 1 to --beam-size ({self.beam_size}); got {self.nbest}")

    def search_options(self) -> SearchOptions:
        # n-best lists come from the eager search's pools (graph decoding keeps the best only)
        opts = super().search_options()
        return dataclasses.replace(opts, graph=opts.graph and not self.nbest)


@dataclass(kw_only=True)
class EvalConfig(InferenceConfig):
    data: str | None = opt(None, "corpus directory; none = the checkpoint's data config (the built-in "
                                 "corpus if it had none)")
    split: str = opt("test", "split to score (valid: fairseq's name of dev)", choices=("dev", "valid", "test"))
    limit: int = opt(0, "score only the first N sentences (0 = all)")
    output: str | None = opt(None, "also write the translations, a line for each of the split's records in "
                                   "its order (empty where a pair is not scored: an empty side), for another "
                                   "scorer (the hypotheses fairseq-generate prints)")
    src_lang: str | None = opt(None, "source-language key in --data's records / file extension; none = "
                                     "the checkpoint's")
    tgt_lang: str | None = opt(None, "target-language key in --data's records / file extension (it also "
                                     "picks BLEU's tokenizer); none = the checkpoint's")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.split, "split", ("dev", "valid", "test"))
        if self.split == "valid":  # the readers find a split named valid as dev
            self.split = "dev"
        check(self.limit >= 0, "limit", f"must be 0 (all) or positive; got {self.limit}")


# -- checkpoint ------------------------------------------------------------------------------


def load_for_inference(path: str | Path, device: torch.device | str, tokenizer_src: str | None = None,
                       tokenizer_tgt: str | None = None, dtype: torch.dtype = torch.float32
                       ) -> tuple[Transformer, Tokenizer, Tokenizer, dict[str, Any]]:
    """Load a checkpoint for decoding: (model in eval mode on ``device``, src_tok, tgt_tok, config).

    The file is read with ``weights_only=True``, so nothing in it is executed. Tokenizers are
    ``tokenizer_src``/``tokenizer_tgt`` where given, else the models embedded in the checkpoint
    (older checkpoints: the files they name); each must have the model's vocabulary size. Every problem is an InputError naming the file.
    """
    ckpt = load_checkpoint(path, "--weights")
    for key in ("model", "model_shape", "tokenizers"):
        if key not in ckpt:
            raise InputError(f"--weights: {path} has no '{key}' entry; it is not a complete streamnmt checkpoint")
    try:
        shape = ModelShape(**ckpt["model_shape"])
    except TypeError as e:
        raise InputError(f"--weights: {path}: bad model_shape entry ({e})") from None
    src_tok = _tokenizer(ckpt, path, "src", tokenizer_src, shape.src_vocab)
    tgt_tok = _tokenizer(ckpt, path, "tgt", tokenizer_tgt, shape.tgt_vocab)
    # Built where it will run: the random initialisation, overwritten at once, is quick on a GPU
    # (docs/PERFORMANCE.md); on a CPU it is what it was
    # (building on the meta device instead took longer there).
    with torch.device(device):
        model = Transformer(shape)
    load_model_weights(model, ckpt, path)
    return model.to(device, dtype).eval(), src_tok, tgt_tok, ckpt.get("config") or {}


def _tokenizer(ckpt: dict[str, Any], path: str | Path, side: str, override: str | None,
               vocab_size: int) -> Tokenizer:
    """The ``side`` ("src"/"tgt") tokenizer: ``override`` or the checkpoint's, checked against the model."""
    flag = f"--tokenizer-{side}"
    meta = ckpt["tokenizers"].get(side) or {}
    embedded = None if override else embedded_tokenizer(ckpt, side, path)
    if embedded is not None:
        return _check_vocab(embedded, side, flag, vocab_size)
    tok_path = override or meta.get("path")
    if not tok_path:
        raise InputError(f"--weights: {path} names no {side} tokenizer; pass one with {flag} PATH")
    if not Path(tok_path).is_file():
        if override:
            raise InputError(f"{flag}: tokenizer model not found: {tok_path}")
        raise InputError(f"{tok_path}: {side} tokenizer named by checkpoint {path} not found; "
                         f"pass a copy of it with {flag} PATH")
    tok = _check_vocab(Tokenizer(tok_path), side, flag, vocab_size)
    if meta.get("sha256") and tok.sha256 != meta["sha256"]:
        warn(f"{tok_path}: not the {side} tokenizer the model was trained with (sha256 differs; same "
             f"vocabulary size); translations may be wrong")
    return tok


def _check_vocab(tok: Tokenizer, side: str, flag: str, vocab_size: int) -> Tokenizer:
    if tok.vocab_size != vocab_size:
        raise InputError(f"{tok.path}: tokenizer has {tok.vocab_size} pieces but the model's {side} vocabulary "
                         f"has {vocab_size}; pass the tokenizer it was trained with ({flag} PATH)")
    return tok


def _mode(cfg: InferenceConfig, device: torch.device) -> str:
    """The device and, on CUDA, how the search ran (for the summary line)."""
    dtype = dtype_name(decode_dtype(cfg.dtype, device))
    if device.type != "cuda":
        return f"{device}, {dtype}"
    return f"{device}, {dtype} ({'CUDA graphs' if cfg.search_options().graph else 'eager'})"


def _check_beam(beam_size: int, tgt_tok: Tokenizer) -> None:
    check(2 * beam_size <= tgt_tok.vocab_size, "beam_size",
          f"must be at most half the target vocabulary ({tgt_tok.vocab_size // 2}); got {beam_size}")


def _load(cfg: InferenceConfig) -> tuple[torch.device, torch.dtype, Transformer, Tokenizer, Tokenizer, dict[str, Any]]:
    """What ``translate`` and ``eval`` decode with: device, decoding dtype, the checkpoint's model in
    it, its tokenizers (checked against --beam-size) and its config."""
    device = resolve_device(cfg.device)
    dtype = decode_dtype(cfg.dtype, device)
    model, src_tok, tgt_tok, config = load_for_inference(cfg.weights, device, cfg.tokenizer_src, cfg.tokenizer_tgt,
                                                         dtype=dtype)
    _check_beam(cfg.beam_size, tgt_tok)
    return device, dtype, model, src_tok, tgt_tok, config


# -- commands --------------------------------------------------------------------------------


def run_translate(cfg: TranslateConfig) -> int:
    """Translate ``cfg.input`` line by line; empty lines stay empty. Returns the exit code. The input
    is read in chunks (:func:`~streamnmt.inference.lines.read_chunks`): on stdout each chunk's
    translations are written as soon as they are decoded (a pipe or a terminal gets them line by
    line); a file given to --output is written once, whole, when the input has ended."""
    device, dtype, model, src_tok, tgt_tok, _ = _load(cfg)
    max_len = min(cfg.max_input_len, model.shape.max_positions)
    to_stdout = cfg.output in (None, "-")
    name = "<stdin>" if cfg.input in (None, "-") else cfg.input
    written: list[str] = []
    n_lines = n_todo = n_cut = 0
    seconds = 0.0
    for chunk in read_chunks(cfg.input, max_lines=STREAM_LINES):
        todo = [i for i, line in enumerate(chunk.lines) if line.strip()]  # empty lines are not sent to the model
        texts = [chunk.lines[i] for i in todo]
        t0 = time.perf_counter()
        if cfg.nbest:
            lists, cut = translate_texts_nbest(model, src_tok, tgt_tok, texts, cfg.search_options(), cfg.nbest,
                                               device=device, batch_size=cfg.batch_size, max_input_len=max_len)
            text = nbest_text(len(chunk.lines), todo, lists, first=chunk.first)
        else:
            hyps, cut = translate_texts(model, src_tok, tgt_tok, texts, cfg.search_options(),
                                        device=device, batch_size=cfg.batch_size, max_input_len=max_len)
            out = [""] * len(chunk.lines)
            for i, hyp in zip(todo, hyps):
                out[i] = hyp
            text = "".join(line + "\n" for line in out)
        seconds += time.perf_counter() - t0
        for j in cut[:max(0, MAX_WARNINGS - n_cut)]:
            warn(f"{name}:{chunk.first + todo[j] + 1}: input longer than {max_len} tokens (EOS included); truncated")
        n_lines, n_todo, n_cut = n_lines + len(chunk.lines), n_todo + len(todo), n_cut + len(cut)
        if to_stdout:
            write_stdout(text)
        else:
            written.append(text)
    if n_cut > MAX_WARNINGS:
        warn(f"{name}: {n_cut - MAX_WARNINGS} more lines truncated to {max_len} tokens")
    if not to_stdout:
        try:
            write_output(cfg.output, "".join(written).encode("utf-8"))
        except OSError as e:
            raise InputError(f"--output: cannot write {cfg.output}: {e.strerror}") from None
    rate = n_todo / seconds if seconds > 0 else 0.0
    print(f"translated {n_lines} lines ({n_todo} non-empty) in {seconds:.2f} s, {rate:.1f} sentences/s "
          f"on {_mode(cfg, device)}", file=sys.stderr)
    return 0


def nbest_text(n_lines: int, todo: list[int], lists: list[list[tuple[str, float]]], first: int = 0) -> str:
    """Moses' n-best lines, ``LINE ||| TRANSLATION ||| F0= SCORE ||| SCORE``, every input line's
    hypotheses best first; an empty input line gets one empty translation of score 0 (every line
    number appears, so a reader can align the lists with the input). ``first``: the input's line
    number of this chunk's first line (LINE counts the whole input from 0)."""
    by_line = dict(zip(todo, lists))
    out = []
    for i in range(n_lines):
        for hyp, sc in by_line.get(i, [("", 0.0)]):
            out.append(f"{first + i} ||| {hyp} ||| F0= {sc:.6f} ||| {sc:.6f}\n")
    return "".join(out)


def write_stdout(text: str) -> None:
    """``text`` on stdout as UTF-8 whatever the locale says (the input is read as UTF-8 too): a
    translation into Chinese must not stop at a Latin-1 or cp1252 console."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # a stream without bytes underneath (e.g. replaced by a test)
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def eval_data_config(config: dict[str, Any], data: str | None, src_lang: str | None = None,
                     tgt_lang: str | None = None) -> DataConfig:
    """The checkpoint's data config (defaults where it has none), with ``data`` as its corpus and
    ``src_lang``/``tgt_lang`` as its language keys where given."""
    dcfg = from_dict(DataConfig, pick(DataConfig, config.get("data") or {}))
    given = {k: v for k, v in (("data", data), ("src_lang", src_lang), ("tgt_lang", tgt_lang)) if v is not None}
    try:
        return dataclasses.replace(dcfg, **given) if given else dcfg
    except ConfigError as e:  # the flags' own values (one key for both sides): named as such
        raise InputError(str(e)) from None


def run_eval(cfg: EvalConfig) -> int:
    """Print BLEU and chrF of the checkpoint on a split. Returns the exit code."""
    device, dtype, model, src_tok, tgt_tok, config = _load(cfg)
    try:
        dcfg = eval_data_config(config, cfg.data, cfg.src_lang, cfg.tgt_lang)
    except ConfigError as e:
        raise InputError(f"--weights: {cfg.weights}: bad data config in the checkpoint ({e})") from None
    if cfg.data is None and dcfg.data and not Path(dcfg.data).expanduser().is_dir():
        raise InputError(f"--weights: {cfg.weights} was trained on {dcfg.data}, which is not there now; "
                         "name the corpus with --data DIR")
    stats, records = ReadStats(), []
    pairs = read_pairs(dcfg, cfg.split, stats, records)
    if stats.empty_skipped:
        warn(f"{cfg.split}: {stats.empty_skipped} of {stats.read} pairs have an empty side and are not scored")
    res = bleu_on_pairs(model, src_tok, tgt_tok, pairs, device=device, beam_size=cfg.beam_size,
                        batch_size=cfg.batch_size, tgt_lang=dcfg.tgt_lang, limit=cfg.limit or None,
                        options=cfg.search_options())
    if res["cut"]:
        first = ", ".join(str(records[i]) for i in res["cut"][:MAX_WARNINGS])
        warn(f"{cfg.split}: {len(res['cut'])} sources longer than the model's {model.shape.max_positions} "
             f"positions (EOS included), truncated as in training's evaluations (records {first}"
             f"{', ...' if len(res['cut']) > MAX_WARNINGS else ''} of the split)")
    if cfg.output:  # a line a record of the split (an empty one where a pair was not scored), to align with it
        hyps = res["hyps"]
        lines = [""] * (stats.read if not cfg.limit else records[len(hyps) - 1] if hyps else 0)
        for record, hyp in zip(records, hyps):
            lines[record - 1] = hyp or ""
        try:
            write_output(cfg.output, "".join(f"{line}\n" for line in lines).encode("utf-8"))
        except OSError as e:
            raise InputError(f"--output: cannot write {cfg.output}: {e.strerror}") from None
    rate = res["n"] / res["seconds"] if res["seconds"] > 0 else 0.0
    print(f"{cfg.split}: {res['n']} sentences, beam {cfg.beam_size}, {res['seconds']:.2f} s, "
          f"{rate:.1f} sentences/s on {_mode(cfg, device)}")
    print(f"BLEU = {res['bleu']:.2f}  chrF = {res['chrf']:.2f}")
    print(f"sacrebleu: {res['signature']}")
    return 0
