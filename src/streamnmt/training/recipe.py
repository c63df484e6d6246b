"""Recipe: the job's 'auto' settings resolved once, before anything is built.

The model preset, the token budget sized for the device, the warm-up that follows the tokens per
update, mixed precision, the attention, the BLEU decoding's dtype, the engine strategy and
``--compile auto``: each is decided here from the device and the data, said in one start line, and
recorded in config.yaml as the value it took.

Under torchrun rank 0 alone decides (:func:`resolve_job_for_ranks`, :func:`resolve_compile_for_ranks`)
and the other ranks take its job: ranks that each sized the batch for their own GPU would pack
batches of other sizes, and their collectives fall out of step or their schedules differ. Each rank
then checks that its own device can run that job (:func:`device_error`); if one cannot, every rank
stops with the same line naming it and the setting.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from streamnmt.checkpoint import load_checkpoint
from streamnmt.config import (
    EPOCHS_UNLIMITED,
    GPU_PRESETS,
    PLATEAU_PATIENCE,
    PRESETS,
    TIME_TO_BLEU_TOKENS,
    TOKENS_PER_GIB,
    WARMUP_TOKENS,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainJob,
    best_metric,
    builtin_size_for,
    corpus_dropout,
    corpus_label_smoothing,
    job_from_dict,
    recipe_budget,
    recipe_max_tokens,
    recipe_warmup,
)
from streamnmt.data import TokenizedCorpus, batch_plan
from streamnmt.data.config import (CPU_SENTENCE_BATCH, SENTENCE_BATCH, SMALL_CORPUS_PAIRS, DataConfig,
                                   small_corpus)
from streamnmt.data.writing import UNSPACED_SHARE, unspaced_share
from streamnmt.dist import Dist
from streamnmt.engine.auto import choose_compile, choose_strategy, graph_step_s
from streamnmt.errors import ConfigError, InputError
from streamnmt.inference.decoding import decode_dtype, dtype_name
from streamnmt.models.attention import flex_available, resolve_attention, triton_runs
from streamnmt.training.runs import check_project, check_weights_kept
from streamnmt.training.step import noam_lr

NOAM_FACTOR_FLOOR = 0.05  # --lr under it gives a peak no run trains at (the default factor is 1)


def shape_of_weights(job: TrainJob, log: Callable[[str], None]) -> TrainJob:
    """``--weights`` without ``--model`` or a size: the model its checkpoint holds (a fine-tune of a
    tiny model on the CPU was built at the CPU's default preset and refused the weights). The preset
    the checkpoint's run trained (its config), with the sizes the checkpoint holds where they differ from
    the preset's (so the preset's recipe follows: its built-in corpus, its warm-up); its tying too."""
    m = job.model
    if not job.run.weights or m.model != "auto" or any(v is not None for v in (m.d_model, m.n_layers, m.n_heads, m.d_ff)):
        return job
    ckpt = load_checkpoint(job.run.weights, mmap=True)  # its records only: the weights load with the model
    shape = ckpt.get("model_shape") or {}
    names = ("d_model", "n_layers", "n_heads", "d_ff")
    try:
        sizes = tuple(int(shape[k]) for k in names)
    except (KeyError, TypeError, ValueError):  # an older checkpoint: the preset rule, as before
        return job
    trained = ((ckpt.get("config") or {}).get("model") or {}).get("model")
    preset = trained if trained in PRESETS else next((p for p, dims in PRESETS.items() if dims == sizes), "base")
    own = {k: v for k, v, d in zip(names, sizes, PRESETS[preset]) if v != d}  # sizes off the preset's
    model = dataclasses.replace(m, model=preset, tie_embeddings=shape.get("tie_embeddings", m.tie_embeddings), **own)
    log(f"weights: the model of {job.run.weights}: {preset}{' with its sizes' if own else ''} ({sizes[1]}+{sizes[1]} "
        f"x {sizes[0]}, {sizes[2]} heads, d_ff {sizes[3]}; --model or a size to choose another)")
    return dataclasses.replace(job, model=model)


def resolve_job(job: TrainJob, device: torch.device, world: int, log: Callable[[str], None]) -> TrainJob:
    """Fill the 'auto' settings from the device; the result is what config.yaml records. A new run's
    first checks (rank 0 only, its error shared with the others): a --project it can make its folder in,
    and no --weights among the files a reused folder's earlier run leaves to be removed."""
    check_project(job.run.project)
    check_weights_kept(job.run.project, job.run.name, job.run.exist_ok, job.run.weights)
    cuda = device.type == "cuda"
    job = shape_of_weights(job, log)
    preset = job.model.model
    if preset == "auto":
        preset = "base" if cuda else "small"
        if not cuda:
            pairs = job.data.builtin_size or 16000
            corpus = f" and a {pairs}-pair built-in corpus" if job.data.data is None else ""  # not with --data
            log(f"no GPU: using the 'small' model preset{corpus} so a CPU run finishes in minutes "
                     "(--model base for the original size)")
    model = job.model.resolve(preset)
    model = dataclasses.replace(model, attention=resolve_attention(model.attention, device, log,
                                                                   head_dim=model.d_model // model.n_heads,
                                                                   attention_dropout=model.attention_dropout))
    if model.attention in ("flex", "triton") and model.attention_dropout:
        log(f"model: --attention {model.attention} has no attention dropout: --attention-dropout "
            f"{model.attention_dropout} is not applied")
    optim, run, data = job.optim, job.run, job.data
    data, optim = resolve_recipe(data, optim, model, job.engine.accum_steps, device, world, log)
    if optim.amp == "auto":  # bf16 where the GPU has it natively, else fp16 with the grad scaler
        optim = dataclasses.replace(optim, amp=("bf16" if device_bf16(device) else "fp16") if cuda else "off")
    run = resolve_end(run, cuda, job.data.data is not None, log)
    check_cooldown_end(optim, run)
    run = resolve_ema(run)
    if run.eval_dtype == "auto":  # the dtype rank 0 decodes BLEU in (bf16 where native, else fp32)
        run = dataclasses.replace(run, eval_dtype=dtype_name(decode_dtype(run.eval_dtype, device, "eval_dtype")))
    if data.builtin_size is None:
        data = dataclasses.replace(data, builtin_size=builtin_size_for(preset))
    if data.data and not os.path.isabs(data.data) and os.path.isdir(data.data):
        # config.yaml and the checkpoints name the corpus wherever they are used from: eval and --resume
        # started in another folder (a scheduler's job) did not find a relative --data
        data = dataclasses.replace(data, data=os.path.abspath(data.data))
    run = dataclasses.replace(run, device=str(device))
    strategy = choose_strategy(job.engine.sync_strategy, device)
    if job.engine.sync_strategy == "auto":
        log(f"engine: strategy {strategy.value} ({strategy.why})")
    engine = dataclasses.replace(job.engine, sync_strategy=strategy.value)
    return dataclasses.replace(job, model=model, optim=optim, run=run, data=data, engine=engine)


