"""A training run's parts, built from a job: process, data, model and step, engine, loaders, state,
run directory and logs; and a checkpoint's state restored into them (``--resume``).

:class:`TrainerSetup` builds in the order each part needs the ones before it, validating as it
goes, so that a bad setting stops the run before anything is written. The loop that uses the
parts is :class:`streamnmt.training.trainer.Trainer`; evaluation, checkpoint writes and the
recipe's auto settings are parts of their own (evaluator, checkpointer, recipe).
"""


from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from streamnmt import dist as distributed
from streamnmt import setupclock
from streamnmt.checkpoint import (embedded_tokenizers, load_checkpoint, load_model_weights, rng_state, set_rng_state,
                                  tokenizer_entry, tokenizers_of_weights)
from streamnmt.config import RESUME_SETTINGS, ModelConfig, TrainJob, job_from_dict
from streamnmt.data import batch_shapes, make_loader, make_sampler, prepare_data
from streamnmt.data.prepare import prepare_once
from streamnmt.devices import resolve_device, seed_everything
from streamnmt.engine import DeferredLosses, make_strategy
from streamnmt.errors import ConfigError, InputError
from streamnmt.fsutil import atomic_write
from streamnmt.inference.decoding import decode_dtype
from streamnmt.models.attention import resolve_attention, settle_triton
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.checkpointer import Checkpointer, remove_stale_temporaries, repair_safetensors_beside
from streamnmt.training.evaluator import Cadence, Evaluation, Evaluator
from streamnmt.training.recipe import resolve_compile_for_ranks, resolve_job_for_ranks
from streamnmt.training.reporting import Scalars, overlong_note, running
from streamnmt.training.runs import CsvLog, increment_path
from streamnmt.training.step import example_batch, import_in_background, make_step
from streamnmt.training.stopping import EarlyStopping, TimeBudget, command_start

STEP_COLUMNS = ["step", "epoch", "loss", "nll", "lr", "tokens", "grad_norm", "skipped"]
# train_loss: with the training's label smoothing; train_nll (and train_ppl = exp of it): the plain
# NLL of the same steps, which compares with val_loss.
RESULT_COLUMNS = ["epoch", "train_loss", "train_nll", "train_ppl", "val_loss", "bleu", "tokens_per_s",
                  "padded_tokens_per_s", "epoch_s", "bleu_s", "eval_s", "save_s",
                  "gpu_mem_gb", "gpu_busy", "sync_count", "sync_ms", "steps", "cpu_util"]
# eval_s, save_s: the seconds the training loop waited for the evaluation and for its best.pt;
# wall_s: the run's wall clock (from the command's start, summed over resumes) when it reached the
# evaluated weights, for time-to-BLEU curves (scripts/plot_time_to_bleu.py);
# bleu_n: the dev sentences BLEU scored (fewer than --bleu-samples where the time limit cut the pass)
# kind: empty for an evaluation of the run's weights, "average" for the end of the run's mean of the
# last --average-last evaluated weights (training/averaging.py)
EVAL_COLUMNS = ["step", "epoch", "wall_s", "val_loss", "bleu", "bleu_n", "bleu_s", "val_s", "best", "eval_s",
                "save_s", "kind"]


