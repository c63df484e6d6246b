"""OpenNMT's eole trained beside streamnmt: same corpus, tokenizer, GPU, wall clock and BLEU call.

Usage (on the GPU machine, which has no internet: eole 0.6.4 and the dependencies it lacks travel
as wheels in ``.whl/``, named in the device call's ``carry``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 scripts/eole_compare.py --data corpora/de --src-lang en --tgt-lang de --time-limit 120 \\
        --work /tmp/eole-de
    python3 scripts/eole_compare.py ... --dry-run   # writes the text files and configs, prints the commands

The wheels (``.whl/``): eole, pydantic (+ pydantic-core, annotated-types, typing-inspection),
pyonmttok and six; everything else eole imports to build a vocabulary, train and translate
(torch, numpy, sentencepiece, pyyaml, safetensors, huggingface_hub, tokenizers, rich...) is on the
machine already. eole's own ``eole`` command imports every tool it has (a server, model converters)
and with them packages that are not there, so this script runs eole's ``build_vocab``, ``train``
and ``predict`` itself, through their own classes (``_eole`` below), without that command.

What it does:

1. Reads ``--data``'s train/dev/test splits with the project's readers (any format ``streamnmt
   train --data`` reads) and writes eole's line-aligned text files under ``--work``.
2. Tokenizer: the corpus's own SentencePiece models (``DATA/tokenizer/src.model`` and
   ``tgt.model``, or an older version's ``eng.model`` and ``chn.model``, written by a ``streamnmt
   train`` on it) where they exist, else models trained by
   the project's code with its defaults (unigram, ``--vocab`` 32k soft-capped) under ``--work``:
   both toolkits then see the same pieces. eole's ``sentencepiece`` transform applies them, and
   ``build_vocab`` counts the pieces over the whole training split.
3. Trains eole's Transformer base (6+6 layers, 512 wide, 8 heads, 2048 feed-forward, dropout and
   attention dropout 0.1, label smoothing 0.1, Adam beta2 0.998, Noam learning rate 2 with 4000
   warm-up steps, token batches, bf16 mixed precision, Xavier init: the settings of eole's
   ``recipes/wmt17`` and its "How do I train the Transformer model?" FAQ, at the base size) for
   ``--time-limit`` seconds of its training loop: the loop stops at the first step past it and the
   final checkpoint is written (its time counted). The recipe's batch is 5000 tokens x 10
   accumulated on one GPU; the default here is one 5000-token batch a step (``--accum 10`` for the
   recipe's), since a few-minute run makes few 50k-token updates.
4. Translates the test split (beam ``--beam``, 3 as ``streamnmt eval``) and scores it with the call
   the project uses (:mod:`streamnmt.inference.scoreworker`'s metrics: sacrebleu BLEU with the
   target language's tokenizer, ``zh`` for Chinese, ``13a`` for spaced text, the language read from the
   text where the key names none, as ``streamnmt eval`` does; and chrF), then prints one line: BLEU, chrF,
   training wall clock (the loop, and the whole ``train`` command), steps and real target tokens
   per second (eole's own count of non-padding target tokens over the loop's time). The same
   numbers go to ``WORK/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPLITS = ("train", "dev", "test")


class CompareError(Exception):
    """Bad input: one line, printed by main() with a non-zero exit."""


# ---- data -------------------------------------------------------------------------------------

def _streamnmt():
    sys.path.insert(0, str(REPO / "src"))


def write_text_splits(data: Path, src_lang: str, tgt_lang: str, work: Path) -> dict[str, int]:
    """``WORK/text/{split}.src|.tgt``, one sentence a line (newlines inside one become spaces)."""
    _streamnmt()
    from streamnmt.data.readers import iter_pairs, require_split
    from streamnmt.errors import InputError

    out = work / "text"
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        try:
            source = require_split(data, split, src_lang, tgt_lang)
            pairs = [(" ".join(s.split()), " ".join(t.split())) for s, t in iter_pairs(source, src_lang, tgt_lang)]
        except InputError as e:
            raise CompareError(str(e)) from None
        for side, k in (("src", 0), ("tgt", 1)):
            tmp = out / f".{split}.{side}.tmp"
            tmp.write_text("".join(p[k] + "\n" for p in pairs), encoding="utf-8")
            tmp.replace(out / f"{split}.{side}")
        counts[split] = len(pairs)
    return counts


def tokenizers(data: Path, work: Path, choice: str, vocab: int, src_lang: str, tgt_lang: str) -> tuple[Path, Path, str]:
    """The SentencePiece models (source, target) and where they came from."""
    _streamnmt()
    from streamnmt.data.tokenizer_training import corpus_model

    own = (corpus_model(data, "source"), corpus_model(data, "target"))
    if choice == "corpus" or (choice == "auto" and all(p.is_file() for p in own)):
        missing = [str(p) for p in own if not p.is_file()]
        if missing:
            raise CompareError(f"--tokenizer corpus: {missing[0]} not found (run streamnmt train on the corpus first)")
        return own[0], own[1], "the corpus's (DATA/tokenizer)"
    from streamnmt.data.tokenizer import train_tokenizer
    from streamnmt.data.writing import written_language

    paths = (work / "spm" / "src.model", work / "spm" / "tgt.model")
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for path, side, lang in zip(paths, ("src", "tgt"), (src_lang, tgt_lang)):
        if not path.is_file():
            text = (work / "text" / f"train.{side}").read_text(encoding="utf-8").splitlines()
            lang = written_language(lang, text) or lang  # a key that names no language: as streamnmt train reads it
            train_tokenizer(text, path, vocab, lang, log=lambda m: print(m, file=sys.stderr))
    return paths[0], paths[1], f"trained here (unigram, {vocab} soft cap)"


# ---- eole configuration -----------------------------------------------------------------------

def train_config(args: argparse.Namespace, work: Path, src_model: Path, tgt_model: Path) -> dict:
    """eole's Transformer base (see the module's docstring) on this corpus, as a YAML-able dict."""
    gpu = args.device == "cuda"
    text, eole = work / "text", work / "eole"
    return {
        "save_data": str(eole / "data"),
        "overwrite": True,
        "seed": args.seed,
        "report_every": args.report_every,
        "src_vocab": str(eole / "vocab.src"),
        "tgt_vocab": str(eole / "vocab.tgt"),
        "src_vocab_size": 100000,  # every piece the tokenizer makes (its models are <= --vocab)
        "tgt_vocab_size": 100000,
        "vocab_size_multiple": 8,
        "src_words_min_frequency": 1,
        "tgt_words_min_frequency": 1,
        "share_vocab": False,
        "data": {
            "corpus_1": {"path_src": str(text / "train.src"), "path_tgt": str(text / "train.tgt")},
            "valid": {"path_src": str(text / "dev.src"), "path_tgt": str(text / "dev.tgt")},
        },
        "transforms": ["sentencepiece", "filtertoolong"],
        "transforms_configs": {
            "sentencepiece": {"src_subword_model": str(src_model), "tgt_subword_model": str(tgt_model)},
            "filtertoolong": {"src_seq_length": args.max_len, "tgt_seq_length": args.max_len},
        },
        "training": {
            "model_path": str(eole / "model"),
            "keep_checkpoint": 1,
            "save_checkpoint_steps": 0,  # the final checkpoint only
            "train_steps": args.max_steps or 10_000_000,  # --time-limit ends the run
            "valid_steps": args.valid_steps,
            "world_size": 1,
            "gpu_ranks": [0] if gpu else [],
            "batch_type": "tokens",
            "batch_size": args.batch_size,
            "valid_batch_size": 4096,
            "batch_size_multiple": 8,
            "accum_count": [args.accum],
            "accum_steps": [0],
            "compute_dtype": "bf16" if gpu else "fp32",
            "optim": "adamw",
            "learning_rate": args.lr,
            "warmup_steps": args.warmup,
            "decay_method": "noam",
            "adam_beta2": 0.998,
            "bucket_size": 262144 if gpu else 1024,
            "num_workers": args.workers,
            "prefetch_factor": 400 if args.workers else None,
            "dropout_steps": [0],
            "dropout": [args.dropout],
            "attention_dropout": [args.attention_dropout],
            "max_grad_norm": 0,
            "label_smoothing": args.label_smoothing,
            "param_init_method": "xavier_uniform",
            "normalization": "tokens",
        },
        "model": {
            "architecture": "transformer",
            "hidden_size": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "transformer_ff": args.ff,
            "embeddings": {"word_vec_size": args.hidden, "position_encoding_type": "SinusoidalInterleaved"},
        },
    }


def predict_config(args: argparse.Namespace, work: Path) -> dict:
    gpu = args.device == "cuda"
    return {
        "model_path": str(work / "eole" / "model"),
        "src": str(work / "text" / "test.src"),
        "output": str(work / "eole" / "test.hyp"),
        "world_size": 1,
        "gpu_ranks": [0] if gpu else [],
        "beam_size": args.beam,
        "batch_type": "sents",
        "batch_size": 64,
        "compute_dtype": "bf16" if gpu else "fp32",
        "seed": args.seed,
    }


def dump_yaml(path: Path, config: dict) -> None:
    import yaml

    config = {k: v for k, v in config.items() if v is not None}
    if "training" in config:
        config["training"] = {k: v for k, v in config["training"].items() if v is not None}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True), encoding="utf-8")
    tmp.replace(path)


def commands(work: Path, budget: float) -> list[list[str]]:
    """The three eole steps, each run by this script's ``_eole`` mode in a process of its own."""
    me = [sys.executable, str(Path(__file__).resolve()), "_eole"]
    train_yaml, predict_yaml = str(work / "train.yaml"), str(work / "predict.yaml")
    return [me + ["build_vocab", "-config", train_yaml],
            me + ["train", "-config", train_yaml, "--time-limit", str(budget),
                  "--stats", str(work / "eole" / "train_stats.json")],
            me + ["predict", "-config", predict_yaml]]