def resolve_corpus(job: TrainJob, data: Any, dropout_given: bool, log: Callable[[str], None]) -> TrainJob:
    """The settings chosen from the training corpus (``data``, prepare_data's bundle) once it is read:
    the dropout where --dropout was not given, the label smoothing where --label-smoothing was not, and
    where --src-vocab/--tgt-vocab were not, the sizes of the tokenizers it runs with (what config.yaml
    records, the same on every rank). One start line says the corpus it saw and what it chose; the rule
    is streamnmt.config.corpus_dropout and corpus_label_smoothing and streamnmt.data.config.auto_vocab,
    chosen on the real-text grid (docs/PERFORMANCE.md, "The recipe on real text")."""
    pairs, model, d = data.train_pairs, job.model, job.data
    d = dataclasses.replace(d, src_vocab=d.src_vocab or data.src_tok.vocab_size,
                            tgt_vocab=d.tgt_vocab or data.tgt_tok.vocab_size)
    if not dropout_given:
        model = dataclasses.replace(model, dropout=corpus_dropout(model.model, pairs))
    smoothing_given, unspaced, forms = model.label_smoothing is not None, None, None
    if not smoothing_given:
        if small_corpus(pairs):  # the only corpora the rule tells apart by their script and word forms
            unspaced = unspaced_share(data.train.tgt_tokens, data.tgt_tok.piece)
            if unspaced is None or unspaced < UNSPACED_SHARE:  # Chinese or Japanese decide alone
                forms = data.word_forms()
        model = dataclasses.replace(model, label_smoothing=corpus_label_smoothing(pairs, unspaced, forms))
    if pairs is not None:
        small = small_corpus(pairs)
        chose = [f"--dropout {model.dropout:g}" + ("" if dropout_given else " (auto)")]
        seen = ([] if unspaced is None else [f"{unspaced:.0%} of the target's letters Chinese or Japanese"]) + (
            [] if forms is None else [f"the target has {forms:.2f}x the source's word forms"])
        why = f": {', '.join(seen)}" if seen else ""
        chose.append(f"--label-smoothing {model.label_smoothing:g}" + ("" if smoothing_given else f" (auto{why})"))
        trained = {"source": data.src_tok.vocab_size, "target": data.tgt_tok.vocab_size,
                   "shared": data.src_tok.vocab_size}  # under the size asked where a cap held it (a data: line says why)
        chose += [f"{side} tokenizer of {size} pieces asked (auto{_why(side, data)})"
                  + (f", {trained[side]} trained" if trained[side] < size else "")
                  for side, size in data.auto_vocab.items()]
        if not data.auto_vocab:
            chose.append(f"the tokenizers given or found ({data.src_tok.vocab_size} source and "
                         f"{data.tgt_tok.vocab_size} target pieces)")
        kept, (_, tgt_tokens) = len(data.train), data.train.num_tokens()
        mean = f", {tgt_tokens / kept:.1f} target tokens a pair" if kept else ""
        log(f"recipe: a corpus of {pairs:,} training pairs{mean} ({'under' if small else 'at least'} "
            f"{SMALL_CORPUS_PAIRS:,}: the {'small' if small else 'large'}-corpus recipe): {'; '.join(chose)}; "
            "--dropout, --label-smoothing, --src-vocab and --tgt-vocab override it")
    return dataclasses.replace(job, model=model, data=d)


