"""Training: the Trainer that runs epochs through the stream engine.

The engine (``streamnmt.engine``) knows nothing of translation; it drives the step function of
``streamnmt.training.step`` (loss, backward, clipped Adam on the Noam schedule, without a host sync). The
Trainer owns everything around it: run directory, data, model, epochs, validation, BLEU,
checkpoints, resume, signals, logs. The training loop reads top to bottom in
:meth:`Trainer.run_epoch`. On several processes (torchrun; ``streamnmt.dist``) every rank runs
this Trainer on its share of each global step; rank 0 alone writes the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamnmt.checkpoint import (keep_step_copy, load_checkpoint, load_model_weights, rng_state, save_checkpoint,
                                  embedded_tokenizer, save_safetensors, set_rng_state, tokenizer_entry)
from streamnmt.config import RESUME_SETTINGS, ModelConfig, TrainJob, job_from_dict
from streamnmt import dist as distributed
from streamnmt.errors import ConfigError, InputError, NonFiniteLoss
from streamnmt.fsutil import atomic_write
from streamnmt.data.tokenizer import file_sha256
from streamnmt.models.attention import resolve_attention
from streamnmt.data import batch_plan, make_loader, prepare_data, read_pairs
from streamnmt.devices import resolve_device
from streamnmt.engine import STATS, DeferredLosses, host_sync, make_strategy
from streamnmt.training.recipe import resolve_compile, resolve_job
from streamnmt.engine.losses import StepLoss
from streamnmt.engine.syncstats import format_table
from streamnmt.inference.search import decode_dtype, decoding_copy
from streamnmt.inference.scoring import bleu_on_pairs
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.step import example_batch, make_step, noam_lr
from streamnmt.training.monitor import CpuSampler, NvmlSampler
from streamnmt.training.plots import plot_results
from streamnmt.training.reporting import Scalars, merge_sync_stats
from streamnmt.training.runs import CsvLog, increment_path, write_json
from streamnmt.training.stopping import EarlyStopping, TimeBudget, best_metric, parse_duration

STEP_COLUMNS = ["step", "epoch", "loss", "nll", "lr", "tokens", "grad_norm", "skipped"]
# train_loss: with the training's label smoothing; train_nll (and train_ppl = exp of it): the plain
# NLL of the same steps, which compares with val_loss.
RESULT_COLUMNS = ["epoch", "train_loss", "train_nll", "train_ppl", "val_loss", "bleu", "tokens_per_s",
                  "padded_tokens_per_s", "epoch_s", "bleu_s",
                  "gpu_mem_gb", "gpu_busy", "sync_count", "sync_ms", "steps", "cpu_util"]
EVAL_COLUMNS = ["step", "epoch", "val_loss", "bleu", "bleu_s", "best"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Builds everything from a :class:`TrainJob` and trains; the engine's strategy drives the steps.

    ``resume`` is a loaded checkpoint to continue from: the run continues in its own directory,
    mid-epoch, with model, optimizer, schedule, scaler, RNG and data order as they were.
    """

    def __init__(self, job: TrainJob, log: Callable[[str], None] = print, resume: dict[str, Any] | None = None):
        # Each build step validates what it makes; errors before _build_run_dir leave nothing behind.
        self._build_process(job, log)
        self.job = resolve_job(job, self.device, self.dist.world, self.log) if resume is None else job
        self._build_data(resume)
        self._build_model(resume)
        self._build_engine()
        self._build_loaders()
        self._build_state(resume)
        self._prepare_engine()
        self._build_run_dir(resume)
        self._build_logs(resume)
        self._log_start(resume)

    def _build_process(self, job: TrainJob, log: Callable[[str], None]) -> None:
        """Process group (under torchrun), this rank's device and log, determinism and seeds."""
        self.dist = distributed.init(job.engine.dist_backend, job.run.device, job.engine.dist_timeout)
        self.log = log if self.dist.main else distributed.quiet  # other ranks: errors only
        self.device = self.dist.device or resolve_device(job.run.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # so that streams, events and graphs default to it
        if job.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        seed_everything(job.run.seed)
        self.bleu_dtype = decode_dtype(job.run.eval_dtype, self.device, "eval_dtype")
        self.bleu_model: Transformer | None = None  # the model cast to bleu_dtype (made on first use)

    def _build_data(self, resume: dict[str, Any] | None) -> None:
        """Tokenizers and tokenized splits; then the settings that depend on the data (--compile auto)."""
        if resume is None:  # --weights: the tokenizers its checkpoint carries (identical files on every rank)
            self.job = tokenizers_of_weights(self.job, self.log)
        self.data = distributed.prepare_once(self.dist, lambda: prepare_data(self.job.data, log=self.log),
                                             lambda bundle: bundle.fingerprint())
        if resume is not None:
            self._check_tokenizers(resume)
        else:
            self.job = resolve_compile(self.job, self.data.train, self.device, self.dist.world, self.log)

    def _build_model(self, resume: dict[str, Any] | None) -> None:
        """The model (from --weights if given) and the step function: optimizer, schedule, scaler."""
        job, m = self.job, self.job.model
        self.shape = ModelShape(self.data.src_tok.vocab_size, self.data.tgt_tok.vocab_size, m.d_model,
                                m.n_layers, m.n_heads, m.d_ff, m.dropout,
                                max_positions=max(1024, job.data.max_len + 8), tie_embeddings=m.tie_embeddings,
                                attention_dropout=m.attention_dropout, activation_dropout=m.activation_dropout)
        self.model = Transformer(self.shape).to(self.device)
        self.model.set_attention(resolve_attention(m.attention, self.device, self.log))
        if job.run.weights and resume is None:
            load_model_weights(self.model, load_checkpoint(job.run.weights), job.run.weights)
            self.log(f"weights: started from {job.run.weights}")
        if self.dist.rank > 0:  # same initial weights on every rank, its own dropout stream after
            torch.manual_seed(job.run.seed + 1_000_003 * self.dist.rank)
        self.step_fn = make_step(self.model, self.device, d_model=m.d_model, lr=job.optim.lr,
                                 warmup=job.optim.warmup, amp=job.optim.amp, clip=job.optim.clip_grad,
                                 label_smoothing=m.label_smoothing, compile=job.engine.compile == "on",
                                 shapes=len({*batch_plan(self.data.train, job.data)[1],  # validation's too
                                             *batch_plan(self.data.dev, job.data, train=False)[1]}), ema=job.run.ema,
                                 ddp=self.dist.active)
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
        self.dev_loader = make_loader(self.data.dev, dataclasses.replace(job.data, workers=0), train=False,
                                      seed=job.run.seed, pin_memory=pin)

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
        self.global_step, self.epoch, self.epoch_pos, self.best_val = 0, 0, 0, math.inf
        self.stopper = EarlyStopping(best_metric(job.run), job.run.patience)  # best.pt and --patience
        self.budget = TimeBudget(parse_duration(job.run.time_limit))
        if resume is not None:
            self._restore(resume)

    def _prepare_engine(self) -> None:
        """The strategy's set-up (graph capture). Graph capture restores every state tensor and the
        RNG after its warm-up, so it is correct before or after a restore."""
        self.strategy.prepare(self.step_fn, [example_batch(shape, self.shape, self.job.run.seed,
                                                           packed=self.job.data.packs)
                                             for shape in self.train_loader.shapes()])
        # Several ranks: graph capture succeeded everywhere, or every rank stops with one line.
        self.dist.agree_on_capture(self.strategy.report.get("capture_error"))

    def _build_run_dir(self, resume: dict[str, Any] | None) -> None:
        """The run directory (only now that everything above is valid): rank 0 makes it, the others learn it."""
        r = self.job.run
        if resume is not None:
            self.save_dir = Path(r.resume).resolve().parent.parent
        elif not self.dist.main:
            self.save_dir = Path(self.dist.broadcast(None, "dist.setup"))  # rank 0's choice
        else:
            self.save_dir = increment_path(r.project, r.name, r.exist_ok)
            (self.save_dir / "weights").mkdir(parents=True, exist_ok=True)
            atomic_write(self.save_dir / "config.yaml", self.job.to_yaml())
            weights = self.save_dir / "weights"  # --exist-ok: an earlier run's best and step files are not ours
            for stale in [weights / "best.pt", weights / "best.safetensors", *weights.glob("step_*.pt")]:
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
        self.evals_log = CsvLog(self.save_dir / "evals.csv", EVAL_COLUMNS, truncate_after=self.global_step) \
            if main else distributed.NullLog()
        self.scalars = Scalars(self.save_dir, self.job.run.tensorboard and main)
        stats_path = self.save_dir / "sync_stats.json"
        self.sync_stats: list[dict[str, Any]] = []
        if resume is not None and stats_path.is_file():
            self.sync_stats = [e for e in json.loads(stats_path.read_text()) if e["epoch"] <= self.epoch]
        self.pending_rows: dict[int, dict[str, Any]] = {}  # step -> row waiting for its loss
        self.last_loss: float | None = None
        self.stop_requested, self.stop_reason = False, ""  # this rank: a signal, --time-limit or --patience
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
            f"(attention {self.shape.attention_p()}, activation {self.shape.activation_p()}); device {self.device}; "
            f"amp {job.optim.amp}; strategy {_running(self.strategy)}"
            + (f"; tied embeddings: {m.tie_embeddings}" if m.tie_embeddings != "none" else "")
            + (f"; EMA {job.run.ema}" if job.run.ema else "")
            + (f"; {d.world} processes ({d.backend}) x --accum-steps {k}" if d.active else
               f"; --accum-steps {k}" if k > 1 else ""))
        log(f"data: {len(self.train_loader)} batches per epoch in {len(self.train_loader.shapes())} shape(s); "
            f"padding {100 * (1 - self.train_loader.num_tokens()['tgt_fill']):.1f} % of the target positions; "
            + _overlong_note(self.data.stats.get("train", {}), job.data))

    @classmethod
    def from_checkpoint(cls, path: str, log: Callable[[str], None] = print, device: str | None = None,
                        time_limit: str | None = None, changes: dict[str, Any] | None = None) -> Trainer:
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
        config["data"] = {**config.get("data", {}), **_embedded_tokenizers(ckpt, path)}
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
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.global_step, self.best_val = ckpt["step"], ckpt["best_val"]
        self.epoch, self.epoch_pos = ckpt["sampler"]["epoch"], ckpt["sampler"]["position"]
        self.train_loader.load_state_dict(ckpt["sampler"])
        # the loader converts a position saved at another world size; the trainer counts in its units
        self.epoch, self.epoch_pos = self.train_loader.epoch, self.train_loader.position
        self.stopper.load_state_dict(ckpt.get("stopping"))
        if self.step_fn.ema is not None and ckpt.get("ema"):
            self.step_fn.ema.load_state_dict(ckpt["ema"])
        ranks = ckpt.get("rng_ranks") or [ckpt["rng"]]
        saved = (ckpt["sampler"].get("world", 1), ckpt["sampler"].get("accum", 1))
        if saved != (self.dist.world, self.job.engine.accum_steps) or len(ranks) != self.dist.world:
            self.log(f"resume: saved with {saved[0]} process(es) x --accum-steps {saved[1]}, now {self.dist.world} x "
                     f"{self.job.engine.accum_steps}: training continues from step {ckpt['step']}, not bit-exactly")
        if self.dist.rank < len(ranks):
            set_rng_state(ranks[self.dist.rank])
        else:  # a rank the checkpoint had not: rank 0's state, then a dropout stream of its own
            set_rng_state(ckpt["rng"])
            torch.manual_seed(self.job.run.seed + 1_000_003 * self.dist.rank)

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        r = self.job.run
        row: dict[str, Any] = {}
        self.budget.start()
        with _signals(self):
            self.log(f"{'Epoch':>7}{'GPU_mem':>9}{'batches':>9}{'tokens/s':>10}{'train_loss':>12}"
                     f"{'train_nll':>11}{'ppl':>9}{'val_loss':>10}{'BLEU':>7}{'time':>8}")
            while self.epoch < r.epochs and not self._done():
                row = self.run_epoch(self.epoch)
                if row:
                    self.log(f"{row['epoch']:>3}/{r.epochs:<3}{row['gpu_mem_gb']:>8.2f}G{row['steps']:>9}"
                             f"{row['tokens_per_s']:>10.0f}{row['train_loss']:>12.4f}{row['train_nll']:>11.4f}"
                             f"{row['train_ppl']:>9.2f}{row['val_loss']:>10.4f}"
                             f"{row['bleu'] if row['bleu'] != '' else '-':>7}{row['epoch_s']:>7.1f}s")
                    if r.verbose:
                        self.log(self.sync_table)
        if self.sync_stats:  # the whole run's host waits once, instead of a table per epoch
            self.log(f"training host syncs over {len(self.sync_stats)} epoch(s):\n"
                     + format_table(merge_sync_stats([e["train"] for e in self.sync_stats])))
        for log in (self.steps_log, self.results_log, self.evals_log, self.scalars):
            log.close()
        if not self.dist.main:
            return {"save_dir": self.save_dir, "best_val": self.best_val, "steps": self.global_step,
                    "last": row, "stopped": self.stopped}
        self._export_best()
        self._export_ema()
        if (self.save_dir / "steps.csv").stat().st_size > 0 and self.global_step > 0:
            plot_results(self.save_dir)
        if self.stopped:
            self.log(f"{self.stop_reason or f'stopped by signal after step {self.global_step}'}; "
                     f"saved {self.save_dir / 'weights' / 'last.pt'}")
        return {"save_dir": self.save_dir, "best_val": self.best_val, "steps": self.global_step,
                "last": row, "stopped": self.stopped}

    def _done(self) -> bool:
        r = self.job.run
        if not self.stop_requested and self.budget.expired():  # e.g. after a long epoch-end evaluation
            self._request_stop(self.budget.reason(self.global_step))
        return self._stop_agreed() or bool(r.max_steps and self.global_step >= r.max_steps)

    def _stop_agreed(self, every: int = 1) -> bool:
        """Stop after this step? One process: a signal, --time-limit or --patience asked for it.
        Several: the ranks agree, every ``every`` steps (one host-side all-reduce), so that they all
        stop after the same step."""
        if not self.dist.active:
            self.stopped = self.stop_requested
        elif self.global_step % every == 0:
            self.stopped = self.dist.agree(self.stop_requested)
        return self.stopped

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        r = self.job.run
        self.model.train()
        self.train_loader.set_epoch(epoch)  # keeps a resumed mid-epoch position
        STATS.reset()
        nvml = NvmlSampler(self.device).start()  # GPU utilisation sampled in a thread; no device sync
        cpu = CpuSampler().start()  # CPU time of this process and its loader workers
        t0 = time.perf_counter()
        tokens, padded, losses, eval_s, eval_stats = 0, 0, [], 0.0, []
        n_batches = len(self.train_loader) - self.epoch_pos  # micro-batches: --accum-steps per step
        if r.max_steps:
            n_batches = min(n_batches, (r.max_steps - self.global_step) * self.job.engine.accum_steps)
        end_pos = self.epoch_pos + n_batches  # where this epoch's part of the run ends (its own evaluation)
        bar = _progress(n_batches, f"epoch {epoch + 1}/{r.epochs}", quiet=not self.dist.main)
        for info in self.strategy.run(itertools.islice(self.train_loader, n_batches), self.step_fn, self.losses,
                                      start_step=self.global_step):
            # 1. bookkeeping on the host only: no device value is read here
            self.epoch_pos += 1
            padded += info.batch.tgt_out.numel() * self.dist.world  # a shape: no device access
            bar.update(1)
            if not info.ends_step:  # an accumulation micro-batch: the step goes on
                continue
            self.global_step = info.step
            ntok = info.batch.norm_tokens or info.batch.ntokens  # real target tokens of the global step (all ranks)
            tokens += ntok
            self.pending_rows[info.step] = {"step": info.step, "epoch": epoch + 1, "tokens": ntok,
                                            "lr": noam_lr(info.step, self.shape.d_model, self.job.optim.warmup,
                                                          self.job.optim.lr)}
            # 2. losses whose copies to the host have completed (never blocks)
            losses += self._write_steps(self.losses.poll())
            if self.last_loss is not None:
                bar.set_postfix_str(f"loss {self.last_loss:.4f} (as of last extraction)", refresh=False)
            # 3. mid-epoch checkpoint, kill test hook, signals (host-side flags only)
            # (an evaluation first, so that a checkpoint of the same step holds its early-stopping state)
            if r.eval_every and self.global_step % r.eval_every == 0 and self.epoch_pos < end_pos:
                te = time.perf_counter()  # a mid-epoch evaluation (the epoch's last batch has its own)
                losses += self._drain("eval")
                held, STATS.sites = STATS.sites, {}  # the evaluation's host waits are not training's
                self._evaluate(epoch)
                eval_stats.append(STATS.reset())
                STATS.sites = held
                eval_s += time.perf_counter() - te
            if r.save_every and self.global_step % r.save_every == 0:
                losses += self._save_mid_epoch("save", keep=r.keep_last)
            if not self.stop_requested and self.budget.expired():
                self._request_stop(self.budget.reason(self.global_step))
            if self.global_step == int(os.environ.get("STREAMNMT_TEST_KILL_AT_STEP", "0")):
                if self.dist.active:
                    self.dist.kill_launcher()
                os.kill(os.getpid(), signal.SIGKILL)
            if self._stop_agreed(self.job.engine.sync_interval):
                break
        if self.stopped:  # finish cleanly: drain, keep every loss, save where we are
            losses += self._save_mid_epoch("stop")
            bar.close()
            nvml.stop()
            return {}
        # 4. epoch end: drain the streams and the remaining losses
        # Needed: the epoch's time and every loss must be final before they are reported.
        self.strategy.drain("epoch.drain")
        losses += self._write_steps(self.losses.flush("epoch.losses"))
        bar.close()
        epoch_s = time.perf_counter() - t0 - eval_s
        gpu_busy = nvml.stop().get("util_mean_pct")
        cpu_util = cpu.stop()["util_pct"]  # % of one core, loader workers included
        train_stats = STATS.reset()
        # 5. validation loss and BLEU (timed separately from training); best.pt as of the epoch's end
        cut = bool(r.max_steps) and self.global_step >= r.max_steps and self.epoch_pos < len(self.train_loader)
        if not cut:  # --max-steps ended the run mid-epoch: a resume with a larger one goes on from here
            self.epoch, self.epoch_pos = epoch + 1, 0
        val_loss, bleu, bleu_s = self._evaluate(epoch)
        finite = [v for v in losses if math.isfinite(v[1])]  # a skipped step's loss is left out
        train_loss = sum(v[1] for v in finite) / max(len(finite), 1)
        train_nll = sum(v.values["nll"] for v in finite) / max(len(finite), 1)
        row = {"epoch": epoch + 1, "train_loss": train_loss, "train_nll": train_nll,
               "train_ppl": math.exp(min(train_nll, 700.0)), "val_loss": val_loss,
               "bleu": "" if bleu is None else round(bleu, 2), "tokens_per_s": tokens / epoch_s,
               "padded_tokens_per_s": padded / epoch_s,
               "epoch_s": round(epoch_s, 3), "bleu_s": round(bleu_s, 3),
               "gpu_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else 0.0,
               "gpu_busy": "" if gpu_busy is None else round(gpu_busy, 1),
               "sync_count": sum(s["count"] for s in train_stats.values()),
               "sync_ms": round(sum(s["total_ms"] for s in train_stats.values()), 3),
               "steps": self.global_step, "cpu_util": round(cpu_util, 1)}
        self.results_log.write(row)
        self.sync_stats.append({"epoch": epoch + 1, "strategy": self.strategy.name, "train": train_stats,
                                "engine": self.strategy.counters(),
                                "eval": merge_sync_stats([*eval_stats, STATS.reset()])})
        if self.dist.main:
            write_json(self.save_dir / "sync_stats.json", self.sync_stats)
        self.sync_table = format_table(train_stats)
        self.scalars.add(self.global_step, {"epoch/train_loss": row["train_loss"], "epoch/train_nll": train_nll,
                                            "epoch/tokens_per_s": row["tokens_per_s"],
                                            "sync/count": row["sync_count"], "sync/ms": row["sync_ms"]})
        # 6. checkpoint: the next epoch starts from its first batch
        self.save(self.save_dir / "weights" / "last.pt")
        return row

    def _evaluate(self, epoch: int) -> tuple[float, float | None, float]:
        """Validation loss and BLEU (of the EMA weights with --eval-ema); best.pt when --best-metric
        improved; a stop request when --patience ran out. Returns (val_loss, bleu, bleu seconds)."""
        ema = self.step_fn.ema if self.job.run.eval_ema else None
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            if self.dist.main:
                val_loss = self.validate()
                bleu, bleu_s = self.bleu()
            else:
                val_loss, bleu, bleu_s = math.nan, None, 0.0
            # every rank learns rank 0's results (best.pt and --patience decide alike everywhere)
            val_loss, bleu, bleu_s = self.dist.broadcast((val_loss, bleu, bleu_s), "dist.evaluate")
            self.best_val = min(self.best_val, val_loss)
            better = self.stopper.update(bleu if self.stopper.metric == "bleu" else val_loss, self.global_step)
            if better:
                self.save(self.save_dir / "weights" / "best.pt")
        self.evals_log.write({"step": self.global_step, "epoch": epoch + 1, "val_loss": val_loss,
                              "bleu": "" if bleu is None else round(bleu, 2), "bleu_s": round(bleu_s, 3),
                              "best": int(better)})
        self.scalars.add(self.global_step, {"dev/val_loss": val_loss, "dev/bleu": bleu})
        if self.stopper.should_stop:
            self._request_stop(self.stopper.reason())
        return val_loss, bleu, bleu_s

    def _request_stop(self, reason: str) -> None:
        self.stop_requested, self.stop_reason = True, reason  # said once, when the run ends

    def _write_steps(self, pairs: list[StepLoss]) -> list[StepLoss]:
        """Log the extracted steps; returns them (their losses and named values) for the epoch's means."""
        for rec in pairs:
            step, loss = rec
            row = self.pending_rows.pop(step)
            grad_norm, skipped = rec.values.get("grad_norm", math.nan), rec.values.get("skipped", 0.0)
            row.update(loss=loss, nll=rec.values["nll"], grad_norm=grad_norm, skipped=int(skipped))
            self.steps_log.write(row)
            self.scalars.add(step, {"train/loss": loss, "train/nll": row["nll"], "train/lr": row["lr"],
                                    "train/grad_norm": grad_norm})
            self.last_loss = loss
            self._check_step(step, loss, grad_norm, bool(skipped))
        return list(pairs)

    def _check_step(self, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """--on-nan for a non-finite loss or gradient (with fp16, the grad scaler's overflow skips
        are its own business); --max-skipped-steps for a run that no longer updates at all."""
        r, last = self.job.run, self.save_dir / "weights" / "last.pt"
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        if not math.isfinite(loss) or (skipped and self.scaler is None):
            self.nonfinite_steps.append(step)
            what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm}, loss {loss:.4f})"
            if r.on_nan == "stop":
                raise NonFiniteLoss(f"non-finite {what} at step {step} (--on-nan stop); the last good "
                                    f"checkpoint is {last}")
            self.log(f"warning: non-finite {what} at step {step}; the update was skipped (--on-nan skip)")
        if r.max_skipped_steps and self.skipped_in_row >= r.max_skipped_steps:
            raise NonFiniteLoss(f"{self.skipped_in_row} updates in a row skipped (non-finite loss or gradient) up "
                                f"to step {step} (--max-skipped-steps {r.max_skipped_steps}); the last good "
                                f"checkpoint is {last}")

    def _drain(self, why: str) -> list[StepLoss]:
        # Needed: a checkpoint or an evaluation sees finished work only, and every loss up to it is logged first.
        self.strategy.drain(f"{why}.drain")
        return self._write_steps(self.losses.flush(f"{why}.losses"))

    def _save_mid_epoch(self, why: str, keep: int = 0) -> list[StepLoss]:
        losses = self._drain(why)
        last = self.save_dir / "weights" / "last.pt"
        self.save(last)
        if keep and self.dist.main:  # --keep-last: this checkpoint also as weights/step_NNNNNN.pt, the newest N kept
            keep_step_copy(last, self.global_step, keep)
        return losses

    @torch.no_grad()
    def validate(self) -> float:
        """Token-level validation loss (plain NLL, no label smoothing); sums stay on the device, one
        counted sync at the end."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        ntok = torch.zeros((), dtype=torch.int64, device=self.device)
        for batch in self.dev_loader:
            b = batch.to(self.device, non_blocking=True)
            _, nll, n = self.step_fn.loss_sum(b)
            total += nll.double()
            ntok += n
        self.model.train()
        # Needed: the epoch's validation loss is reported and compared for best.pt.
        return float(host_sync("eval.val_loss", lambda: (total / ntok.clamp(min=1)).item()))

    def bleu(self) -> tuple[float | None, float]:
        n = self.job.run.bleu_samples
        if n == 0:
            return None, 0.0
        pairs = read_pairs(self.job.data, "dev")[:n]
        self.bleu_model = model = decoding_copy(self.model, self.bleu_dtype, self.bleu_model)
        res = bleu_on_pairs(model, self.data.src_tok, self.data.tgt_tok, pairs, device=self.device,
                            beam_size=self.job.run.beam_size, tgt_lang=self.job.data.tgt_lang)
        return res["bleu"], res["seconds"]

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "model_shape": dataclasses.asdict(self.shape),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "tokenizers": {side: tokenizer_entry(tok) for side, tok in (("src", self.data.src_tok),
                                                                          ("tgt", self.data.tgt_tok))},
            "config": self.job.to_dict(),
            "step": self.global_step, "best_val": self.best_val,
            "sampler": {**self.train_loader.state_dict(), "epoch": self.epoch, "position": self.epoch_pos},
            "rng": rng_state(),
            "stopping": self.stopper.state_dict(),
            "ema": self.step_fn.ema.state_dict() if self.step_fn.ema is not None else None,
        }

    def save(self, path: Path) -> None:
        rngs = self.dist.gather(rng_state()) if self.dist.active else None  # every rank calls save
        if not self.dist.main:
            return
        # Needed: torch.save copies every device tensor to the host (callers drained the streams
        # first, so this waits for nothing queued, but it is a host-device sync all the same).
        host_sync("checkpoint.save", lambda: save_checkpoint(path, {**self.checkpoint_state(), "rng_ranks": rngs}))

    def _export_ema(self) -> None:
        """--ema: the averaged weights as weights/ema.pt, a weights-only checkpoint that translate, eval,
        export, average and --weights load like any other (last.pt keeps the trained weights)."""
        ema = self.step_fn.ema
        if ema is None or self.global_step == 0:
            return
        path = self.save_dir / "weights" / "ema.pt"
        with ema.swapped():  # the model holds the averaged weights until the file is written
            state = {k: v for k, v in self.checkpoint_state().items()
                     if k in ("model", "model_shape", "tokenizers", "config", "step")}
            # Needed: torch.save copies the device tensors to the host (the streams were drained).
            host_sync("checkpoint.save", lambda: save_checkpoint(path, {**state, "ema_of_step": self.global_step}))
        self.log(f"EMA weights: {path}")

    def _export_best(self) -> None:
        best = self.save_dir / "weights" / "best.pt"
        if best.is_file():
            ckpt = load_checkpoint(best)
            save_safetensors(best.with_suffix(".safetensors"), ckpt["model"],
                             {"model_shape": json.dumps(ckpt["model_shape"])})


def _running(strategy) -> str:
    """The strategy that actually runs: graph mode's fallback names itself."""
    fallback = getattr(strategy, "fallback", None)
    return f"{fallback.name} (in place of graph)" if fallback is not None else strategy.name