# ---- running eole's steps (the ``_eole`` mode) ------------------------------------------------

def eole_bin(name: str):
    """eole's ``run`` tool class ``name`` ("build_vocab", "train", "predict"), imported without
    ``eole.bin``'s package import, which imports every eole tool (and their dependencies)."""
    import importlib
    import importlib.util
    import types

    if "eole.bin" not in sys.modules:
        spec = importlib.util.find_spec("eole.bin")
        if spec is None or spec.origin is None:
            raise CompareError("eole is not importable (install the wheels: see this script's docstring)")
        source = Path(spec.origin).read_text(encoding="utf-8")
        head, sep, _ = source.partition("# Auto import python files")
        if not sep:
            raise CompareError(f"{spec.origin}: not the eole.bin this script knows (eole 0.6.4)")
        pkg = types.ModuleType("eole.bin")
        pkg.__file__, pkg.__path__, pkg.__package__ = spec.origin, list(spec.submodule_search_locations), "eole.bin"
        sys.modules["eole.bin"] = pkg
        exec(compile(head, spec.origin, "exec"), pkg.__dict__)  # BaseBin, register_bin, AVAILABLE_BINS
    importlib.import_module(f"eole.bin.run.{name}")
    return sys.modules["eole.bin"].AVAILABLE_BINS["run"][name]