def _why(side: str, data: Any) -> str:
    """Why the rule asked or capped ``side`` apart from its size, where it did, as the tokenizers'
    training recorded it (streamnmt.data.tokenizer_training: the target's cap, target_cap; the
    source's, source_within_target)."""
    why = data.auto_why.get(side, "")
    return f": {why}" if why else ""


def resolve_end(run: RunConfig, cuda: bool, own_corpus: bool, log: Callable[[str], None]) -> RunConfig:
    """When a run ends where ``--epochs`` or ``--patience`` was not given. A time slot (--time-limit)
    or a step count (--max-steps) is trained to its end, as fairseq's (--max-update) and Marian's
    (--after-batches) defaults do. A --data corpus on a GPU given no
    end (no --time-limit, --epochs or --max-steps) trains until its plateau: --patience
    PLATEAU_PATIENCE evaluations unless given (Marian's --early-stopping; --patience 0 keeps the
    fixed epochs). Otherwise a short fixed run: 10 epochs on a GPU (the built-in corpus's demo),
    2 on a CPU."""
    plateau = (cuda and own_corpus and run.epochs is None and not run.time_limit and not run.max_steps
               and run.patience != 0)
    patience = run.patience if run.patience is not None else PLATEAU_PATIENCE if plateau else 0
    epochs = run.epochs
    if epochs is None:
        epochs = EPOCHS_UNLIMITED if run.time_limit or run.max_steps or plateau else 10 if cuda else 2
    if plateau:
        metric = "dev BLEU" if best_metric(run) == "bleu" else "the validation loss"
        log(f"recipe: trains until its plateau: stops once {metric} has not improved for {patience} "
            f"evaluations in a row (--patience {patience}{'' if run.patience else ', auto'}: no --time-limit, "
            "--epochs or --max-steps given; Ctrl-C or SIGTERM also end it, saved)")
    return dataclasses.replace(run, epochs=epochs, patience=patience)