class TrainerSetup:
    """Builds a run's parts from a :class:`TrainJob` (the auto settings resolved once, on rank 0
    for all ranks). ``resume`` is a loaded checkpoint to continue from: the run continues in its
    own directory, mid-epoch, with model, optimizer, schedule, scaler, RNG, data order, evaluation
    cadence and early-stopping state as they were.
    """

    def __init__(self, job: TrainJob, log: Callable[[str], None] = print, resume: dict[str, Any] | None = None):
        # Each build step validates what it makes; errors before _build_run_dir leave nothing behind.
        # Where the set-up's seconds go is said in one start line (docs/PERFORMANCE.md, "Evaluation
        # and checkpoints in a run": set-up is most of what a short run spends outside training).
        self.t_command = command_start()  # --time-limit and the end line count from the command's start
        self.setup_s: dict[str, float] = {"start-up": time.monotonic() - self.t_command}
        self.asked_attention = job.model.attention  # as given (auto, triton, ...): named where it falls back
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

    def setup_line(self) -> str:
        """``set-up N s: start-up (interpreter and imports) N s, device N s, recipe N s, data N s, ...``,
        every part in order."""
        names = {"start-up": "start-up (interpreter and imports)",
                 "device": "device (CUDA context, process group)" if self.device.type == "cuda" else "device",
                 "imports": "waiting for TorchDynamo's import",
                 "engine": ("graph capture" if getattr(self.strategy, "name", "") == "graph" else "engine")
                 + (" and compile" if self.job.engine.compile == "on" else "")}
        parts = ", ".join(f"{names.get(k, k)} {v:.1f} s{setupclock.detail(k)}" for k, v in self.setup_s.items())
        return f"set-up {sum(self.setup_s.values()):.1f} s: {parts}"

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
            self.job = resolve_compile_for_ranks(self.job, self.data.train, self.device, self.dist, self.log)

    def _build_model(self, resume: dict[str, Any] | None) -> None:
        """The model (from --weights if given) and the step function: optimizer, schedule, scaler."""
        job, m = self.job, self.job.model
        self.shape = ModelShape(self.data.src_tok.vocab_size, self.data.tgt_tok.vocab_size, m.d_model,
                                m.n_layers, m.n_heads, m.d_ff, m.dropout,
                                max_positions=max(1024, job.data.max_len + 8), tie_embeddings=m.tie_embeddings,
                                attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout)
        self.model = Transformer(self.shape).to(self.device)
        self.model.set_attention(resolve_attention(m.attention, self.device, self.log, head_dim=m.d_model // m.n_heads,
                                                   attention_dropout=m.attention_dropout))
        if job.run.weights and resume is None:
            load_model_weights(self.model, load_checkpoint(job.run.weights), job.run.weights)
            self.log(f"weights: started from {job.run.weights}")
        if self.dist.rank > 0:  # same initial weights on every rank, its own dropout stream after
            torch.manual_seed(job.run.seed + 1_000_003 * self.dist.rank)
        self.step_fn = make_step(self.model, self.device, d_model=m.d_model, lr=job.optim.lr,
                                 warmup=job.optim.warmup, amp=job.optim.amp, clip=job.optim.clip_grad,
                                 label_smoothing=m.label_smoothing, compile=job.engine.compile == "on",
                                 shapes=len({*batch_shapes(self.data.train, job.data),  # validation's too
                                             *batch_shapes(self.data.dev, job.data, train=False)}), ema=job.run.ema or 0.0,
                                 ema_every=job.run.ema_every,
                                 ddp=self.dist.active, bucket_cap_mb=job.engine.bucket_cap_mb)
        self.optimizer, self.schedule, self.scaler = (self.step_fn.optimizer, self.step_fn.schedule,
                                                      self.step_fn.scaler)

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
                              f"({len(self.data.train)} pairs, batches of {job.data.batch_size} x --accum-steps {k}"
                              f" per rank); use fewer processes or a smaller --batch-size")
        # Validation packed like training (where it packs): one batch shape, the training's, so the
        # first evaluation meets no new matrix shapes and validation replays one graph.
        packed = self.train_loader.shapes()[0] if job.data.packs else None
        self.dev_loader = make_loader(self.data.dev, dataclasses.replace(job.data, workers=0), train=False,
                                      seed=job.run.seed, pin_memory=pin, packed_shape=packed)

    def _build_state(self, resume: dict[str, Any] | None) -> None:
        """Deferred losses, step counters, early stopping, the time budget; a checkpoint's state on resume."""
        job, d = self.job, self.dist
        # Each step's plain NLL (summed like the loss), gradient norm and skipped flag travel with its
        # loss (no extra sync); with DDP on a GPU, waits on replayed collectives poll with a deadline.
        wait = (lambda ev: distributed.wait_event(ev, d.timeout_s)) if d.active and self.device.type == "cuda" else None
        stats = self.step_fn.stats
        self.losses = DeferredLosses(self.device, job.engine.loss_interval, group=job.engine.accum_steps,
                                     reduce=d.reduce_sum_ if d.active else None, values=("nll",),
                                     extras={"grad_norm": stats[0], "skipped": stats[1]}, wait=wait)
        self.skipped_in_row = 0  # consecutive skipped updates (--max-skipped-steps)
        self.global_step, self.epoch, self.epoch_pos = 0, 0, 0
        # validation, BLEU, best.pt's choice, --patience and when to evaluate
        self.evaluator = Evaluator(model=self.model, amp_dtype=self.step_fn.amp_dtype, dev_loader=self.dev_loader,
                                   data=self.data, job=job, device=self.device, dist=d, bleu_dtype=self.bleu_dtype,
                                   log=self.log)
        self.checkpointer = Checkpointer(self.device, background=job.run.async_save)
        self.save_cadence = Cadence(None, first_after_s=0.0)  # an epoch end's last.pt: --eval-every auto's rule
        self.clock = time.perf_counter  # the loop's timings (injectable: tests use a fake clock)
        self.budget = TimeBudget(job.run.time_limit_s(), t0=self.t_command)
        self.times = dict.fromkeys(("training", "evaluation", "checkpoints", "set-up", "other"), 0.0)
        self.waits: dict[str, Any] = {"eval_s": 0.0, "save_s": 0.0, "stats": []}
        self.last_eval: Evaluation | None = None
        self.launched: dict[str, Any] | None = None  # the evaluation whose BLEU pass runs beside training
        self.decided_eval_step = -1  # the last evaluation whose results are in (last.pt keeps it)
        self.fresh_bleu: float | None = None  # a pass beside training's BLEU, for the next epoch line
        self.best_on_disk: float | None = None  # the --best-metric value of the model best.pt holds
        self.last_eval_step = self.last_save_step = -1
        # an evaluation a signal kept from running at its step ({step, epoch, beside}): a resume runs it first
        self.eval_due: dict[str, Any] | None = None
        # The wall clock of the run's earlier processes up to the state a resume starts from, so that
        # evals.csv's wall_s (time to BLEU) counts across resumes.
        self.wall_before: float | None = 0.0
        if resume is not None:
            self._restore(resume)

    def _prepare_engine(self) -> None:
        """The strategy's set-up (graph capture). Graph capture restores every state tensor and the
        RNG after its warm-up, so it is correct before or after a restore. First the Triton kernels'
        build check, owed to the child processes that compiled them beside the set-up so far."""
        why = settle_triton(self.log)
        if why is not None and self.model.attention == "triton":
            self.log(f"model: --attention {self.asked_attention}: {why}; using sdpa")
            self.model.set_attention("sdpa")
            self.job = dataclasses.replace(self.job, model=dataclasses.replace(self.job.model, attention="sdpa"))
        self.strategy.prepare(self.step_fn, [example_batch(shape, self.shape, self.job.run.seed,
                                                           packed=self.job.data.packs)
                                             for shape in self.train_loader.shapes()])
        # Several ranks: graph capture succeeded everywhere, or every rank stops with one line.
        self.dist.agree_on_capture(self.strategy.report.get("capture_error"))
        self.step_fn.compile_ready(self.log)  # --compile: artefacts saved; "engine: ready in X s" (cache warm/cold)

    def _build_run_dir(self, resume: dict[str, Any] | None) -> None:
        """The run directory (only now that everything above is valid): rank 0 makes it, the others learn it."""
        r = self.job.run
        if resume is not None:
            self.save_dir = self.save_dir_of_resume()
            if self.dist.main:  # a write that a kill interrupted left its temporary file, or
                remove_stale_temporaries(self.save_dir / "weights")  # came between best.pt and its .safetensors
                repair_safetensors_beside(self.save_dir / "weights" / "best.pt", self.log)
        elif not self.dist.main:
            self.save_dir = Path(self.dist.broadcast(None, "dist.setup"))  # rank 0's choice
        else:
            self.save_dir = increment_path(r.project, r.name, r.exist_ok)
            (self.save_dir / "weights").mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.save_dir / "weights")
            atomic_write(self.save_dir / "config.yaml", self.job.to_yaml())
            weights = self.save_dir / "weights"  # --exist-ok: an earlier run's best, EMA and step files are not ours
            for stale in [weights / "best.pt", weights / "best.safetensors", weights / "ema.pt",
                          *weights.glob("step_*.pt")]:
                stale.unlink(missing_ok=True)
            self.dist.broadcast(str(self.save_dir), "dist.setup")

    def _build_logs(self, resume: dict[str, Any] | None) -> None:
        """CSV logs and scalars (rank 0 writes; the others hold null logs) and the loop's host-side state.
        A new run in a reused directory starts its logs afresh; a resumed one keeps its past."""
        main = self.dist.main
        self.steps_log = CsvLog(self.save_dir / "steps.csv", STEP_COLUMNS, truncate_after=self.global_step) \
            if main else distributed.NullLog()
        self.results_log = CsvLog(self.save_dir / "results.csv", RESULT_COLUMNS, truncate_after=self.epoch) \
            if main else distributed.NullLog()
        # evals.csv: up to the checkpoint's step, less an evaluation it recorded undecided (written
        # again when the resumed run decides it)
        pending = self.launched["step"] - 1 if self.evaluator.pending is not None and self.launched else self.global_step
        self.evals_log = CsvLog(self.save_dir / "evals.csv", EVAL_COLUMNS,
                                truncate_after=min(self.global_step, pending)) if main else distributed.NullLog()
        self.scalars = Scalars(self.save_dir, self.job.run.tensorboard and main)
        stats_path = self.save_dir / "sync_stats.json"
        self.sync_stats: list[dict[str, Any]] = []
        if resume is not None and stats_path.is_file():
            self.sync_stats = [e for e in json.loads(stats_path.read_text()) if e["epoch"] <= self.epoch]
        self.pending_rows: dict[int, dict[str, Any]] = {}  # step -> row waiting for its loss
        self.last_loss: float | None = None
        self.stop_requested, self.stop_reason = False, ""  # this rank: a signal, --time-limit or --patience
        self._loop_s, self._loop_steps = 0.0, 0  # the loop's training seconds and steps (mean step time)
        self.stopped = False  # the ranks agreed to stop
        self.signalled = False  # a first signal arrived (a second Ctrl-C aborts)
        self.nonfinite_steps: list[int] = []

    def _log_start(self, resume: dict[str, Any] | None) -> None:
        """The start lines: run directory, model, device, precision, the strategy that runs, data."""
        job, m, d, k = self.job, self.job.model, self.dist, self.job.engine.accum_steps
        log = self.log
        log(f"run dir: {self.save_dir}" + (f" (resumed at step {self.global_step})" if resume else ""))
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
        log(self.evaluator.start_line())
        log(self.setup_line())

    @property
    def best_val(self) -> float:
        return self.evaluator.best_val

    @property
    def stopper(self) -> EarlyStopping:
        return self.evaluator.stopper

    @classmethod
    def from_checkpoint(cls, path: str, log: Callable[[str], None] = print, device: str | None = None,
                        time_limit: str | None = None, changes: dict[str, Any] | None = None) -> Any:
        """Continue the run of checkpoint ``path``. ``changes`` gives new values for settings of
        :data:`streamnmt.config.RESUME_SETTINGS` (a longer run, a new time slot, ...); the change
        is said in one line. The tokenizers come from the checkpoint where it embeds them."""
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
        config["data"] = {**config.get("data", {}), **embedded_tokenizers(ckpt, path)}
        job = job_from_dict(config)
        said = [f"--{k.replace('_', '-')} {getattr(before, k)} -> {getattr(job.run, k)}" for k in changes
                if getattr(before, k) != getattr(job.run, k)]
        if said:
            log(f"resume: {', '.join(said)}")
        run = dataclasses.replace(job.run, resume=str(path))
        return cls(dataclasses.replace(job, run=run), log=log, resume=ckpt)

    def _check_tokenizers(self, ckpt: dict[str, Any]) -> None:
        for side, tok in (("src", self.data.src_tok), ("tgt", self.data.tgt_tok)):
            want = ckpt["tokenizers"][side]["sha256"]
            if tok.sha256 != want:
                raise InputError(f"--resume: the {side} tokenizer {tok.path} differs from the one the "
                                 f"checkpoint was trained with (sha256 {want[:12]}...)")

    def _restore(self, ckpt: dict[str, Any]) -> None:
        load_model_weights(self.model, ckpt, self.job.run.resume, flag="--resume")
        self.optimizer.load_state_dict(ckpt["optimizer"])
        for group in self.optimizer.param_groups:  # the saved groups carry the saving device's settings
            group["lr"] = self.schedule.lr_t       # keep reading the schedule's device tensor
            group["fused"], group["capturable"] = True, self.device.type == "cuda"
        self.schedule.set_step(ckpt["step"])
        self.step_fn.count_updates(ckpt["step"])  # which of the next updates refresh the EMA (--ema-every)
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.global_step, self.evaluator.best_val = ckpt["step"], ckpt["best_val"]
        # a checkpoint written before checkpoints carried it: the earlier seconds are unknown
        self.wall_before = float(ckpt["wall_s"]) if ckpt.get("wall_s") is not None else None
        self.last_save_step = self.global_step
        # a checkpoint of a step that was not evaluated (a signal, --save-every) gets its evaluation
        self.last_eval_step = ckpt.get("last_eval_step", self.global_step)
        self.decided_eval_step = self.last_eval_step
        self.epoch, self.epoch_pos = ckpt["sampler"]["epoch"], ckpt["sampler"]["position"]
        self.train_loader.load_state_dict(ckpt["sampler"])
        # the loader converts a position saved at another world size; the trainer counts in its units
        self.epoch, self.epoch_pos = self.train_loader.epoch, self.train_loader.position
        self.evaluator.load_state_dict(ckpt.get("stopping"))
        self.eval_due = ckpt.get("eval_due")
        pending = ckpt.get("pending_eval")
        if pending:  # an evaluation the interrupted run had not decided: decided again where it would have
            self.evaluator.restore(pending)
            self.launched = {"step": pending["step"], **{k: pending.get(k) for k in ("epoch", "wall_s", "eval_s")}}
            self.launched["eval_s"] = self.launched["eval_s"] or 0.0
        self._read_best_on_disk()
        if self.step_fn.ema is not None and ckpt.get("ema"):
            self.step_fn.ema.load_state_dict(ckpt["ema"])
        self.evaluator.averager.load_state_dict(ckpt.get("averager"))  # --average-last's kept weights
        ranks = ckpt.get("rng_ranks") or [ckpt["rng"]]
        saved = (ckpt["sampler"].get("world", 1), ckpt["sampler"].get("accum", 1))
        if saved != (self.dist.world, self.job.engine.accum_steps) or len(ranks) != self.dist.world:
            k = self.job.engine.accum_steps
            steps = len(self.train_loader) // k  # this run's optimizer steps per epoch
            self.log(f"resume: saved with {saved[0]} process(es) x --accum-steps {saved[1]}, now {self.dist.world} x "
                     f"{k}: epoch {self.epoch + 1} continues at its step {self.epoch_pos // k} of {steps}, the share "
                     f"of the epoch the saved run had trained rounded up to a whole step (at most one step's "
                     f"pairs of the epoch left out); from there each step groups the epoch's pairs differently, "
                     f"so training continues from step {ckpt['step']}, not bit-exactly")
        if self.dist.rank < len(ranks):
            set_rng_state(ranks[self.dist.rank])
        else:  # a rank the checkpoint had not: rank 0's state, then a dropout stream of its own
            set_rng_state(ckpt["rng"])
            torch.manual_seed(self.job.run.seed + 1_000_003 * self.dist.rank)

    def _read_best_on_disk(self) -> None:
        """The metric of the model best.pt holds (its ``best`` record), which may be newer than
        last.pt's (a kill after an evaluation wrote best.pt, or a resume from an earlier
        ``step_*.pt``): the resumed run replaces best.pt only with a better model. The early-stopping
        state stays as the checkpoint recorded it, so the resume replays the run exactly. Rank 0's
        file decides for every rank (their ``_save`` calls must agree)."""
        path = self.save_dir_of_resume() / "weights" / "best.pt"
        best = None
        if self.dist.main and path.exists():
            try:
                best = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("best")
            except Exception:  # an unreadable best.pt is not this resume's business (last.pt is whole)
                best = None
            if not best or best.get("metric") != self.evaluator.stopper.metric or best.get("value") is None:
                best = None
        best = self.dist.broadcast(best, "dist.resume")
        self.best_on_disk = None if best is None else float(best["value"])

    def run_wall_s(self) -> float | None:
        """Seconds of wall clock the run has taken to reach its current state: this command's, from
        its start, plus the earlier processes' up to the checkpoint it resumed from (None where that
        checkpoint did not say)."""
        return None if self.wall_before is None else self.wall_before + self.budget.elapsed()

    def save_dir_of_resume(self) -> Path:
        """The run directory of ``--resume`` (its weights/last.pt's grandparent)."""
        return Path(self.job.run.resume).resolve().parent.parent

    def checkpoint_state(self) -> dict[str, Any]:
        pending = self.evaluator.record()
        if pending is not None and self.launched is not None:
            pending.update({k: self.launched[k] for k in ("epoch", "wall_s", "eval_s")})
        return {
            "model": self.model.state_dict(),
            "model_shape": dataclasses.asdict(self.shape),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "tokenizers": {side: tokenizer_entry(tok) for side, tok in (("src", self.data.src_tok),
                                                                          ("tgt", self.data.tgt_tok))},
            "config": self.job.to_dict(),
            # the last evaluation: decided, or pending (a BLEU pass beside training, one a signal cut),
            # recorded with its weights in pending_eval (Evaluator.record): a resume decides it
            "step": self.global_step, "best_val": self.best_val,
            "last_eval_step": self.last_eval_step if pending else self.decided_eval_step,
            "pending_eval": pending,
            "eval_due": self.eval_due if self.eval_due and self.eval_due["step"] == self.global_step else None,
            "wall_s": self.run_wall_s(),
            "recipe_device": dataclasses.asdict(self.recipe_device),
            "sampler": {**self.train_loader.state_dict(), "epoch": self.epoch, "position": self.epoch_pos},
            "rng": rng_state(),
            "stopping": self.evaluator.state_dict(),
            "ema": self.step_fn.ema.state_dict() if self.step_fn.ema is not None else None,
            "averager": self.evaluator.averager.state_dict(),  # --average-last: an exact resume ends alike
        }