def limit_training(budget: float, stats_path: Path | None) -> None:
    """Stop eole's training loop at the first step past ``budget`` seconds of it (it then writes its
    final checkpoint), and write the loop's time, steps and token counts to ``stats_path``."""
    from eole.trainer import Trainer

    accum, train = Trainer._accum_batches, Trainer.train
    clock: dict[str, float] = {}

    def timed_batches(self, iterator):
        clock["start"] = time.perf_counter()
        for item in accum(self, iterator):
            if budget and time.perf_counter() - clock["start"] >= budget:
                return
            yield item

    def timed_train(self, *a, **k):
        stats = train(self, *a, **k)  # the final checkpoint is written inside
        seconds = time.perf_counter() - clock.get("start", time.perf_counter())
        out = {"loop_s": seconds, "steps": int(self.optim.training_step) - 1,
               "tgt_tokens": int(stats.n_tokens), "src_tokens": int(stats.n_src_tokens),
               "sents": int(stats.n_sents), "tgt_tokens_per_s": stats.n_tokens / max(seconds, 1e-9)}
        if stats_path is not None:
            stats_path.write_text(json.dumps(out) + "\n")
        return stats

    Trainer._accum_batches, Trainer.train = timed_batches, timed_train


def run_eole(argv: list[str]) -> int:
    """``_eole NAME -config FILE [--time-limit S --stats FILE]``: one eole step, in this process."""
    name, rest = argv[0], argv[1:]
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--time-limit", type=float, default=0.0)
    extra.add_argument("--stats", type=Path)
    mine, rest = extra.parse_known_args(rest)
    cls = eole_bin(name)
    if name == "train":
        limit_training(mine.time_limit, mine.stats)
    parser = argparse.ArgumentParser(prog=f"eole {name}")
    cls.add_args(parser)
    args = parser.parse_args(rest)
    if name == "build_vocab":
        args.n_sample = -1
    cls.run(args)
    return 0


# ---- scoring ----------------------------------------------------------------------------------