def _embedded_tokenizers(ckpt: dict[str, Any], path: str, out: Path | None = None,
                         shared: bool | None = None, by_hash: bool = False) -> dict[str, str]:
    """Write the tokenizers a checkpoint embeds to files and return the data settings that name
    them, so that a run goes on with the very models the checkpoint was trained with even where
    the corpus directory's tokenizers are gone. ``out``: the directory (default: the run
    directory's ``tokenizer/``, for --resume); ``shared``: one model for both sides (default: as
    the checkpoint's run had it); ``by_hash``: files named by their sha256, else src/tgt. Empty for older checkpoints, which only name their files."""
    toks = {side: embedded_tokenizer(ckpt, side, path) for side in ("src", "tgt")}
    if any(tok is None for tok in toks.values()):
        return {}
    if shared is None:
        shared = (ckpt.get("config") or {}).get("data", {}).get("shared_vocab", False)
    out = out or Path(path).resolve().parent.parent / "tokenizer"
    files = {}
    for side, tok in toks.items():
        files[side] = out / (f"{tok.sha256[:16]}.model" if by_hash else f"{side}.model")
        if not files[side].is_file() or file_sha256(files[side]) != tok.sha256:
            atomic_write(files[side], tok.model_bytes())
    return {"tokenizer_eng": str(files["src"])} if shared else \
        {"tokenizer_eng": str(files["src"]), "tokenizer_chn": str(files["tgt"])}


