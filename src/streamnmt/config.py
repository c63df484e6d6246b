"""The training job's configuration: one dataclass per component, YAML in and out, CLI flags.

Sections (also the YAML layout of ``config.yaml``): ``model``, ``data``, ``optim``, ``engine``,
``run``. Flags are flat (``--batch-size``, ``--sync-strategy``...) and map onto the section that
declares the field; ``--config FILE.yaml`` is read first and flags override it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from streamnmt.configbase import canonical, check, check_choice, from_dict, names_of, opt, to_dict
from streamnmt.configfile import read_yaml, snake_keys, unknown_key
from streamnmt.data.config import GPU_PRESETS, DataConfig, builtin_size_for, small_corpus  # noqa: F401 (re-exported)
from streamnmt.data.writing import UNSPACED_SHARE
from streamnmt.engine.config import EngineConfig
from streamnmt.errors import ConfigError

# Model presets: (d_model, n_layers, n_heads, d_ff). "base" is the original system's model; "big" is
# the Transformer paper's big model (Vaswani et al. 2017, table 3; fairseq's transformer_wmt_en_de_big);
# "iwslt" is fairseq's transformer_iwslt_de_en, its model for IWSLT's ~160k-pair corpora: base's width
# and depth with half the feed-forward and half the heads (about half of base's parameters besides
# the embeddings), between small and base.
PRESETS = {
    "base": (512, 6, 8, 2048),
    "big": (1024, 6, 16, 4096),
    "iwslt": (512, 6, 4, 1024),
    "small": (256, 3, 4, 1024),
    "tiny": (64, 2, 4, 128),
}
# The residual/embedding dropout a preset trains with when --dropout is not given: the paper's big
# model used 0.3 on EN-DE (a model 3x the size of base overfits the same data sooner; fairseq's big
# recipe keeps 0.3 too); fairseq's IWSLT recipe trains its model with 0.3 as well (a small corpus);
# every other preset the paper's 0.1.
PRESET_DROPOUT = {"big": 0.3, "iwslt": 0.3}
DEFAULT_DROPOUT = 0.1
# The corpus rule's dropout: a --data corpus under data.config.SMALL_CORPUS_PAIRS training pairs trains
# with at least this, as fairseq's IWSLT recipe does; the real-text grid measured it with the halved
# vocabulary (docs/PERFORMANCE.md, "The recipe on real text"). --dropout overrides it.
SMALL_CORPUS_DROPOUT = 0.3
# The corpus rule's label smoothing: a --data corpus under SMALL_CORPUS_PAIRS training pairs whose target
# is written without spaces between words (at least UNSPACED_SHARE of its letters Chinese or Japanese:
# streamnmt.data.writing) or is rich in word forms (at least RICH_SMOOTHING_FORMS times its source's
# distinct words in the same number of words: writing.word_form_ratio) trains with RICH_LABEL_SMOOTHING;
# every other corpus, the built-in one included, with the Transformer recipe's DEFAULT_LABEL_SMOOTHING.
# The script's part was chosen on Japanese and checked on the held-out Chinese corpus; the word forms'
# on Russian and Korean, whose targets scored higher with it on every seed, while German, French and
# Spanish (fewer forms) did not in the grid's short runs; the bound lies between German's and Russian's ratios
# (docs/PERFORMANCE.md, "The recipe on real text"). --label-smoothing overrides it.
DEFAULT_LABEL_SMOOTHING = 0.1
RICH_LABEL_SMOOTHING = 0.2
RICH_SMOOTHING_FORMS = 1.6


@dataclass(kw_only=True)
class ModelConfig:
    model: str = opt("auto", "model preset: base (6+6 x 512, 8 heads, d_ff 2048), big (6+6 x 1024, 16 heads, "
                             "d_ff 4096, dropout 0.3: the Transformer paper's big model), iwslt (6+6 x 512, "
                             "4 heads, d_ff 1024, dropout 0.3: fairseq's transformer_iwslt_de_en), small "
                             "(3+3 x 256), tiny; "
                             "auto = base where CUDA is present, small on CPU", choices=("auto", *PRESETS))
    d_model: int | None = opt(None, "model width (overrides the preset)")
    n_layers: int | None = opt(None, "encoder and decoder layers each (overrides the preset)")
    n_heads: int | None = opt(None, "attention heads (overrides the preset)")
    d_ff: int | None = opt(None, "feed-forward width (overrides the preset)")
    # None until resolved: the default depends on the preset (PRESET_DROPOUT), so an explicit
    # --dropout 0.1 with --model big stays 0.1; config.yaml records the resolved number.
    dropout: float | None = opt(None, "dropout probability of the residual connections and the embeddings "
                                      f"(default: {PRESET_DROPOUT['big']} for big and iwslt, {DEFAULT_DROPOUT} "
                                      "for the other presets)")
    attention_dropout: float = opt(0.0, "dropout probability of the attention weights (0, as fairseq's and "
                                        "Marian's Transformer defaults; runs before this setting used --dropout)")
    activation_dropout: float = opt(0.0, "dropout probability of the feed-forward's hidden activations (0, as "
                                         "fairseq's and Marian's defaults; runs before this setting used --dropout)")
    # None until the corpus rule resolves it (streamnmt.training.recipe.resolve_corpus); config.yaml
    # records the number taken.
    label_smoothing: float | None = opt(None, "label smoothing of the cross-entropy, 0 = plain cross-entropy "
                                              f"(default: {RICH_LABEL_SMOOTHING} for a --data corpus under "
                                              "1,000,000 training pairs whose target is Chinese or Japanese "
                                              f"text or has at least {RICH_SMOOTHING_FORMS}x its source's word "
                                              f"forms, else {DEFAULT_LABEL_SMOOTHING}, the Transformer recipe's)")
    tie_embeddings: str = opt("none", "tie embeddings: decoder = the target embedding is the output projection; "
                                      "all = the source embedding too (needs --shared-vocab)",
                              choices=("none", "decoder", "all"))
    attention: str = opt("auto", "attention of packed batches: sdpa = dense segment masks, flex = "
                                 "FlexAttention block masks, triton = Triton kernels that skip the other pairs' "
                                 "tiles (flex and triton: CUDA, no attention dropout); auto = triton on an NVIDIA GPU of "
                                 "compute capability 8.0+ without --attention-dropout, else sdpa",
                         choices=("auto", "sdpa", "flex", "triton"))

    def __post_init__(self) -> None:
        check_choice(self.model, "model", ("auto", *PRESETS))
        check_choice(self.attention, "attention", ("auto", "sdpa", "flex", "triton"))
        for key in ("d_model", "n_layers", "n_heads", "d_ff"):
            v = getattr(self, key)
            check(v is None or v > 0, key, f"must be a positive integer; got {v}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            v = getattr(self, key)
            check((v is None and key == "dropout") or 0.0 <= v < 1.0, key, f"must be in [0, 1); got {v}")
        check(self.label_smoothing is None or 0.0 <= self.label_smoothing < 1.0, "label_smoothing",
              f"must be in [0, 1); got {self.label_smoothing}")
        check_choice(self.tie_embeddings, "tie_embeddings", ("none", "decoder", "all"))
        if self.d_model and self.n_heads:
            check(self.d_model % self.n_heads == 0, "n_heads",
                  f"must divide --d-model ({self.d_model}); got {self.n_heads}")

    def resolve(self, preset: str) -> ModelConfig:
        """Fill unset sizes and the dropout from ``preset`` (the resolved config is what config.yaml
        records)."""
        d, n, h, f = PRESETS[preset]
        dropout = self.dropout if self.dropout is not None else preset_dropout(preset)
        return dataclasses.replace(self, model=preset, d_model=self.d_model or d, n_layers=self.n_layers or n,
                                   n_heads=self.n_heads or h, d_ff=self.d_ff or f, dropout=dropout)


def preset_dropout(preset: str) -> float:
    """The dropout ``preset`` trains with unless --dropout says otherwise."""
    return PRESET_DROPOUT.get(preset, DEFAULT_DROPOUT)


def corpus_dropout(preset: str, pairs: int | None) -> float:
    """The dropout when --dropout is not given, for a --data corpus of ``pairs`` training pairs (None:
    the built-in corpus, which keeps the preset's)."""
    base = preset_dropout(preset)
    return max(base, SMALL_CORPUS_DROPOUT) if small_corpus(pairs) else base


def corpus_label_smoothing(pairs: int | None, unspaced: float | None, forms: float | None = None) -> float:
    """The label smoothing when --label-smoothing is not given, for a --data corpus of ``pairs``
    training pairs (None: the built-in corpus) whose target's letters are ``unspaced`` Chinese or
    Japanese (a share; None: not counted) and whose target has ``forms`` times its source's word forms
    (None: not counted)."""
    chinese_or_japanese = unspaced is not None and unspaced >= UNSPACED_SHARE
    rich = forms is not None and forms >= RICH_SMOOTHING_FORMS
    return RICH_LABEL_SMOOTHING if small_corpus(pairs) and (chinese_or_japanese or rich) else DEFAULT_LABEL_SMOOTHING


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = opt(1.0, "Noam factor: lr = lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)")
    warmup: int | None = opt(None, "Noam warm-up steps (default: from the tokens per update with a token "
                                   "budget, see streamnmt.config.recipe_warmup; else 4000 for base and big, "
                                   "400 for smaller presets)")
    clip_grad: float = opt(1.0, "clip the gradient norm to this (0 = off)")
    lr_cooldown: float = opt(0.0, "the last share of the run in which the learning rate falls linearly to "
                                  "zero (0 = off; 0.2 = the last fifth): of --max-steps or --epochs, or of the "
                                  "training time --time-limit leaves, planned from the steps a second measured")
    amp: str = opt("auto", "mixed precision: bf16, fp16 (with a grad scaler) or off; auto = bf16 on a "
                           "GPU that has it natively, fp16 on other GPUs, off on the CPU",
                   choices=("auto", "bf16", "fp16", "off"))

    def __post_init__(self) -> None:
        check(math.isfinite(self.lr) and self.lr > 0, "lr", f"must be positive and finite; got {self.lr}")
        check(self.warmup is None or self.warmup >= 1, "warmup", f"must be at least 1; got {self.warmup}")
        check(self.clip_grad >= 0, "clip_grad", f"must be 0 (off) or positive; got {self.clip_grad}")
        check(0.0 <= self.lr_cooldown < 1.0, "lr_cooldown", f"must be in [0, 1); got {self.lr_cooldown}")
        check_choice(self.amp, "amp", ("auto", "bf16", "fp16", "off"))


# -- the default batch and warm-up (the "recipe"): needs no fairseq knowledge --------------------
# The base model on the built-in corpus trained best for a time budget (docs/PERFORMANCE.md, "Token
# budgets") with batches of 6144 tokens and 800 warm-up steps, i.e. a warm-up over about 4.9M (padded) tokens.
TOKENS_PER_GIB = 64            # default token budget per GiB of GPU memory, at d_model 512
MAX_TOKENS_RANGE = (1024, 16384)
WARMUP_TOKENS = 6144 * 800     # tokens the warm-up spans, whatever the batch
WARMUP_RANGE = (100, 4000)


# The budget with the best time to BLEU (base model): the smallest budget measured reached the best
# dev BLEU first, on a small and on a large corpus (docs/PERFORMANCE.md, "Token budgets by time to
# BLEU", has the budgets, corpora and run lengths): larger batches train more tokens per second, but
# fewer updates. The default budget is this or what the GPU's memory holds, the smaller.
TIME_TO_BLEU_TOKENS = 4096

# The weights' moving average every run keeps and evaluates by default (--ema, --eval-ema): it
# lowered the validation loss, raised the best dev BLEU and steadied dev BLEU between evaluations,
# on GPUs and on the CPU preset (docs/PERFORMANCE.md, "The weights' moving average").
EMA_DECAY = 0.9999
# The average's update reads every weight and its shadow and writes the shadow, a share of the step
# (docs/PERFORMANCE.md, "The update"). Done after every 4th step it costs a quarter of that; with the
# decay compounded it spans the same steps.
EMA_EVERY = 4


def recipe_max_tokens(gpu_mem_gib: float, d_model: int) -> int:
    """The token budget a GPU's memory holds: ``TOKENS_PER_GIB`` per GiB of its memory, scaled by
    512 / d_model, rounded down to a power of two within ``MAX_TOKENS_RANGE`` (base, 141 GiB: 8192).
    Wider models need more memory per token; a power of two keeps batch shapes few and aligned."""
    raw = TOKENS_PER_GIB * gpu_mem_gib * 512 / d_model
    lo, hi = MAX_TOKENS_RANGE
    return int(min(max(2 ** int(math.log2(max(raw, 1))), lo), hi))


def recipe_budget(gpu_mem_gib: float, d_model: int) -> int:
    """Default token budget per batch on a GPU: ``TIME_TO_BLEU_TOKENS``, or less where the memory
    rule (``recipe_max_tokens``) says so (base: 4096 from 80 GiB, 1024 at 24 GiB)."""
    return min(TIME_TO_BLEU_TOKENS, recipe_max_tokens(gpu_mem_gib, d_model))


def recipe_warmup(tokens_per_update: int) -> int:
    """Default Noam warm-up for ``tokens_per_update`` (the token budget x --accum-steps x processes):
    the warm-up spans ``WARMUP_TOKENS`` tokens, within ``WARMUP_RANGE`` steps. The Noam peak,
    lr * d_model^-0.5 * warmup^-0.5, then grows with the square root of the batch (Adam's
    square-root scaling rule): 6144 tokens -> 800 steps, 8192 -> 600, 16384 -> 300.

    Not scaled by d_model: the Noam schedule already divides the peak by sqrt(d_model), so the big
    model (d_model 1024) peaks 1/sqrt(2) lower than base at the same warm-up, and both reference
    recipes keep the warm-up of base for big (the paper: 4000 steps for both; fairseq's big recipe:
    4000 updates at lr 1e-3 like its base). The width shows up in the tokens per update instead: the
    budget halves for a model twice as wide (recipe_max_tokens), so the warm-up, which spans the
    same tokens, takes twice the steps."""
    lo, hi = WARMUP_RANGE
    return int(min(max(round(WARMUP_TOKENS / tokens_per_update), lo), hi))


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str | None, key: str = "time_limit") -> float | None:
    """``"2h"``, ``"90m"``, ``"20s"``, ``"1h30m"``, or plain seconds (``"45"``) -> seconds; None or
    ``"none"`` -> None."""
    if text is None:
        return None
    t = str(text).strip().lower()
    if t == "none":
        return None
    try:
        seconds = float(t)
    except ValueError:
        m = _DURATION.match(t)
        if not t or not m or not any(m.groups()):
            raise ConfigError(f"--{key.replace('_', '-')} (config key '{key}'): must be a duration such as "
                              f"2h, 90m, 20s or 1h30m; got {text!r}") from None
        seconds = sum(float(v) * _UNITS[u] for v, u in zip(m.groups(), "hms") if v)
    check(math.isfinite(seconds) and seconds > 0, key, f"must be a positive duration; got {text!r}")
    return seconds