def check_cooldown_end(optim: OptimConfig, run: RunConfig) -> None:
    """--lr-cooldown needs the run's end (a time limit or a step count): a run that trains until its
    plateau (:func:`resolve_end`) has none to cool down to."""
    if optim.lr_cooldown and run.epochs >= EPOCHS_UNLIMITED and not run.time_limit and not run.max_steps:
        raise ConfigError(f"--lr-cooldown {optim.lr_cooldown:g}: the run has no end to cool down to (no "
                          "--time-limit, --max-steps or --epochs: it trains until its plateau); give one of them")


def resolve_ema(run: RunConfig) -> RunConfig:
    """``--eval-ema`` unset: on wherever the moving average is kept (``--ema`` above 0, the default)."""
    return dataclasses.replace(run, eval_ema=run.eval_ema if run.eval_ema is not None else run.ema > 0)


def resolve_recipe(data: DataConfig, optim: OptimConfig, model: ModelConfig, accum: int, device: torch.device,
                   world: int, log: Callable[[str], None]) -> tuple[DataConfig, OptimConfig]:
    """The default token budget (on a GPU), the sentences per batch where batches are counted in
    sentences (the CPU's default) and the warm-up that follows the tokens per update (rules and
    reference in streamnmt.config and streamnmt.data.config); one start line says what was chosen
    and why."""
    notes, d_model = [], model.d_model
    if data.max_tokens is None:
        gib = device_memory_gib(device)
        if gib is not None:
            tokens = max(recipe_budget(gib, d_model), data.max_len)
            held = recipe_max_tokens(gib, d_model)
            memory = (f"{TOKENS_PER_GIB} per GiB of the GPU's {gib:.0f} GiB at d_model 512, x 512/{d_model}, "
                      f"a power of two")
            why = (f"the best time to BLEU measured, within the {held} that {memory} allows"
                   if held > TIME_TO_BLEU_TOKENS else f"{memory}; at most {TIME_TO_BLEU_TOKENS}, the best time to BLEU")
            notes.append(f"--max-tokens {tokens} (auto: {why})")
        else:
            tokens = 0  # CPU: small batches of --batch-size sentences keep a CPU run short
        data = dataclasses.replace(data, max_tokens=tokens)
    if data.batch_size is None:
        cpu = device.type != "cuda"
        data = dataclasses.replace(data, batch_size=CPU_SENTENCE_BATCH if cpu else SENTENCE_BATCH)
        if cpu and not data.max_tokens:
            notes.append(f"--batch-size {data.batch_size} (auto: sentences a batch on the CPU)")
    if optim.warmup is None:
        if data.max_tokens:
            per_update = data.max_tokens * accum * world
            warmup = recipe_warmup(per_update)
            notes.append(f"--warmup {warmup} (auto: {WARMUP_TOKENS / 1e6:.1f}M tokens over {per_update} "
                         f"per update; peak lr {noam_lr(warmup, d_model, warmup, optim.lr):.2e})")
        else:
            warmup = 4000 if model.model in GPU_PRESETS else 400  # sentence batches: per preset (paper: 4000)
        optim = dataclasses.replace(optim, warmup=warmup)
    if notes:
        log("recipe: " + "; ".join(notes))
    if optim.lr < NOAM_FACTOR_FLOOR:  # a peak learning rate given as the factor (fairseq's, OpenNMT's --lr)
        unit = noam_lr(optim.warmup, d_model, optim.warmup, 1.0)
        log(f"warning: --lr {optim.lr:g} is the Noam schedule's factor, not a learning rate: its peak (step "
            f"{optim.warmup}) is {optim.lr * unit:.2e}; a peak of 5e-4 (fairseq's and OpenNMT's --lr) is "
            f"--lr {5e-4 / unit:.3g} here")
    return data, optim

