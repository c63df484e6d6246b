"""A training run's parts, built from a job: :func:`build_run` returns a :class:`Run` (process,
data, model and step function, engine, loaders, evaluator, checkpoints, metrics, time budget and
run directory), with a checkpoint's state restored into them for ``--resume`` (:func:`resume_job`).

The builder makes the parts in the order each needs the ones before it, validating as it goes, so
that a bad setting stops the run before anything is written. The loop that runs the parts is
:class:`streamnmt.training.trainer.Trainer`; the recipe's auto settings are decided in
:mod:`streamnmt.training.recipe`.
"""


from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from streamnmt import dist as distributed
from streamnmt import setupclock
from streamnmt.checkpoint import embedded_tokenizers, load_checkpoint, load_model_weights, tokenizers_of_weights
from streamnmt.config import RESUME_SETTINGS, DataConfig, ModelConfig, TrainJob, job_from_dict
from streamnmt.configbase import canonical
from streamnmt.data import batch_shapes, make_loader, make_sampler, prepare_data
from streamnmt.data.prepare import prepare_once
from streamnmt.devices import resolve_device, seed_everything
from streamnmt.engine import DeferredLosses, make_strategy
from streamnmt.errors import ConfigError, InputError
from streamnmt.fsutil import atomic_write
from streamnmt.inference.decoding import decode_dtype
from streamnmt.models.attention import resolve_attention, settle_triton
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.checkpointer import remove_stale_temporaries, repair_safetensors_beside
from streamnmt.training import compile_cache, compile_child
from streamnmt.training.checkpoints import CheckpointManager
from streamnmt.training.cooldown import Cooldown, steps_of_run
from streamnmt.training.evaluator import Evaluator
from streamnmt.training.loop_evaluation import LoopEvaluation
from streamnmt.training.metrics import RunMetrics
from streamnmt.training.recipe import resolve_compile_for_ranks, resolve_corpus, resolve_job_for_ranks
from streamnmt.training.reporting import overlong_note, running, warmup_note
from streamnmt.training.runs import increment_path, is_earlier_weights
from streamnmt.training.step import example_batch, import_in_background, make_step
from streamnmt.training.stopping import TimeBudget, command_start

@dataclasses.dataclass
class Start:
    """Where the loop starts: a new run at 0, a resumed one where its checkpoint was written."""

    step: int = 0
    epoch: int = 0
    epoch_pos: int = 0  # micro-batches of the epoch already trained


@dataclasses.dataclass
class Run:
    """A run's parts, as :func:`build_run` made them; the loop
    (:class:`streamnmt.training.trainer.Trainer`) runs them."""

    job: TrainJob
    log: Callable[[str], None]
    dist: Any  # streamnmt.dist's process group (one process: inactive)
    device: torch.device
    recipe_device: Any  # the device the auto settings were sized for
    data: Any  # tokenizers and tokenized splits
    shape: ModelShape
    model: Transformer
    train_step: Any  # the step function: loss, backward, optimizer, schedule, scaler, EMA
    strategy: Any  # the engine's strategy
    losses: DeferredLosses
    train_loader: Any
    evaluator: Evaluator
    budget: TimeBudget
    setup_s: dict[str, float]  # the set-up's seconds per part (the set-up line)
    t_command: float  # when the command started (time.monotonic)
    bleu_dtype: torch.dtype | None
    # made after the parts above, in this order
    evaluations: LoopEvaluation = None  # type: ignore[assignment]
    checkpoints: CheckpointManager = None  # type: ignore[assignment]
    start: Start = dataclasses.field(default_factory=Start)
    # the earlier processes' wall clock up to the resumed state (None: unknown)
    wall_before: float | None = 0.0
    save_dir: Path = Path()
    metrics: RunMetrics = None  # type: ignore[assignment]
    cooldown: Cooldown | None = None  # --lr-cooldown's plan (None: off)
    background_compile: Any = None  # --compile background: the child compiling the step (None: none)

    def examples(self) -> list[Any]:
        """One example batch per training batch shape: what the engine prepares (captures) the step on."""
        return [example_batch(shape, self.shape, self.job.run.seed, packed=self.job.data.packs)
                for shape in self.train_loader.shapes()]

    def wall_s(self) -> float | None:
        """Seconds of wall clock the run has taken to reach its current state: this command's, from
        its start, plus the earlier processes' up to the checkpoint it resumed from (None where that
        checkpoint did not say)."""
        return None if self.wall_before is None else self.wall_before + self.budget.elapsed()