def score(hyp_path: Path, ref_path: Path, tgt_lang: str) -> dict:
    """BLEU and chrF with the metrics the project scores with (scoreworker.metrics)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scoreworker", REPO / "src" / "streamnmt" / "inference" /
                                                  "scoreworker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    hyps = hyp_path.read_text(encoding="utf-8").splitlines()
    refs = ref_path.read_text(encoding="utf-8").splitlines()
    if len(hyps) != len(refs):
        raise CompareError(f"{hyp_path}: {len(hyps)} translations for {len(refs)} test sentences")
    _streamnmt()
    from streamnmt.data.writing import written_language

    bleu, chrf = worker.metrics(written_language(tgt_lang, refs) or tgt_lang)  # as scoring.scored_language
    b, c = bleu.corpus_score(hyps, [refs]), chrf.corpus_score(hyps, [refs])
    return {"bleu": b.score, "chrf": c.score, "signature": f"{bleu.get_signature()} / {chrf.get_signature()}",
            "sentences": len(refs)}


# ---- command line -----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--data", required=True, type=Path, help="corpus directory (as streamnmt train --data)")
    ap.add_argument("--src-lang", default="en")
    ap.add_argument("--tgt-lang", default="ch")
    ap.add_argument("--work", required=True, type=Path, help="working directory (text files, configs, model)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds of eole's training loop")
    ap.add_argument("--max-steps", type=int, default=0, help="also stop after this many steps (0: no limit)")
    ap.add_argument("--tokenizer", choices=("auto", "corpus", "own"), default="auto",
                    help="corpus: DATA/tokenizer's models; own: train models here; auto: corpus where present")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary of each side's model when trained here")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batch-size", type=int, default=5000, help="tokens per batch (the recipe's 5000)")
    ap.add_argument("--accum", type=int, default=1, help="batches per update (the recipe's is 10)")
    ap.add_argument("--lr", type=float, default=2.0, help="Noam learning-rate factor")
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--attention-dropout", type=float, default=0.1)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ff", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=128, help="longer pairs are dropped (streamnmt's --max-len)")
    ap.add_argument("--valid-steps", type=int, default=5000, help="eole's validation interval (the recipe's)")
    ap.add_argument("--report-every", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4, help="eole's data-loading processes")
    ap.add_argument("--beam", type=int, default=3, help="test decoding beam (streamnmt eval's default)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dry-run", action="store_true", help="write the text files and configs, print the commands")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("batch_size", "accum", "warmup", "layers", "hidden", "heads", "ff", "max_len", "valid_steps",
                 "report_every", "beam", "vocab"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1; got {getattr(args, flag)}")
    if args.time_limit <= 0 and not args.max_steps:
        ap.error(f"--time-limit must be positive (or give --max-steps); got {args.time_limit}")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.workers < 0 or args.max_steps < 0:
        ap.error("--workers and --max-steps must be at least 0")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_eole":
        return run_eole(argv[1:])
    ap = parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    try:
        return compare(args)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def compare(args: argparse.Namespace) -> int:
    work = args.work
    (work / "eole").mkdir(parents=True, exist_ok=True)
    counts = write_text_splits(args.data, args.src_lang, args.tgt_lang, work)
    src_model, tgt_model, origin = tokenizers(args.data, work, args.tokenizer, args.vocab, args.src_lang,
                                              args.tgt_lang)
    dump_yaml(work / "train.yaml", train_config(args, work, src_model, tgt_model))
    dump_yaml(work / "predict.yaml", predict_config(args, work))
    cmds = commands(work, args.time_limit)
    print(f"eole_compare: {counts['train']} training pairs, {counts['test']} test; tokenizer {origin}; "
          f"configs in {work}")
    if args.dry_run:
        for cmd in cmds:
            print(shlex.join(cmd))
        return 0
    seconds = []
    for cmd in cmds:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        seconds.append(time.perf_counter() - t0)
        if r.returncode != 0:
            raise CompareError(f"eole {cmd[3]} failed (exit {r.returncode}): {shlex.join(cmd)}")
    stats = json.loads((work / "eole" / "train_stats.json").read_text())
    result = {**score(work / "eole" / "test.hyp", work / "text" / "test.tgt", args.tgt_lang), **stats,
              "build_vocab_s": seconds[0], "train_command_s": seconds[1], "predict_s": seconds[2],
              "time_limit_s": args.time_limit, "data": str(args.data), "tokenizer": origin}
    (work / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"eole {args.data} {args.src_lang}->{args.tgt_lang}: test BLEU {result['bleu']:.2f} chrF "
          f"{result['chrf']:.2f} ({result['sentences']} sentences); training {stats['loop_s']:.1f} s "
          f"(loop; command {seconds[1]:.1f} s, budget {args.time_limit:g} s), {stats['steps']} steps, "
          f"{stats['tgt_tokens_per_s']:,.0f} real target tokens/s; predict {seconds[2]:.1f} s; "
          f"{result['signature']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
