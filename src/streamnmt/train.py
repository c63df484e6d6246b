"""Training: the NMT step function and the Trainer that runs epochs through the stream engine.

The engine (``streamnmt.engine``) knows nothing of translation; this module supplies what it
drives: :class:`NMTStep` (forward with token-level cross-entropy, backward, clipped Adam step on
the Noam schedule, all without a host sync) and :class:`Trainer` (run directory, data, model,
epochs, validation, BLEU, checkpoints, logs). The training loop reads top to bottom in
:meth:`Trainer.run_epoch`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from streamnmt import masks
from streamnmt.checkpoint import load_checkpoint, load_model_weights, rng_state, save_checkpoint
from streamnmt.config import TrainJob
from streamnmt.data import Batch, make_loader, prepare_data, read_pairs
from streamnmt.engine import STATS, DeferredLosses, host_sync, make_strategy
from streamnmt.engine.syncstats import format_table
from streamnmt.model import ModelShape, Transformer
from streamnmt.runs import CsvLog, increment_path, write_json

STEP_COLUMNS = ["step", "epoch", "loss", "lr", "tokens"]
RESULT_COLUMNS = ["epoch", "train_loss", "val_loss", "bleu", "tokens_per_s", "epoch_s", "bleu_s",
                  "gpu_mem_gb", "sync_count", "sync_ms", "steps"]


def noam_lr(step: int, d_model: int, warmup: int, factor: float) -> float:
    """Learning rate at optimizer step ``step`` (1-based), computed on the host for logging."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class NoamSchedule:
    """Noam schedule kept on the device: the learning rate is a tensor the optimizer reads, updated
    by device kernels each step, so neither an eager step nor a captured CUDA graph waits on the host."""

    def __init__(self, d_model: int, warmup: int, factor: float, device: torch.device):
        self.d_model, self.warmup, self.factor = d_model, warmup, factor
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_t = torch.zeros((), dtype=torch.float32, device=device)

    def advance(self) -> None:
        self.step_t += 1
        s = self.step_t
        lr = self.factor * self.d_model ** -0.5 * torch.minimum(s.rsqrt(), s * self.warmup ** -1.5)
        self.lr_t.copy_(lr)