def resolve_compile(job: TrainJob, train: TokenizedCorpus, device: torch.device, world: int,
                    log: Callable[[str], None]) -> TrainJob:
    """``--compile auto``: decided from the run's planned steps and batch shapes (see engine.auto), at
    the warm compile cost where the persistent compile cache holds this step's artefacts; a run that
    compiles has that cache staged for make_step (streamnmt.training.compile_cache)."""
    from streamnmt.engine.auto import COMPILE_S_PER_SHAPE, COMPILE_S_PER_SHAPE_WARM
    from streamnmt.training import compile_cache
    from streamnmt.training.step import inductor_key

    per_epoch, shapes = batch_plan(train, job.data)
    steps = per_epoch * job.run.epochs // world  # micro-batches each process runs
    if job.run.max_steps:
        steps = min(steps, job.run.max_steps * job.engine.accum_steps)
    tokens = max((b * t for b, _, t in shapes), default=0)  # target positions of the largest step
    m = job.model  # sizes resolved from the preset by now
    rule = job.engine.compile == "auto" and device.type == "cuda" and job.engine.sync_strategy == "graph"

    def decide(compile_s: float):
        return choose_compile(job.engine.compile, device, job.engine.sync_strategy, steps, len(shapes),
                              graph_step_s(tokens, m.n_layers, m.d_model, m.d_ff),
                              job.run.time_limit_s() or 0.0, compile_s=compile_s,
                              open_ended=job.run.epochs >= EPOCHS_UNLIMITED and not job.run.max_steps)

    # The cache is keyed only where the answer matters (the key reads the tokenizers and the GPU's
    # name), and from what Inductor's options depend on, not from Inductor itself (importing it
    # costs seconds of a run's start-up; docs/PERFORMANCE.md, "Evaluation and checkpoints in a run").
    cache = None
    if job.engine.compile in ("on", "background") or (rule and decide(COMPILE_S_PER_SHAPE_WARM).value):
        cache = compile_cache.CompileCache(compile_cache.job_key(job, shapes, device, world, inductor_key()))
    warm = cache is not None and cache.warm
    if job.engine.compile == "background":
        # a child process compiles beside training (streamnmt.training.compile_child); where the cache
        # is warm compiling here takes seconds, and under torchrun each rank compiles in its own process
        why = ("the compile cache is warm: compiling here takes seconds" if warm else
               "several processes: each compiles its own step" if world > 1 else "")
        log(f"engine: compile {'on (--compile background: ' + why + ')' if why else 'in the background'}")
        compile_cache.stage(cache, log)  # the directories the child inherits; its key, for the child's manifest
        return dataclasses.replace(job, engine=dataclasses.replace(job.engine, compile="on" if why else "background"))
    choice = decide(COMPILE_S_PER_SHAPE_WARM if warm else COMPILE_S_PER_SHAPE)
    if job.engine.compile == "auto":
        note = (f"; compile cache {'warm' if warm else 'cold'}" if cache is not None else
                "; off even with a warm compile cache" if rule else "")
        log(f"engine: compile {'on' if choice.value else 'off'} ({choice.why}{note})")
    compile_cache.stage(cache if choice.value else None, log)  # directories and mega-cache, before make_step
    return dataclasses.replace(job, engine=dataclasses.replace(job.engine, compile="on" if choice.value else "off"))


# -- one job for all ranks ------------------------------------------------------------------------

RESUME_HINT = ("; a resumed run keeps its settings: resume on devices like the one it started on, or start "
               "a new run from its weights (--weights .../last.pt) with the setting changed")