def best_metric(run: Any) -> str:
    """The resolved ``--best-metric``: ``auto`` is BLEU when BLEU is computed, else val_loss."""
    if run.best_metric != "auto":
        return run.best_metric
    return "bleu" if run.bleu_samples > 0 else "val_loss"


def parse_eval_every(text: Any) -> int | None:
    """``--eval-every``: None for ``auto`` (the time rule), else a number of steps (0 = epoch ends only)."""
    every = str(text).strip().lower()
    check(every == "auto" or (every.isdigit() and int(every) >= 0), "eval_every",
          f"must be auto, 0 (epoch ends only) or a positive number of steps; got {text!r}")
    return None if every == "auto" else int(every)


def check_recipe(run: Any) -> None:
    """Validate the RunConfig fields of the training recipe (called from its ``__post_init__``)."""
    steps = parse_eval_every(run.eval_every)
    run.eval_every = "auto" if steps is None else str(steps)
    check_choice(run.best_metric, "best_metric", ("auto", "bleu", "val_loss"))
    check(run.best_metric != "bleu" or run.bleu_samples > 0, "best_metric",
          "bleu needs BLEU to be computed: set --bleu-samples above 0 or use --best-metric val_loss")
    check(run.patience is None or run.patience >= 0, "patience",
          f"must be 0 (never stop early) or positive; got {run.patience}")
    parse_duration(run.time_limit)
    check(run.keep_last >= 0, "keep_last", f"must be 0 (none) or positive; got {run.keep_last}")
    check(run.keep_last == 0 or run.save_every > 0, "keep_last",
          "keeps step checkpoints, which --save-every S writes: add --save-every (e.g. --save-every 1000)")
    check(0.0 <= run.ema < 1.0, "ema", f"must be in [0, 1) (e.g. 0.9999; 0 = off); got {run.ema}")
    check(run.ema_every >= 1, "ema_every", f"must be at least 1; got {run.ema_every}")
    check(not run.eval_ema or run.ema > 0, "eval_ema", "evaluates the averaged weights: add --ema 0.9999")
    check(run.average_last == 0 or run.average_last >= 2, "average_last",
          f"must be 0 (off) or at least 2 evaluations to average; got {run.average_last}")
    check(not run.tensorboard or importlib.util.find_spec("tensorboard") is not None, "tensorboard",
          "needs the tensorboard package: pip install tensorboard (or drop --tensorboard)")