def tokenizers_of_weights(job: TrainJob, log: Callable[[str], None]) -> TrainJob:
    """``--weights``: fine-tune with the tokenizers the checkpoint carries (its model's vocabulary)
    unless --tokenizer-eng/--tokenizer-chn name others; they are written, named by their hash, to
    ``$STREAMNMT_HOME/tokenizers/``, which config.yaml then records."""
    d = job.data
    if not job.run.weights or d.tokenizer_eng or d.tokenizer_chn:
        return job
    ckpt = load_checkpoint(job.run.weights)
    metas = ckpt.get("tokenizers") or {}
    one = (metas.get("src") or {}).get("sha256") == (metas.get("tgt") or {}).get("sha256")
    if d.shared_vocab and not one:
        return job  # two models cannot serve --shared-vocab: the data directory's shared model is used
    home = Path(os.environ.get("STREAMNMT_HOME", "~/.cache/streamnmt")).expanduser() / "tokenizers"
    files = _embedded_tokenizers(ckpt, job.run.weights, home, shared=d.shared_vocab, by_hash=True)
    if files:
        log(f"weights: tokenizers from {job.run.weights} ({', '.join(sorted(set(files.values())))})")
    return dataclasses.replace(job, data=dataclasses.replace(d, **files)) if files else job


@contextlib.contextmanager
def _signals(trainer: Trainer):
    """SIGTERM and a first SIGINT ask the loop to stop after the current step (a host-side flag,
    checked once per step; no device work); a second SIGINT aborts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum, frame):
        if trainer.signalled and signum == signal.SIGINT and not trainer.dist.active:
            raise KeyboardInterrupt  # (several ranks: Ctrl-C reaches a rank from the terminal and from torchrun)
        trainer.signalled = True
        trainer.stop_requested, trainer.stop_reason = True, ""
        trainer.log(f"\n{signal.Signals(signum).name}: finishing the current step, then saving "
                    "(Ctrl-C again to abort)")

    old = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _overlong_note(stats: dict[str, int], data) -> str:
    """What --overlong did to the training pairs over --max-len, for the data start line."""
    if data.overlong == "drop":
        return f"{stats.get('dropped', 0)} training pairs over --max-len {data.max_len} dropped (--overlong drop)"
    return f"{stats.get('truncated', 0)} training pairs over --max-len {data.max_len} truncated (--overlong truncate)"


def _progress(total: int, desc: str, quiet: bool = False):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=True if quiet else None)