class NMTStep:
    """One training step in the three phases the strategies schedule on their streams."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: NoamSchedule,
                 *, amp_dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None, clip: float,
                 label_smoothing: float):
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.amp_dtype, self.scaler, self.clip, self.ls = amp_dtype, scaler, clip, label_smoothing
        self.params = [p for p in model.parameters() if p.requires_grad]
        if scaler is not None:  # create the scaler's device state now (it is lazy), before any capture
            scaler.scale(torch.zeros((), device=self.params[0].device))

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step mutates (graph mode saves and restores them around its warm-up)."""
        out = list(self.params)
        out += [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        out += [self.schedule.step_t, self.schedule.lr_t]
        if self.scaler is not None and self.scaler._scale is not None:
            out += [self.scaler._scale, self.scaler._growth_tracker]
        return out

    def loss_sum(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token cross-entropy, target token count), both device scalars."""
        dev_type = batch.src.device.type
        with torch.autocast(dev_type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            logits = self.model(batch.src, batch.tgt_in, masks.src_mask(batch.src))  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(),
                                   ignore_index=masks.PAD, reduction="sum", label_smoothing=self.ls)
        return loss, (batch.tgt_out != masks.PAD).sum()

    def forward(self, batch) -> torch.Tensor:
        loss, ntok = self.loss_sum(batch)
        return loss / ntok.clamp(min=1)  # token-level mean; the count stays on the device

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # device-side; the fused Adam skips inf steps itself
        if self.clip > 0:
            # foreach norm, no error_if_nonfinite: no host sync.
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.schedule.advance()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_step(model: torch.nn.Module, device: torch.device, *, d_model: int, lr: float = 1.0,
              warmup: int = 4000, amp: str = "off", clip: float = 1.0, label_smoothing: float = 0.0,
              compile: bool = False) -> NMTStep:
    """The optimizer, schedule, grad scaler and step function for ``model`` (trainer and bench)."""
    schedule = NoamSchedule(d_model, warmup, lr, device)
    # Fused Adam reading the learning rate from a device tensor; capturable so that graph mode
    # can put the step inside a CUDA graph (used by every strategy, so all compute the same).
    optimizer = torch.optim.Adam(model.parameters(), lr=schedule.lr_t, betas=(0.9, 0.98), eps=1e-9,
                                 fused=True, capturable=device.type == "cuda")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    step_model = torch.compile(model) if compile else model
    return NMTStep(step_model, optimizer, schedule, amp_dtype=amp_dtype, scaler=scaler, clip=clip,
                   label_smoothing=label_smoothing)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Trainer:
    """Builds everything from a :class:`TrainJob` and trains; the engine's strategy drives the steps."""

    def __init__(self, job: TrainJob, log: Callable[[str], None] = print):
        self.log = log
        self.device = resolve_device(job.run.device)
        self.job = job = self._resolve(job)
        if job.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        seed_everything(job.run.seed)

        # 1. data (errors here leave nothing behind: the run dir does not exist yet)
        self.data = prepare_data(job.data, log=log)
        # 2. model, optimizer, schedule
        m = job.model
        self.shape = ModelShape(self.data.src_tok.vocab_size, self.data.tgt_tok.vocab_size, m.d_model,
                                m.n_layers, m.n_heads, m.d_ff, m.dropout,
                                max_positions=max(1024, job.data.max_len + 8))
        self.model = Transformer(self.shape).to(self.device)
        if job.run.weights:
            ckpt = load_checkpoint(job.run.weights)
            load_model_weights(self.model, ckpt, job.run.weights)
            log(f"weights: started from {job.run.weights}")
        self.step_fn = make_step(self.model, self.device, d_model=m.d_model, lr=job.optim.lr,
                                 warmup=job.optim.warmup, amp=job.optim.amp, clip=job.optim.clip_grad,
                                 label_smoothing=m.label_smoothing, compile=job.engine.compile)
        self.optimizer, self.schedule, self.scaler = (self.step_fn.optimizer, self.step_fn.schedule,
                                                      self.step_fn.scaler)
        # 3. engine: the strategy's streams are created once, here
        self.strategy = make_strategy(job.engine.sync_strategy, self.device, job.engine, log=log)
        workers = job.data.workers
        if self.strategy.wants_workers and workers == 0:
            workers = min(4, os.cpu_count() or 1)
            log(f"engine: '{self.strategy.name}' loads in worker processes: --workers {workers}")
        data_cfg = dataclasses.replace(job.data, workers=workers)
        pin = self.device.type == "cuda"
        self.train_loader = make_loader(self.data.train, data_cfg, train=True, seed=job.run.seed, pin_memory=pin)
        self.dev_loader = make_loader(self.data.dev, dataclasses.replace(job.data, workers=0), train=False,
                                      seed=job.run.seed, pin_memory=pin)
        self.losses = DeferredLosses(self.device, job.engine.loss_interval)
        self.strategy.prepare(self.step_fn, [example_batch(shape, self.shape, job.run.seed)
                                             for shape in self.train_loader.shapes()])
        # 4. run directory (only now that everything above is valid)
        r = job.run
        self.save_dir = increment_path(r.project, r.name, r.exist_ok)
        (self.save_dir / "weights").mkdir(parents=True, exist_ok=True)
        from streamnmt.fsutil import atomic_write
        atomic_write(self.save_dir / "config.yaml", job.to_yaml())
        self.steps_log = CsvLog(self.save_dir / "steps.csv", STEP_COLUMNS)
        self.results_log = CsvLog(self.save_dir / "results.csv", RESULT_COLUMNS)
        self.sync_stats: list[dict[str, Any]] = []
        self.global_step, self.epoch, self.best_val = 0, 0, math.inf
        self.pending_rows: dict[int, dict[str, Any]] = {}  # step -> row waiting for its loss
        self.last_loss: float | None = None
        log(f"run dir: {self.save_dir}")
        log(f"model: {m.model} ({m.n_layers}+{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads, "
            f"d_ff {m.d_ff}), {self.model.num_params() / 1e6:.1f}M parameters; device {self.device}; "
            f"amp {job.optim.amp}; strategy {self.strategy.name}")

    def _resolve(self, job: TrainJob) -> TrainJob:
        """Fill the 'auto' settings from the device; the result is what config.yaml records."""
        cuda = self.device.type == "cuda"
        preset = job.model.model
        if preset == "auto":
            preset = "base" if cuda else "small"
            if not cuda:
                self.log("no GPU: using the 'small' model preset so a CPU run finishes in minutes "
                         "(--model base for the original size)")
        model = job.model.resolve(preset)
        optim, run, data = job.optim, job.run, job.data
        if optim.warmup is None:
            optim = dataclasses.replace(optim, warmup=4000 if preset == "base" else 400)
        if optim.amp == "auto":
            amp = "bf16" if cuda and torch.cuda.is_bf16_supported() else "off"
            optim = dataclasses.replace(optim, amp=amp)
        if run.epochs is None:
            run = dataclasses.replace(run, epochs=10 if cuda else 2)
        if not cuda and data.data is None and preset != "base" and data.builtin_size == 40000 and \
                job.run.epochs is None:
            data = dataclasses.replace(data, builtin_size=16000)
        run = dataclasses.replace(run, device=str(self.device))
        return dataclasses.replace(job, model=model, optim=optim, run=run, data=data)

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        r = self.job.run
        self.log(f"{'Epoch':>7}{'GPU_mem':>9}{'batches':>9}{'tokens/s':>10}{'train_loss':>12}"
                 f"{'val_loss':>10}{'BLEU':>7}{'time':>8}")
        for epoch in range(self.epoch, r.epochs):
            self.epoch = epoch
            row = self.run_epoch(epoch)
            self.log(f"{epoch + 1:>3}/{r.epochs:<3}{row['gpu_mem_gb']:>8.2f}G{row['steps']:>9}"
                     f"{row['tokens_per_s']:>10.0f}{row['train_loss']:>12.4f}{row['val_loss']:>10.4f}"
                     f"{row['bleu'] if row['bleu'] != '' else '-':>7}{row['epoch_s']:>7.1f}s")
            self.log(self.sync_table)
            if r.max_steps and self.global_step >= r.max_steps:
                break
        self.steps_log.close()
        self.results_log.close()
        return {"save_dir": self.save_dir, "best_val": self.best_val, "steps": self.global_step,
                "last": row}

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        r = self.job.run
        self.model.train()
        self.train_loader.set_epoch(epoch)
        STATS.reset()
        t0 = time.perf_counter()
        tokens, loss_sum, loss_n = 0, 0.0, 0
        n_batches = len(self.train_loader)
        if r.max_steps:
            n_batches = min(n_batches, r.max_steps - self.global_step)
        bar = _progress(n_batches, f"epoch {epoch + 1}/{r.epochs}")
        steps = self.strategy.run(_limit(self.train_loader, n_batches), self.step_fn, self.losses,
                                  start_step=self.global_step)
        for info in steps:
            # 1. bookkeeping on the host only: no device value is read here
            self.global_step = info.step
            tokens += info.batch.ntokens
            self.pending_rows[info.step] = {"step": info.step, "epoch": epoch + 1, "tokens": info.batch.ntokens,
                                            "lr": noam_lr(info.step, self.shape.d_model, self.job.optim.warmup,
                                                          self.job.optim.lr)}
            # 2. losses whose copies to the host have completed (never blocks)
            for step, loss in self.losses.poll():
                loss_sum, loss_n = loss_sum + loss, loss_n + 1
                self._write_step(step, loss)
            bar.update(1)
            if self.last_loss is not None:
                bar.set_postfix_str(f"loss {self.last_loss:.4f} (as of last extraction)", refresh=False)
        # 3. epoch end: drain the streams and the remaining losses
        # Needed: the epoch's time and every loss must be final before they are reported.
        self.strategy.drain("epoch.drain")
        for step, loss in self.losses.flush("epoch.losses"):
            loss_sum, loss_n = loss_sum + loss, loss_n + 1
            self._write_step(step, loss)
        bar.close()
        epoch_s = time.perf_counter() - t0
        train_stats = STATS.reset()
        # 4. validation loss and BLEU (timed separately from training)
        val_loss = self.validate()
        bleu, bleu_s = self.bleu()
        row = {"epoch": epoch + 1, "train_loss": loss_sum / max(loss_n, 1), "val_loss": val_loss,
               "bleu": "" if bleu is None else round(bleu, 2), "tokens_per_s": tokens / epoch_s,
               "epoch_s": round(epoch_s, 3), "bleu_s": round(bleu_s, 3),
               "gpu_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else 0.0,
               "sync_count": sum(s["count"] for s in train_stats.values()),
               "sync_ms": round(sum(s["total_ms"] for s in train_stats.values()), 3),
               "steps": self.global_step}
        self.results_log.write(row)
        self.sync_stats.append({"epoch": epoch + 1, "strategy": self.strategy.name, "train": train_stats,
                                "eval": STATS.reset()})
        write_json(self.save_dir / "sync_stats.json", self.sync_stats)
        self.sync_table = format_table(train_stats)
        # 5. checkpoints
        self.save(self.save_dir / "weights" / "last.pt")
        if val_loss < self.best_val:
            self.best_val = val_loss
            self.save(self.save_dir / "weights" / "best.pt")
        return row

    def _write_step(self, step: int, loss: float) -> None:
        row = self.pending_rows.pop(step)
        row["loss"] = loss
        self.steps_log.write(row)
        self.last_loss = loss

    @torch.no_grad()
    def validate(self) -> float:
        """Token-level validation loss; sums stay on the device, one counted sync at the end."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        ntok = torch.zeros((), dtype=torch.int64, device=self.device)
        for batch in self.dev_loader:
            b = batch.to(self.device, non_blocking=True)
            loss, n = self.step_fn.loss_sum(b)
            total += loss.double()
            ntok += n
        self.model.train()
        # Needed: the epoch's validation loss is reported and compared for best.pt.
        value = host_sync("eval.val_loss", lambda: (total / ntok.clamp(min=1)).item())
        return float(value)

    def bleu(self) -> tuple[float | None, float]:
        n = self.job.run.bleu_samples
        if n == 0:
            return None, 0.0
        from streamnmt.translate import bleu_on_pairs
        pairs = read_pairs(self.job.data, "dev")[:n]
        res = bleu_on_pairs(self.model, self.data.src_tok, self.data.tgt_tok, pairs, device=self.device,
                            beam_size=self.job.run.beam_size, tgt_lang=self.job.data.tgt_lang)
        return res["bleu"], res["seconds"]

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "model_shape": dataclasses.asdict(self.shape),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "schedule_step": self.global_step,
            "tokenizers": {side: {"path": str(Path(tok.path).resolve()), "sha256": tok.sha256,
                                  "vocab_size": tok.vocab_size}
                           for side, tok in (("src", self.data.src_tok), ("tgt", self.data.tgt_tok))},
            "config": self.job.to_dict(),
            "epoch": self.epoch, "step": self.global_step, "best_val": self.best_val,
            "sampler": self.train_loader.state_dict(), "rng": rng_state(),
        }

    def save(self, path: Path) -> None:
        save_checkpoint(path, self.checkpoint_state())


def example_batch(shape: tuple[int, int, int], model: ModelShape, seed: int) -> Batch:
    """A batch of random tokens of ``shape`` (B, S, T), e.g. to capture a graph for that shape."""
    b, s, t = shape
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, model.src_vocab, (b, s), generator=g)
    tgt = torch.randint(4, model.tgt_vocab, (b, t + 1), generator=g)
    return Batch(src=src, tgt_in=tgt[:, :-1].contiguous(), tgt_out=tgt[:, 1:].contiguous(),
                 ntokens=b * t, src_tokens=b * s)


def _limit(loader, n: int):
    for i, batch in enumerate(loader):
        if i >= n:
            break
        yield batch


def _progress(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=None)