EPOCHS_UNLIMITED = 1_000_000  # --epochs when a --time-limit, --max-steps or the plateau's --patience ends the run
# --patience of a --data run on a GPU given no end (--time-limit, --epochs, --max-steps): it trains until
# its plateau, as Marian's --early-stopping does. 25 evaluations let the 10-minute runs of
# docs/PERFORMANCE.md ("The recipe on real text", "Past 2 minutes") reach their best dev BLEU; 20 or
# fewer stopped them short of it.
PLATEAU_PATIENCE = 25


@dataclass(kw_only=True)
class RunConfig:
    epochs: int | None = opt(None, "training epochs (default: until --time-limit or --max-steps ends the run "
                                   "where one is given; a --data run on a GPU given neither trains until its "
                                   "plateau (--patience); else 10 on a GPU and 2 on a CPU)")
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = no limit)")
    device: str | None = opt(None, "cpu, cuda or cuda:N (default: cuda if present)")
    seed: int = opt(0, "random seed (initialisation, dropout, batch order)")
    deterministic: bool = opt(False, "use deterministic algorithms (slower; for exact comparisons)")
    project: str = opt("runs/train", "parent directory of run directories")
    name: str = opt("exp", "run directory name; exp, exp2, ... (the next free one unless --exist-ok)")
    exist_ok: bool = opt(False, "reuse project/name if it exists instead of taking the next free name")
    weights: str | None = opt(None, "start from these model weights (fine-tuning)")
    save_every: int = opt(0, "also save weights/last.pt every this many optimizer steps (0 = at epoch ends, "
                             "by the --eval-every auto rule, and at the end of the run)")
    async_save: bool = opt(True, "write checkpoints on a background thread: the loop waits only for a copy of "
                                 "the state into pinned host memory (--no-async-save: write on the loop)")
    resume: str | None = opt(None, "continue the run of this checkpoint (weights/last.pt) in its own run dir")
    on_nan: str = opt("stop", "a non-finite loss or gradient: stop (exit non-zero, last good checkpoint "
                              "kept) or skip (the update is discarded on the device)", choices=("stop", "skip"))
    max_skipped_steps: int = opt(10, "stop (exit non-zero, last good checkpoint kept) after this many updates "
                                      "in a row were skipped for a non-finite loss or gradient (0 = never)")
    bleu_samples: int = opt(500, "dev sentences decoded for BLEU at each epoch end (0 = off)")
    beam_size: int = opt(3, "beam size of the epoch-end BLEU decoding")
    eval_dtype: str = opt("auto", "weights' dtype of the BLEU decoding: auto (bf16 on a GPU that has it natively, "
                                  "else fp32), bf16, fp16 (CUDA only) or fp32", choices=("auto", "bf16", "fp16", "fp32"))
    async_eval: str = opt("auto", "decode the dev BLEU pass on a thread beside training (its weights copied at the "
                                  "evaluated step; validation stays on the loop): auto = on a GPU with one process in "
                                  "graph mode, "
                                  "on = also on the CPU, off = the loop waits for it", choices=("auto", "on", "off"))
    eval_every: str = opt("auto", "when to evaluate (val loss, BLEU, best.pt, patience): auto = once the training "
                                  "since the last evaluation is 9x what that evaluation cost (evaluation stays "
                                  "under ~10 % of the run), and at the end of the run; N = every N optimizer steps "
                                  "and at epoch ends; 0 = at epoch ends only")
    best_metric: str = opt("auto", "what chooses best.pt and drives --patience: bleu (higher is better) or "
                                   "val_loss; auto = bleu when --bleu-samples > 0",
                           choices=("auto", "bleu", "val_loss"))
    patience: int | None = opt(None, "stop when --best-metric has not improved for N evaluations in a row "
                                     f"(0 = never); default: {PLATEAU_PATIENCE} for a --data run on a GPU given no "
                                     "--time-limit, --epochs or --max-steps (it trains until its plateau), else 0")
    time_limit: str | None = opt(None, "the run's wall clock, counted from the command's start, e.g. 2h, 90m, "
                                       "20s, 1h30m or plain seconds (90): training stops early enough for the "
                                       "last evaluation and last.pt to fit, exit 0, --resume continues "
                                       "(none = no limit)")
    keep_last: int = opt(0, "with --save-every S: also keep the last N step checkpoints as weights/step_NNNNNN.pt "
                            "(for streamnmt average; 0 = none)")
    ema: float = opt(EMA_DECAY, "keep an exponential moving average of the weights on the device, updated in "
                                "the step, with this decay (warmed up as min(decay, (1+n)/(10+n))); 0 = off")
    ema_every: int = opt(EMA_EVERY, "update the moving average after the first optimizer step, then every "
                                    "N-th, its decay compounded over the N steps (1 = every step)")
    eval_ema: bool | None = opt(None, "validate, score BLEU and write best.pt with the EMA weights (needs --ema); "
                                      "default: on wherever the EMA is kept")
    average_last: int = opt(0, "at the end of the run, also score the mean of the last K evaluated weights (those "
                               "scored: the EMA's under --eval-ema) on dev; best.pt is the better of it and the best "
                               "single evaluation (fairseq's habit: its Transformer recipe averages the last 5 "
                               "checkpoints, e.g. --average-last 5). Costs K copies of the weights in host memory "
                               "and in every last.pt, and one evaluation more; 0 = off, the default until its BLEU "
                               "beside the moving average is measured (docs/PERFORMANCE.md, Real corpora)")
    verbose: bool = opt(False, "print the host-sync table after every epoch (else once, at the end)")
    tensorboard: bool = opt(False, "write TensorBoard scalars (loss, lr, tokens/s, BLEU, sync counts) to the "
                                   "run directory (needs: pip install tensorboard)")

    def eval_steps(self) -> int | None:
        """``--eval-every`` as a number of steps: None for ``auto`` (the time rule)."""
        return parse_eval_every(self.eval_every)

    def time_limit_s(self) -> float | None:
        """``--time-limit`` in seconds; None for no limit."""
        return parse_duration(self.time_limit)

    def __post_init__(self) -> None:
        check(self.epochs is None or self.epochs >= 1, "epochs", f"must be at least 1; got {self.epochs}")
        check(bool(self.name) and self.name not in (".", "..") and not any(c in self.name for c in "/\\"),
              "name", f"must be a folder name inside --project (no '/', not '.' or '..'); got {self.name!r}")
        check(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32); got {self.seed}")
        check(self.max_steps >= 0, "max_steps", f"must be 0 (no limit) or positive; got {self.max_steps}")
        check(self.save_every >= 0, "save_every", f"must be 0 (off) or positive; got {self.save_every}")
        check_choice(self.on_nan, "on_nan", ("stop", "skip"))
        check(self.max_skipped_steps >= 0, "max_skipped_steps", f"must be 0 (never) or positive; got "
              f"{self.max_skipped_steps}")
        check(self.bleu_samples >= 0, "bleu_samples", f"must be 0 or more; got {self.bleu_samples}")
        check(self.beam_size >= 1, "beam_size", f"must be at least 1; got {self.beam_size}")
        check_choice(self.eval_dtype, "eval_dtype", ("auto", "bf16", "fp16", "fp32"))
        check_choice(self.async_eval, "async_eval", ("auto", "on", "off"))
        check_recipe(self)
        if self.device is not None:
            import torch
            dev = self.device
            ok = dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())
            check(ok, "device", f"must be cpu, cuda or cuda:N; got {dev!r}")
            if dev.startswith("cuda"):
                check(torch.cuda.is_available(), "device", f"{dev} requested but CUDA is not available here; use --device cpu")
                idx = int(dev[5:]) if ":" in dev else 0
                check(idx < torch.cuda.device_count(), "device",
                      f"{dev} requested but only {torch.cuda.device_count()} CUDA device(s) exist")