def build_run(job: TrainJob, log: Callable[[str], None] = print, resume: dict[str, Any] | None = None) -> Run:
    """The parts of a run of ``job`` (the auto settings resolved once, on rank 0 for all ranks).
    ``resume`` is a loaded checkpoint to continue from: the run continues in its own directory,
    mid-epoch, with model, optimizer, schedule, scaler, RNG, data order, evaluation cadence and
    early-stopping state as they were."""
    return _RunBuilder(job, log, resume).run


class _RunBuilder:
    """Builds a :class:`Run` part by part, timing each (the set-up line)."""

    def __init__(self, job: TrainJob, log: Callable[[str], None] = print, resume: dict[str, Any] | None = None):
        # Each build step validates what it makes; errors before _build_run_dir leave nothing behind.
        # Where the set-up's seconds go is said in one start line (docs/PERFORMANCE.md, "Evaluation
        # and checkpoints in a run": set-up is most of what a short run spends outside training).
        self.t_command = command_start()  # --time-limit and the end line count from the command's start
        self.setup_s: dict[str, float] = {"start-up": time.monotonic() - self.t_command}
        self.asked_attention = job.model.attention  # as given (auto, triton, ...): named where it falls back
        self.dropout_given = job.model.dropout is not None  # else the corpus rule chooses it (a new run)
        with self._phase("device"):
            self._build_process(job, log)
        with self._phase("recipe"):
            # the device the job's auto settings were sized for (a resume: the one the run started on)
            self.job, self.recipe_device = resolve_job_for_ranks(
                job, self.device, self.dist, self.log, resumed=resume is not None,
                origin=(resume or {}).get("recipe_device"))
        with self._phase("data"):
            self._build_data(resume)
        self.setup_s["data"] -= self.setup_s.get("imports", 0.0)  # the rest of the imports' thread, waited for
        with self._phase("model"):
            self._build_model(resume)
            self._build_engine()
        with self._phase("loaders"):
            self._build_loaders()
            self._build_state(resume)
        with self._phase("engine"):
            self._prepare_engine()
        with self._phase("run dir"):
            self._build_run_dir(resume)
            self._build_logs(resume)
        self._log_start(resume)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Time one part of the set-up (host clock; what it queued on the GPU is waited for by the
        parts that need it, so the seconds land where the waiting is)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.setup_s[name] = self.setup_s.get(name, 0.0) + time.monotonic() - t0
            setupclock.close(name)  # what dominated it, said in the set-up line

    def _build_process(self, job: TrainJob, log: Callable[[str], None]) -> None:
        """Process group (under torchrun), this rank's device and log, determinism and seeds."""
        self.dist = distributed.init(job.engine.dist_backend, job.run.device, job.engine.dist_timeout)
        self.log = log if self.dist.main else distributed.quiet  # other ranks: errors only
        self.device = self.dist.device or resolve_device(job.run.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # so that streams, events and graphs default to it
        if self.device.type == "cuda":
            # The CUDA context is made here (a first allocation), not inside whichever later part
            # touches the GPU first, so the set-up line says what it costs.
            torch.empty((), device=self.device)
        if job.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        seed_everything(job.run.seed)
        self.bleu_dtype = decode_dtype(job.run.eval_dtype, self.device, "eval_dtype")

    def _build_data(self, resume: dict[str, Any] | None) -> None:
        """Tokenizers and tokenized splits; then the settings that depend on the data (--compile auto)."""
        if resume is None:  # --weights: the tokenizers its checkpoint carries (identical files on every rank)
            self.job = tokenizers_of_weights(self.job, self.log)
        # TorchDynamo, where the run is known to need it (--compile on, flex attention, DDP), loads on
        # a thread while the data is prepared: preparing imports no torch module, so the two never
        # wait on one module's import lock; joined before anything after it imports torch modules.
        # --compile auto is decided after the data: a run it compiles imports TorchDynamo in
        # make_step, one that stays eager never does (docs/PERFORMANCE.md, "Evaluation and
        # checkpoints in a run").
        flex = self.job.model.attention == "flex" and self.device.type == "cuda"
        imports = import_in_background(compiled=self.job.engine.compile == "on" or flex, ddp=self.dist.active)
        try:
            self.data = prepare_once(self.dist, lambda: prepare_data(self.job.data, log=self.log),
                                     lambda bundle: bundle.fingerprint(),
                                     lambda: prepare_data(self.job.data, log=self.log, build=False))
        finally:
            if imports is not None:
                t0 = time.monotonic()
                imports.join()
                self.setup_s["imports"] = time.monotonic() - t0  # said apart from the data's own seconds
        if resume is not None:
            self._check_tokenizers(resume)
            state = resume.get("sampler") or {}
            if self.job.data.packs and "epoch" in state:
                # The resumed epoch's rows are planned in the planner process while the model is built
                # and compiled, not when _restore needs them (seconds of set-up on 1M pairs).
                sampler = make_sampler(self.data.train, self.job.data, train=True,
                                       seed=int(state.get("seed", self.job.run.seed)))
                sampler.plan_ahead(int(state["epoch"]))
        else:
            self.job = resolve_corpus(self.job, self.data, self.dropout_given, self.log)
            self.job = resolve_compile_for_ranks(self.job, self.data.train, self.device, self.dist, self.log)

    def _build_model(self, resume: dict[str, Any] | None) -> None:
        """The model (from --weights if given) and the step function: optimizer, schedule, scaler."""
        job, m = self.job, self.job.model
        self.shape = ModelShape(self.data.src_tok.vocab_size, self.data.tgt_tok.vocab_size, m.d_model,
                                m.n_layers, m.n_heads, m.d_ff, m.dropout,
                                max_positions=max(1024, job.data.max_len + 8), tie_embeddings=m.tie_embeddings,
                                attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout)
        # Built on the GPU it trains on, as translate's models are: the random initialisation (each
        # matrix filled twice) is most of a warm set-up's model phase on the CPU (docs/PERFORMANCE.md,
        # "The set-up before the first step"). Several ranks build on the CPU: a GPU's random stream
        # depends on its kind, and ranks on GPUs of two kinds must start from the same weights. One
        # rank has no peer to agree with: it builds where a plain run does, so the two start alike.
        here = self.device.type == "cuda" and self.dist.world == 1
        with torch.device(self.device) if here else contextlib.nullcontext():
            self.model = Transformer(self.shape)
        self.model.to(self.device)  # the positional table, computed on the CPU (and all of it there)
        self.model.set_attention(resolve_attention(m.attention, self.device, self.log, head_dim=m.d_model // m.n_heads,
                                                   attention_dropout=m.attention_dropout))
        if job.run.weights and resume is None:
            load_model_weights(self.model, load_checkpoint(job.run.weights), job.run.weights)
            self.log(f"weights: started from {job.run.weights}")
        if self.dist.rank > 0:  # same initial weights on every rank, its own dropout stream after
            torch.manual_seed(job.run.seed + 1_000_003 * self.dist.rank)
        self.train_step = make_step(self.model, self.device, d_model=m.d_model, lr=job.optim.lr,
                                 warmup=job.optim.warmup, amp=job.optim.amp, clip=job.optim.clip_grad,
                                 label_smoothing=m.label_smoothing, compile=self._compiles_here(),
                                 shapes=len({*batch_shapes(self.data.train, job.data),  # validation's too
                                             *batch_shapes(self.data.dev, job.data, train=False)}), ema=job.run.ema or 0.0,
                                 ema_every=job.run.ema_every,
                                 ddp=self.dist.active, bucket_cap_mb=job.engine.bucket_cap_mb)
        self.optimizer, self.schedule, self.scaler = (self.train_step.optimizer, self.train_step.schedule,
                                                      self.train_step.scaler)

    def _build_engine(self) -> None:
        """The strategy; its streams are created once, here."""
        self.strategy = make_strategy(self.job.engine.sync_strategy, self.device, self.job.engine, log=self.log)

    def _build_loaders(self) -> None:
        """This rank's training loader (its share of each global step) and the validation loader."""
        job, k, d = self.job, self.job.engine.accum_steps, self.dist
        workers = job.data.workers
        if self.strategy.wants_workers and workers == 0:
            workers = min(4, os.cpu_count() or 1)
            self.log(f"engine: '{self.strategy.name}' loads in worker processes: --workers {workers}")
        pin = self.device.type == "cuda"
        self.train_loader = make_loader(self.data.train, dataclasses.replace(job.data, workers=workers),
                                        train=True, seed=job.run.seed, pin_memory=pin, accum=k, world=d.world,
                                        rank=d.rank)
        if d.active and (empty := self.train_loader.sampler.empty_rank()) is not None:
            raise ConfigError(f"--nproc: {d.world} processes leave rank {empty} without a single training pair "
                              f"({len(self.data.train)} pairs, batches of {job.data.sentences} x --accum-steps {k}"
                              f" per rank); use fewer processes or a smaller --batch-size")
        # Validation packed like training (where it packs): one batch shape, the training's, so the
        # first evaluation meets no new matrix shapes and validation replays one graph.
        packed = self.train_loader.shapes()[0] if job.data.packs else None
        self.dev_loader = make_loader(self.data.dev, dataclasses.replace(job.data, workers=0), train=False,
                                      seed=job.run.seed, pin_memory=pin, packed_shape=packed)

    def _build_state(self, resume: dict[str, Any] | None) -> None:
        """Deferred losses, the evaluator, checkpoints, the time budget; a checkpoint's state on resume."""
        job, d = self.job, self.dist
        # Each step's plain NLL (summed like the loss), gradient norm and skipped flag travel with its
        # loss (no extra sync); with DDP on a GPU, waits on replayed collectives poll with a deadline.
        wait = (lambda ev: distributed.wait_event(ev, d.timeout_s)) if d.active and self.device.type == "cuda" else None
        stats = self.train_step.stats
        losses = DeferredLosses(self.device, job.engine.loss_interval, group=job.engine.accum_steps,
                                reduce=d.reduce_sum_ if d.active else None, values=("nll",),
                                extras={"grad_norm": stats[0], "skipped": stats[1]}, wait=wait)
        # validation, BLEU, best.pt's choice, --patience and when to evaluate
        evaluator = Evaluator(model=self.model, amp_dtype=self.train_step.amp_dtype, dev_loader=self.dev_loader,
                              data=self.data, job=job, device=self.device, dist=d, bleu_dtype=self.bleu_dtype,
                              log=self.log)
        self.run = run = Run(job=job, log=self.log, dist=d, device=self.device, recipe_device=self.recipe_device,
                             data=self.data, shape=self.shape, model=self.model, train_step=self.train_step,
                             strategy=self.strategy, losses=losses, train_loader=self.train_loader,
                             evaluator=evaluator, budget=TimeBudget(job.run.time_limit_s(), t0=self.t_command),
                             setup_s=self.setup_s, t_command=self.t_command, bleu_dtype=self.bleu_dtype)
        run.evaluations = LoopEvaluation(run)
        if job.optim.lr_cooldown:
            end = steps_of_run(job.run.max_steps, job.run.epochs, len(self.train_loader), job.engine.accum_steps)
            run.cooldown = Cooldown(job.optim.lr_cooldown, self.train_step.schedule, run.budget, end_step=end,
                                    log=self.log)
        run.checkpoints = CheckpointManager(run, save_dir_of_resume(job) if resume is not None else Path())
        if resume is not None:
            epoch, epoch_pos = run.checkpoints.restore(resume)
            run.start = Start(resume["step"], epoch, epoch_pos)
            # a checkpoint written before checkpoints carried it: the earlier seconds are unknown
            run.wall_before = float(resume["wall_s"]) if resume.get("wall_s") is not None else None
            run.evaluations.restore(resume)
            run.checkpoints.read_best_on_disk()

    def _prepare_engine(self) -> None:
        """The strategy's set-up (graph capture). Graph capture restores every state tensor and the
        RNG after its warm-up, so it is correct before or after a restore. First the Triton kernels'
        build check, owed to the child processes that compiled them beside the set-up so far."""
        why = settle_triton(self.log)
        if why is not None and self.model.attention == "triton":
            self.log(f"model: --attention {self.asked_attention}: {why}; using sdpa")
            self.model.set_attention("sdpa")
            self.job = dataclasses.replace(self.job, model=dataclasses.replace(self.job.model, attention="sdpa"))
            self.run.job = self.job  # the run's checkpoints and config.yaml say what trains
            self.run.checkpoints.use_job(self.job)
        self.strategy.prepare(self.train_step, self.run.examples())
        # Several ranks: graph capture succeeded everywhere, or every rank stops with one line.
        self.dist.agree_on_capture(self.strategy.report.get("capture_error"))
        self.train_step.compile_ready(self.log)  # --compile: artefacts saved; "engine: ready in X s" (cache warm/cold)
        if self.job.engine.compile == "background" and not self.dist.active:
            self.run.background_compile = self._start_compile_child()

    def _compiles_here(self) -> bool:
        """The step compiles in this process: --compile on, or a resumed --compile background run
        under torchrun (a new one is made "on" by resolve_compile; no rank starts a child)."""
        c = self.job.engine.compile
        return c == "on" or (c == "background" and self.dist.active)

    def _start_compile_child(self) -> Any:
        """--compile background: the child that compiles the step while the run trains uncompiled (its
        key staged by resolve_compile; a resumed run's child fills the directories alone)."""
        cache = compile_cache.take_staged() or compile_cache.CompileCache(None, since="the model").stage(self.log)
        job = self.job
        return compile_child.start(shape=self.shape, attention=self.model.attention, amp=job.optim.amp,
                                   label_smoothing=job.model.label_smoothing, clip=job.optim.clip_grad,
                                   device=self.device, batch_shapes=self.train_loader.shapes(),
                                   packed=job.data.packs, seed=job.run.seed, deterministic=job.run.deterministic,
                                   facts=cache.facts, cache_root=str(cache.root), log=self.log)

    def _build_run_dir(self, resume: dict[str, Any] | None) -> None:
        """The run directory (only now that everything above is valid): rank 0 makes it, the others learn it."""
        r, run = self.job.run, self.run
        if resume is not None:
            run.save_dir = save_dir_of_resume(self.job)
            if self.dist.main:  # a write that a kill interrupted left its temporary file, or
                remove_stale_temporaries(run.save_dir / "weights")  # came between best.pt and its .safetensors
                repair_safetensors_beside(run.save_dir / "weights" / "best.pt", self.log)
        elif not self.dist.main:
            run.save_dir = Path(self.dist.broadcast(None, "dist.setup"))  # rank 0's choice
        else:
            run.save_dir = increment_path(r.project, r.name, r.exist_ok)
            (run.save_dir / "weights").mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(run.save_dir / "weights")
            # --exist-ok: an earlier run's best, EMA, step files and last.pt are not ours (its last.pt
            # beside this run's config.yaml would be resumed as this run's after a kill before the
            # first save), so they go before the config is written
            for stale in (run.save_dir / "weights").iterdir():
                if is_earlier_weights(stale.name):
                    stale.unlink(missing_ok=True)
            atomic_write(run.save_dir / "config.yaml", self.job.to_yaml())
            self.dist.broadcast(str(run.save_dir), "dist.setup")
        run.checkpoints.save_dir = run.save_dir

    def _build_logs(self, resume: dict[str, Any] | None) -> None:
        """CSV logs and scalars (rank 0 writes; the others hold null logs). A new run in a reused
        directory starts its logs afresh; a resumed one keeps its past."""
        run = self.run
        step, launched = run.start.step, run.evaluations.launched
        # evals.csv: up to the checkpoint's step, less an evaluation it recorded undecided (written
        # again when the resumed run decides it)
        pending = launched["step"] - 1 if run.evaluator.pending is not None and launched else step
        run.metrics = RunMetrics(run.save_dir, main=self.dist.main, tensorboard=self.job.run.tensorboard,
                                 run=self.job.run, log=self.log, step=step, epoch=run.start.epoch,
                                 evals_after=min(step, pending), resumed=resume is not None,
                                 overflow_skips=self.train_step.scaler is not None)

    def _log_start(self, resume: dict[str, Any] | None) -> None:
        """The start lines: run directory, model, device, precision, the strategy that runs, data."""
        job, m, d, k = self.job, self.job.model, self.dist, self.job.engine.accum_steps
        log = self.log
        log(f"run dir: {self.run.save_dir}" + (f" (resumed at step {self.run.start.step})" if resume else ""))
        log(f"model: {m.model} ({m.n_layers}+{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
            f"d_ff {m.d_ff}), {self.model.num_params() / 1e6:.1f}M parameters; dropout {self.shape.dropout} "
            f"(attention {self.shape.attention_p()}, activation {self.shape.activation_p()}); "
            + (f"packed batches attend with {self.model.attention}; " if job.data.packs else "")
            + f"device {self.device}; "
            f"amp {job.optim.amp}; strategy {running(self.strategy)}"
            + (f"; {d.world} processes ({d.backend}) x --accum-steps {k}" if d.active else
               f"; --accum-steps {k}" if k > 1 else "")
            + (f"; tied embeddings: {m.tie_embeddings}" if m.tie_embeddings != "none" else "")
            + (f"; EMA {job.run.ema}" + (f" every {job.run.ema_every} steps" if job.run.ema_every > 1 else "")
               if job.run.ema else ""))
        packed = getattr(self.train_loader.sampler, "shape", None)  # (rows, src width, tgt width) when packed
        shapes = (f"packed rows of {packed[2]} target and {packed[1]} source positions, {packed[0]} a batch"
                  + (f" (--pack-width {job.data.pack_width})" if job.data.pack_width else "")
                  if packed else f"{len(self.train_loader.shapes())} shape(s)")
        log(f"data: {len(self.train_loader)} batches per epoch in {shapes}; "
            f"padding {100 * (1 - self.train_loader.num_tokens()['tgt_fill']):.1f} % of the target positions; "
            + overlong_note(self.data.stats.get("train", {}), job.data))
        if (note := warmup_note(job.optim.warmup, steps_of_run(job.run.max_steps, job.run.epochs,
                                                                 len(self.train_loader), k))) is not None:
            log(note)
        log(self.run.evaluator.start_line())
        log(setup_line(self))

    def _check_tokenizers(self, ckpt: dict[str, Any]) -> None:
        for side, tok in (("src", self.data.src_tok), ("tgt", self.data.tgt_tok)):
            want = ckpt["tokenizers"][side]["sha256"]
            if tok.sha256 != want:
                raise InputError(f"--resume: the {side} tokenizer {tok.path} differs from the one the "
                                 f"checkpoint was trained with (sha256 {want[:12]}...)")


def save_dir_of_resume(job: TrainJob) -> Path:
    """The run directory of ``--resume`` (its weights/last.pt's grandparent)."""
    return Path(job.run.resume).resolve().parent.parent


def setup_line(run: Any) -> str:
    """``set-up N s: start-up (interpreter and imports) N s, device N s, recipe N s, data N s, ...``,
    every part in order."""
    names = {"start-up": "start-up (interpreter and imports)",
             "device": "device (CUDA context, process group)" if run.device.type == "cuda" else "device",
             "imports": "waiting for TorchDynamo's import",
             "engine": ("graph capture" if getattr(run.strategy, "name", "") == "graph" else "engine")
             + (" and compile" if run.job.engine.compile == "on" else "")}
    parts = ", ".join(f"{names.get(k, k)} {v:.1f} s{setupclock.detail(k)}" for k, v in run.setup_s.items())
    return f"set-up {sum(run.setup_s.values()):.1f} s: {parts}"


def _shown(key: str, value: Any) -> str:
    """A setting's value for the resume line: 'no limit', not the internal 1,000,000 epochs or 0 steps."""
    if value is None or (key == "epochs" and value >= 1_000_000) or (key == "max_steps" and value == 0):
        return "no limit"
    return str(value)


def resume_job(path: str, log: Callable[[str], None] = print, device: str | None = None,
               time_limit: str | None = None, changes: dict[str, Any] | None = None) -> tuple[TrainJob, dict[str, Any]]:
    """The job and loaded checkpoint that continue the run of checkpoint ``path``. ``changes`` gives new values for settings of
    :data:`streamnmt.config.RESUME_SETTINGS` (a longer run, a new time slot, ...); the change
    is said in one line. The tokenizers come from the checkpoint where it embeds them."""
    where = Path(path).resolve()
    if where.is_file() and not (where.parent.name == "weights" and (where.parent.parent / "config.yaml").is_file()):
        # the run directory (weights/'s parent) is where a resume writes its logs and checkpoints
        raise InputError(f"--resume: {path} is not in a run's weights/ folder beside its config.yaml "
                         "(runs/train/NAME/weights/last.pt), where the run it continues lives; put it back "
                         "there, or start a new run from its weights with --weights")
    ckpt = load_checkpoint(path, flag="--resume")
    if "optimizer" not in ckpt:
        raise InputError(f"--resume: {path} holds weights only (e.g. an averaged checkpoint); "
                         f"start from it with --weights instead")
    config = {**ckpt["config"], "run": {**ckpt["config"].get("run", {})}}
    model_cfg = dict(config.get("model") or {})
    for key in ("attention_dropout", "activation_dropout"):  # a run from before these settings
        model_cfg.setdefault(key, model_cfg.get("dropout", ModelConfig().dropout))  # dropped there too
    config["model"] = model_cfg
    config["run"].setdefault("ema_every", 1)  # a run from before --ema-every updated at every step
    config["run"].setdefault("average_last", 0)  # a run from before --average-last ends without it
    if device is not None:  # validated here, not the device the checkpoint was written on
        config["run"]["device"] = device
    changes = dict(changes or {})
    if time_limit is not None:  # a new time slot for the resumed run
        changes["time_limit"] = time_limit
    unknown = sorted(set(changes) - set(RESUME_SETTINGS))
    if unknown:
        raise ConfigError(f"--resume: {', '.join('--' + k.replace('_', '-') for k in unknown)} cannot change "
                          f"when a run continues; start a new run (--weights) instead")
    before = job_from_dict(config).run
    config["run"].update(changes)
    # older key names first, so that the embedded tokenizers' paths replace rather than contradict them
    config["data"] = {**canonical(DataConfig, config.get("data", {})), **embedded_tokenizers(ckpt, path)}
    job = job_from_dict(config)
    said = [f"--{k.replace('_', '-')} {_shown(k, getattr(before, k))} -> {_shown(k, getattr(job.run, k))}"
            for k in changes if getattr(before, k) != getattr(job.run, k)]
    if job.run.time_limit and "time_limit" not in changes:  # a new slot would stop at the old one's length
        said.append(f"--time-limit {job.run.time_limit} as the run had (give --time-limit for another, or none)")
    if said:
        log(f"resume: {', '.join(said)}")
    run = dataclasses.replace(job.run, resume=str(path))
    return dataclasses.replace(job, run=run), ckpt