def resolve_job_for_ranks(job: TrainJob, device: torch.device, d: Dist, log: Callable[[str], None],
                          resumed: bool = False, origin: dict[str, Any] | None = None
                          ) -> tuple[TrainJob, RankDevice]:
    """The job every rank runs and the device it was sized for: rank 0 resolves the 'auto'
    settings (:func:`resolve_job`) and broadcasts them with what its device can do; the other ranks
    take them, keeping their own ``--device`` (cuda:LOCAL_RANK); then each rank checks that its
    device can run the job, and if one cannot, every rank raises the same ConfigError naming that
    rank and the setting. A resumed run keeps its checkpoint's job, sized for ``origin`` (the
    checkpoint's ``recipe_device``: rank 0's device when the run started), against which every rank
    is checked, rank 0 and a single process included (older checkpoints: rank 0's device now)."""
    first = None
    if resumed and origin:
        try:  # a checkpoint of another version may record other fields: then nothing to check against
            first = RankDevice(**origin)
        except TypeError:
            first = None
    label = "the GPU this run started on" if first is not None else "rank 0"
    if not d.active:
        if not resumed:
            job = resolve_job(job, device, d.world, log)
        mine = rank_device(device, job, log)
        error = device_error(job, mine, first, 0, 1, label) if first is not None else None
        if error:
            raise ConfigError(error + RESUME_HINT)
        return job, first or mine
    if d.main:
        try:
            if not resumed:
                job = resolve_job(job, device, d.world, log)
            shared = {"job": job.to_dict(), "device": rank_device(device, job, log)}
        except (ConfigError, InputError) as e:  # the others would wait for a job that never comes
            d.broadcast({"error": e}, "dist.recipe")
            raise
        d.broadcast(shared, "dist.recipe")
    else:
        shared = d.broadcast(None, "dist.recipe")
        if "error" in shared:
            raise shared["error"]
        if not resumed:  # a resumed run's job is the checkpoint's on every rank already
            job = job_from_dict(shared["job"])
            job = dataclasses.replace(job, run=dataclasses.replace(job.run, device=str(device)))
    mine = shared["device"] if d.main else rank_device(device, job, log)
    first = first or shared["device"]
    errors = d.gather(device_error(job, mine, first, d.rank, d.world, label), "dist.recipe")
    failed = [e for e in errors if e is not None]
    if failed:  # the lowest failing rank's line, the same on every rank
        raise ConfigError(failed[0] + (RESUME_HINT if resumed else ""))
    return job, first


def resolve_compile_for_ranks(job: TrainJob, train: TokenizedCorpus, device: torch.device, d: Dist,
                              log: Callable[[str], None]) -> TrainJob:
    """``--compile auto`` (:func:`resolve_compile`) decided by rank 0 for every rank: a compiled rank
    beside an eager one would run other kernels and another step time, and ranks whose compile
    caches differ (warm on one, cold on another) would estimate other costs. The other ranks then
    run :func:`resolve_compile` with rank 0's choice as their request, so that what it prepares for
    the step (the compile cache) follows the choice they run."""
    if not d.active:
        return resolve_compile(job, train, device, d.world, log)
    if d.main:
        try:
            job = resolve_compile(job, train, device, d.world, log)
        except (ConfigError, InputError) as e:  # the others would wait for a choice that never comes
            d.broadcast({"error": e}, "dist.recipe")
            raise
        d.broadcast({"compile": job.engine.compile}, "dist.recipe")
        return job
    shared = d.broadcast(None, "dist.recipe")
    if "error" in shared:
        raise shared["error"]
    job = dataclasses.replace(job, engine=dataclasses.replace(job.engine, compile=shared["compile"]))
    return resolve_compile(job, train, device, d.world, log)


@dataclass(frozen=True)
class RankDevice:
    """What one rank's device offers that the resolved job depends on."""

    name: str  # the device and its name (torch.cuda.get_device_name), for the error line
    gib: float | None  # memory (None on the CPU: no token budget is sized from it)
    bf16: bool  # native bf16
    flex: str | None  # why FlexAttention cannot train here (None: it can, or --attention is not flex)
    # why the Triton segment kernels cannot train here (None: they can, or --attention is not triton);
    # a default, so that a checkpoint's record from before the field still loads
    triton: str | None = None