# Settings a resumed run may change: they change neither the model nor the data order, so the run
# continues exactly as it would have with them from the start (where the schedule does not depend on them).
RESUME_SETTINGS = ("epochs", "max_steps", "time_limit", "patience", "save_every", "eval_every", "keep_last",
                   "verbose", "tensorboard")

SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
                             "engine": EngineConfig, "run": RunConfig}


@dataclass
class TrainJob:
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    engine: EngineConfig
    run: RunConfig

    def __post_init__(self) -> None:
        check(self.model.tie_embeddings != "all" or self.data.shared_vocab, "tie_embeddings",
              "'all' ties the source embedding to the target one, which needs one vocabulary: add --shared-vocab")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: to_dict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def section_of(key: str) -> str:
    """The section of a config key (a field's name, or one of its older names)."""
    for name, cls in SECTIONS.items():
        if key in names_of(cls):
            return name
    raise ConfigError(f"unknown config key '{key}'")


def load_yaml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a config file into {section: {key: value}}; flat files (no sections) are accepted too."""
    path = Path(path)
    raw = snake_keys(read_yaml(path, "--config"), path, "--config")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {path}: must be a mapping of sections or keys, got {type(raw).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            section = out.setdefault(key, {})
            for k, v in value.items():
                if k in section:  # given flat before the section
                    raise ConfigError(f"--config: {path}: '{k}' is given flat and in section '{key}': give it once")
                section[k] = v
        elif key in SECTIONS and not _is_field(key):
            raise ConfigError(f"--config: {path}: section '{key}' must be a mapping")
        else:
            try:
                section = out.setdefault(section_of(key), {})
            except ConfigError:
                raise unknown_key("--config", path, key, _keys()) from None
            if key in section:  # given in its section before, flat now
                raise ConfigError(f"--config: {path}: '{key}' is given flat and in section "
                                  f"'{section_of(key)}': give it once")
            section[key] = value
    if (out.get("run") or {}).get("resume"):  # a run's own config.yaml says resume: null
        raise ConfigError(f"--config: {path}: run.resume continues a run: give it as --resume PATH, alone")
    for name, values in out.items():
        # older key names read as their fields', so that a flag given for the field overrides them
        out[name] = values = canonical(SECTIONS[name], values, where=f"--config: {path}: ")
        known = {f.name for f in dataclasses.fields(SECTIONS[name])}
        for key in values:
            if key not in known:
                raise unknown_key("--config", path, key, _keys(), section=name)
    return out


def _keys() -> dict[str, list[str]]:
    return {name: list(names_of(cls)) for name, cls in SECTIONS.items()}


def _is_field(key: str) -> bool:
    """Whether ``key`` is also a setting of some section (``model``: the preset), flat in a file."""
    try:
        section_of(key)
    except ConfigError:
        return False
    return True


def build_job(flags: dict[str, Any], config_file: str | None = None) -> TrainJob:
    """Config file first, then flags (a flat dict of field name -> value) on top."""
    values = load_yaml(config_file) if config_file else {}
    from_file = {key for section in values.values() for key in section}
    for key, value in flags.items():
        section = section_of(key)
        # a flag given by an older name replaces the file's value under either name
        values[section] = {**values.get(section, {}), **canonical(SECTIONS[section], {key: value})}
    try:
        return TrainJob(**{name: from_dict(cls, values.get(name, {})) for name, cls in SECTIONS.items()})
    except ConfigError as e:
        key = getattr(e, "key", None)
        if key in from_file and key not in flags:  # the value the file gave
            raise ConfigError(f"--config: {config_file}: {e}") from None
        raise


def job_from_dict(d: dict[str, dict[str, Any]]) -> TrainJob:
    """Rebuild a job from its ``to_dict`` form (a checkpoint's config, a config.yaml)."""
    return TrainJob(**{name: from_dict(cls, d.get(name, {})) for name, cls in SECTIONS.items()})