def rank_device(device: torch.device, job: TrainJob, log: Callable[[str], None] = print) -> RankDevice:
    name = f"{device}, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else str(device)
    m = job.model
    flex = flex_available(device) if m.attention == "flex" else None
    triton = triton_runs(device, m.d_model // m.n_heads, log) if m.attention == "triton" and m.n_heads else None
    return RankDevice(name, device_memory_gib(device), device_bf16(device), flex, triton)


def device_error(job: TrainJob, mine: RankDevice, first: RankDevice, rank: int, world: int,
                 origin: str = "rank 0") -> str | None:
    """Why this rank's device cannot run ``job``, which was resolved on device ``first`` (rank 0's,
    or for a resume the one the run started on: ``origin`` names it); None if it can. A rank fails a
    check only where it falls short of that device: what it runs is the recipe's or the user's
    choice, as on one process, and a rank at least as capable runs it too."""
    who = f"rank {rank} of {world} ({mine.name})"
    tokens, d_model = job.data.max_tokens, job.model.d_model
    if tokens and d_model and mine.gib is not None and first.gib is not None:
        own, first_own = recipe_max_tokens(mine.gib, d_model), recipe_max_tokens(first.gib, d_model)
        # The rule's tokens per GiB leave headroom (the base model trained batches four times the
        # rule's budget: docs/PERFORMANCE.md, "Token budgets"), so a rank safely runs up to
        # twice its own rule's budget (a GPU of half rank 0's memory runs rank 0's auto budget).
        # Beyond that, on a smaller GPU than rank 0's (a smaller power of two by the rule, so that
        # GPUs of one kind never fail, whatever --max-tokens the user chose), it would run out of
        # memory where rank 0 does not.
        if own < first_own and tokens > 2 * own:
            return (f"--max-tokens (config key 'max_tokens'): {tokens} tokens per batch, sized for {origin} "
                    f"({first.gib:.0f} GiB), but {who} has {mine.gib:.0f} GiB, for which the recipe sizes {own} at "
                    f"d_model {d_model}; more than twice that would run out of memory there: set --max-tokens "
                    f"{2 * own} or less, or use GPUs of one size")
    if job.optim.amp == "bf16" and first.bf16 and not mine.bf16:
        # Emulated bf16 runs at a fraction of the speed, and DDP runs every rank at the slowest's.
        return (f"--amp (config key 'amp'): bf16, native on {origin}, but {who} has no native bf16: set --amp fp16 "
                f"(or off) for every rank, or use GPUs of one kind")
    if job.model.attention == "flex" and first.flex is None and mine.flex is not None:
        return (f"--attention (config key 'attention'): flex, which {origin} runs, but {who} cannot ({mine.flex}): "
                f"set --attention sdpa")
    if job.model.attention == "triton" and first.triton is None and mine.triton is not None:
        # the ranks would run other attention kernels (``auto`` resolved to triton on rank 0)
        return (f"--attention (config key 'attention'): triton, which {origin} runs, but {who} cannot "
                f"({mine.triton}): set --attention sdpa")
    # eval_dtype needs no check: rank 0 alone decodes BLEU, on the device that chose it.
    return None


def device_memory_gib(device: torch.device) -> float | None:
    """GiB of memory of ``device``; None on the CPU (the recipe sizes no token budget there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2 ** 30


def device_bf16(device: torch.device) -> bool:
    """``device`` is a GPU that computes bf16 natively (the current device: the trainer sets it)."""
    return device.type == "cuda" and native_bf16()


def native_bf16() -> bool:
    """The GPU computes bf16 natively (not emulated; torch < 2.4 has no ``including_emulation``)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:
        return torch.cuda.is_bf16_supported()
