"""The NMT training step the engine drives: loss, backward, clipped Adam on the Noam schedule.

:class:`NMTStep` splits a step into the three phases the strategies schedule on their streams
(forward, backward, optimizer step) and does all of it without a host sync: the token count
that normalises the loss stays on the device, the learning rate is a device tensor the fused Adam
reads, and a non-finite step is discarded on the device. Graph mode captures the same object.

Global steps: a batch from the loader carries ``norm`` (a device scalar, 1 / the target tokens
of its whole global step: every accumulation micro-batch on every rank), so the step's loss is
``loss_sum * norm`` and the gradients summed over micro-batches and ranks are those of the global
batch's token-mean loss, as if it were one batch. On several ranks the model is wrapped in
DistributedDataParallel, which averages gradients over the N ranks, so the backward loss is
multiplied by N; ``begin_micro`` turns DDP's all-reduce off for all but a step's last micro-batch.
DDP is built lazily, by :meth:`NMTStep.parallel`, under the stream the first forward runs on (the
strategy's compute stream, or graph mode's capture stream), because DDP ties its gradient hooks
to the stream it is built under.

Each optimizer step leaves its gradient norm and whether its update was skipped in ``stats`` (a
device tensor written in place), which the trainer reads with the deferred losses: no extra sync.

The model runs inside :class:`LossModel` (what DDP wraps and torch.compile compiles), whose output
layer never holds the logits of a whole batch; it returns the plain NLL beside the smoothed loss,
which the step hands to the engine as a named value (``values``), read with the deferred losses.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from streamnmt.models import masks
from streamnmt.data import Batch
from streamnmt.training import compile_cache
from streamnmt.training.ema import EMA
from streamnmt.models.transformer import ModelShape
from streamnmt.models.xent import linear_cross_entropy
from streamnmt.training.optim import Adam
from streamnmt import testhooks


def _loss_eager() -> Callable[..., Any]:
    """The chunked loss, kept outside torch.compile: compiled by inductor for CUDA (torch 2.11, bf16),
    its gradients came out zero (grad_norm 0.0 under `--compile on`, graph and full strategies
    alike; docs/PERFORMANCE.md), while compiled on the CPU and eager everywhere they are right. The model body
    is still compiled; the loss's kernels run eagerly (and inside graph mode's CUDA graph). Made on
    first use of a compiled step: ``torch.compiler.disable`` imports TorchDynamo (about a second of
    every run's start-up otherwise)."""
    global _LOSS_EAGER
    if _LOSS_EAGER is None:
        _LOSS_EAGER = torch.compiler.disable(linear_cross_entropy)
    return _LOSS_EAGER


_LOSS_EAGER: Callable[..., Any] | None = None


def import_in_background(compiled: bool, ddp: bool = False) -> threading.Thread | None:
    """Import TorchDynamo (and Inductor's compiler where the step will be compiled) on a daemon
    thread while the run prepares its data, instead of on the main thread when the step is made,
    where the run needs it: to compile, or for DistributedDataParallel, whose constructor reads
    TorchDynamo's settings. An import that fails here is left to the main thread, which imports
    again and raises where it needs the module. None where there is nothing to import: a run on
    one process that stays eager never imports TorchDynamo (its optimizer is
    :class:`streamnmt.training.optim.Adam`)."""
    names = (["torch._dynamo"] if compiled or ddp else []) + (["torch._inductor.compile_fx"] if compiled else [])
    names = [n for n in names if n not in sys.modules]
    if not names:
        return None

    def run() -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:
                return

    thread = threading.Thread(target=run, name="streamnmt-imports", daemon=True)
    thread.start()
    return thread


def noam_lr(step: int, d_model: int, warmup: int, factor: float) -> float:
    """Learning rate at optimizer step ``step`` (1-based), computed on the host for logging."""
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class NoamSchedule:
    """Noam schedule kept on the device: the learning rate is a tensor the optimizer reads, updated
    by device kernels each step, so neither an eager step nor a captured CUDA graph waits on the host.

    A cool-down (``--lr-cooldown``, :meth:`plan`) scales it by ``(end - step) / (end - start)``,
    within [0, 1]: the Noam rate up to ``start``, falling linearly to zero at ``end``. The plan lives in
    two device tensors the step reads (a captured graph sees a new plan); none planned, ``end`` is
    infinite and the scale 1."""

    def __init__(self, d_model: int, warmup: int, factor: float, device: torch.device):
        self.d_model, self.warmup, self.factor = d_model, warmup, factor
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_t = torch.zeros((), dtype=torch.float32, device=device)
        self.end_t = torch.full((), math.inf, dtype=torch.float32, device=device)
        self.span_t = torch.ones((), dtype=torch.float32, device=device)
        self.cooldown: tuple[int, int] | None = None  # (start, end) steps, the host's copy of the plan

    def _update_lr(self) -> None:
        s = self.step_t.clamp(min=1)  # the same formula as lr_at, on device tensors
        noam = self.factor * self.d_model ** -0.5 * torch.minimum(s.rsqrt(), s * self.warmup ** -1.5)
        self.lr_t.copy_(noam * ((self.end_t - self.step_t) / self.span_t).clamp(0.0, 1.0))

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based), computed on the host (logs)."""
        lr = noam_lr(step, self.d_model, self.warmup, self.factor)
        return lr * cooldown_scale(step, self.cooldown)

    def advance(self) -> None:
        self.step_t += 1
        self._update_lr()

    def set_step(self, step: int) -> None:
        """Continue after ``step`` optimizer steps (resume)."""
        self.step_t.fill_(step)
        self._update_lr()

    def plan(self, start: int, end: int) -> None:
        """Cool down from optimizer step ``start`` to zero at step ``end`` (> ``start``). Two fills on
        the current stream, no host wait: between two batches of the engine's run, before the next
        one. A step still in flight is one at or before ``start``: whichever of the old and new
        values it reads, its scale is 1. The rate itself is left to the next :meth:`advance` (a write
        to it here could land between an in-flight step's advance and its Adam)."""
        if end <= start:
            raise ValueError(f"a cool-down ends after it starts; got steps {start} -> {end}")
        self.cooldown = (start, end)
        self.end_t.fill_(float(end))
        self.span_t.fill_(float(end - start))


def cooldown_scale(step: int, plan: tuple[int, int] | None) -> float:
    """The learning rate's factor at optimizer step ``step`` under cool-down ``plan`` ((start, end)
    steps, or None): 1 up to ``start``, then falling linearly to 0 at ``end``."""
    if plan is None:
        return 1.0
    start, end = plan
    return min(max((end - step) / (end - start), 0.0), 1.0)


class LossSums(NamedTuple):
    loss: torch.Tensor     # summed cross-entropy with the training's label smoothing
    nll: torch.Tensor      # summed plain NLL (no smoothing, no gradient)
    ntokens: torch.Tensor  # target tokens (not PAD)


class LossModel(nn.Module):
    """The model and its output loss as one module, which DDP wraps and torch.compile compiles: the
    generator runs inside the chunked loss (:func:`streamnmt.models.xent.linear_cross_entropy`), so the
    logits of a whole batch never exist."""

    def __init__(self, model: nn.Module, label_smoothing: float, compiled: bool = False):
        super().__init__()
        self.model, self.label_smoothing = model, label_smoothing
        self.loss_fn = _loss_eager() if compiled else linear_cross_entropy  # see _loss_eager

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor,
                segments: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``segments``: those of a packed batch (``Batch.segments()``), else None."""
        m = self.model
        h = m.features(src, tgt_in, masks.src_mask(src), None, segments)  # (B, T, D)
        gen = m.generator
        return self.loss_fn(h.flatten(0, 1), gen.weight, gen.bias, tgt_out.flatten(),
                           label_smoothing=self.label_smoothing, ignore_index=masks.PAD)


class NMTStep:
    """One training step in the three phases the strategies schedule on their streams.

    A non-finite loss or gradient norm discards the update on the device: the fused Adam reads a
    ``found_inf`` flag and leaves weights and moments untouched (with fp16, the grad scaler does
    the same and lowers its scale). The host learns of it later, from the extracted loss.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: NoamSchedule,
                 *, amp_dtype: torch.dtype | None, scaler: torch.amp.GradScaler | None, clip: float,
                 label_smoothing: float, ddp: torch.nn.Module | None = None,
                 parallelize: Callable[[torch.nn.Module], tuple[torch.nn.Module, torch.nn.Module]] | None = None):
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.amp_dtype, self.scaler, self.clip, self.ls = amp_dtype, scaler, clip, label_smoothing
        self.params = [p for p in model.parameters() if p.requires_grad]
        if scaler is not None:  # create the scaler's device state now (it is lazy), before any capture
            scaler.scale(torch.zeros((), device=self.params[0].device))
        self.loss: torch.Tensor | None = None
        self.ddp = ddp  # the DistributedDataParallel wrapper inside ``model`` (compiled or not), if any
        self._parallelize = parallelize  # builds ``ddp`` (and compiles) at the first forward; see parallel()
        self.world = self.ddp.process_group.size() if self.ddp is not None else 1  # DDP averages: x N
        # [gradient norm, 1.0 if the update was skipped] of the latest optimizer step (in place: graph mode)
        self.stats = torch.zeros(2, dtype=torch.float32, device=self.params[0].device)
        self.grads_to_none = True  # graph mode with accumulation keeps the .grad tensors in place
        # Every micro-batch loss of the step so far was finite (in place: graph mode captures it).
        self.loss_ok = torch.ones((), dtype=torch.bool, device=self.params[0].device)
        # Test hooks (streamnmt.testhooks): a non-finite loss at this (1-based) call, to exercise the
        # NaN policy (eager strategies only: graph mode's warm-up and capture calls count too), and
        # from that call on an infinite gradient under a finite loss.
        self.inject_inf_at = testhooks.inf_loss_call()
        self.inject_inf_grad_from = testhooks.inf_grad_from_call()
        self.calls = 0
        self.updates = 0  # optimizer steps so far, on the host (which of them update the EMA; set on resume)
        self.ema: EMA | None = None  # set by make_step(ema=...): averaged weights, updated in the step
        # Named device scalars the engine pushes beside each loss (``StepFunction.values``): the
        # plain NLL share of the last forward, beside its smoothed loss.
        self.values = {"nll": torch.zeros((), dtype=torch.float32, device=self.params[0].device)}
        # Set by make_step(compile=True): where the compiled artefacts persist (saved by compile_ready).
        self.compile_cache: compile_cache.CompileCache | None = None
        self._save_after_step: Callable[[str], None] | None = None  # eager strategies: the log to save with

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a step mutates (graph mode saves and restores them around its warm-up)."""
        out = list(self.params)
        out += [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        out += [self.schedule.step_t, self.schedule.lr_t, self.loss_ok]
        if self.scaler is not None:
            out += [self.scaler._scale, self.scaler._growth_tracker]
        if self.ema is not None:
            out += self.ema.shadow
        return out

    def loss_sum(self, batch) -> LossSums:
        """The batch's summed smoothed cross-entropy (with the training's label smoothing), summed plain
        NLL (what validation reports) and target token count: device scalars, from one pass over the
        logits (:mod:`streamnmt.models.xent`)."""
        dev_type = batch.src.device.type
        with torch.autocast(dev_type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            loss, nll = self.model(batch.src, batch.tgt_in, batch.tgt_out,
                                   segments=batch.segments() if hasattr(batch, "segments") else None)
        return LossSums(loss, nll, (batch.tgt_out != masks.PAD).sum())

    @property
    def data_parallel(self) -> bool:
        """Gradients are all-reduced by DDP (built now, or at the first forward)."""
        return self.ddp is not None or self._parallelize is not None

    def parallel(self) -> None:
        """Build the DDP wrapper now, under the current stream (the one the forwards will run on);
        the first forward does it if no one did before. A no-op without DDP or once built."""
        if self._parallelize is None:
            return
        build, self._parallelize = self._parallelize, None
        self.model, self.ddp = build(self.model)
        self.world = self.ddp.process_group.size()

    def begin_micro(self, last: bool) -> None:
        """The next forward's backward all-reduces gradients across ranks only if ``last``."""
        self.parallel()
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = last  # what DDP's no_sync() toggles

    def forward(self, batch) -> torch.Tensor:
        self.parallel()
        self.calls += 1
        loss, nll, ntok = self.loss_sum(batch)
        if getattr(batch, "norm", None) is not None:
            scale = batch.norm  # this micro-batch's share of the global step's token mean
        else:
            scale = 1 / ntok.clamp(min=1)  # token-level mean; the count stays on the device
        loss = loss * scale
        self.values["nll"].copy_(nll * scale)  # in place: graph replays update the tensor pushed
        if self.calls == self.inject_inf_at:
            loss = loss * float("inf")
        self.loss = loss.detach()  # keeps no autograd graph alive
        self.loss_ok.logical_and_(torch.isfinite(self.loss))  # for the finiteness check of the step
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        if self.world > 1:
            loss = loss * self.world  # DDP averages the ranks' gradients; the global loss is their sum
        if 0 < self.inject_inf_grad_from <= self.calls:
            loss = loss + _InfGrad.apply(self.params[0])
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def count_updates(self, n: int | None = None) -> int:
        """The host's count of updates: one more (an update graph mode replayed; eager ones count
        themselves), or set to ``n`` (after graph mode's warm-up, on resume). Returns it."""
        self.updates = self.updates + 1 if n is None else n
        return self.updates

    def ema_due(self) -> bool:
        """The next optimizer step updates the weights' moving average (``--ema-every``)."""
        return self.ema is not None and self.ema.due(self.updates)

    def optimizer_step(self, ema: bool | None = None) -> None:
        """One update. ``ema``: whether it updates the moving average too (graph mode captures both);
        None = where due by the host's count of updates."""
        ema = self.ema_due() if ema is None else ema and self.ema is not None
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # device-side; the scaler tells the fused Adam to skip inf steps
            # foreach norm without error_if_nonfinite: no host sync; an infinite max_norm only measures.
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip > 0 else float("inf"),
                                                  foreach=True)
        else:
            norm = self._clip_in_adam()
        self.schedule.advance()
        skipped = (~(torch.isfinite(norm) & self.loss_ok)).float()  # what the scaler or found_inf skips
        self.stats[0].copy_(norm)
        self.stats[1].copy_(skipped)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            # Discard a non-finite step on the device (the fused Adam skips when found_inf is 1).
            self.optimizer.found_inf = skipped
            self.optimizer.step()
        if ema:
            self.ema.update()  # device kernels after the update, so graph mode captures them too
        self.updates += 1
        self.loss_ok.fill_(True)
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)
        if self._save_after_step is not None and not _capturing():  # host work only: never inside a capture
            log, self._save_after_step = self._save_after_step, None
            self.compile_cache.save(log)  # the first eager step compiled its shape (forward and backward)

    def _clip_in_adam(self) -> torch.Tensor:
        """The gradient norm, and the clipping handed to the fused Adam as its ``grad_scale`` (it divides
        each gradient by it as it reads it) instead of a separate pass that multiplies every gradient
        in place: one pass over all gradients fewer a step (the fused Adam writes them back divided;
        its share of the step: docs/PERFORMANCE.md, "The update"). The same update as
        ``clip_grad_norm_``'s factor ``clip / (norm + 1e-6)`` capped at 1, up to rounding (divided
        by its reciprocal). The fp16 path keeps ``clip_grad_norm_``: its grad scaler owns
        ``grad_scale``."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)  # no host sync: no error_if_nonfinite
        if self.clip > 0:
            # finite: a huge but finite norm must scale the gradients down, not to 0
            self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.clip, min=1.0,
                                                    max=torch.finfo(torch.float32).max)
        return norm

    def use_compiled(self, shapes: int) -> None:
        """From the next forward on, the step runs its model compiled (``--compile background``: the
        compile cache holds its artefacts, so this compiles warm at the next forward); one process, no
        DDP. :meth:`use_uncompiled` undoes it."""
        loss_model = self.model
        if not isinstance(loss_model, LossModel) or self.ddp is not None or self._parallelize is not None:
            raise RuntimeError("only a one-process step that is not compiled yet can switch to compiled")
        fit_compile_cache(shapes)
        loss_model.loss_fn = _loss_eager()  # as make_step(compile=True) makes it: see _loss_eager
        self._uncompiled, self.model = loss_model, compiled(loss_model)

    def use_uncompiled(self) -> None:
        """Back to the uncompiled model (its compiled step could not be captured)."""
        loss_model = getattr(self, "_uncompiled", None)
        if loss_model is not None:
            loss_model.loss_fn = linear_cross_entropy
            self.model, self._uncompiled = loss_model, None

    def compile_ready(self, log: Callable[[str], None]) -> None:
        """Called once the engine is prepared: with ``compile``, save the compiled artefacts (once per
        run) and say how long the start took and whether the compile cache was warm. Graph mode's
        warm-up has run the compiled step of every training shape by now; an eager strategy compiles
        at its first steps, so the save waits for the end of its first optimizer step."""
        cache = self.compile_cache
        if cache is None:
            return
        cache.say_pending(log)  # a warning from make_step, which has no log
        if self.calls:
            cache.save(log)
        else:
            self._save_after_step = log
        log(cache.ready_line(compiled=self.calls > 0))


def _capturing() -> bool:
    """A CUDA graph capture is under way on the current stream (a host-side query, no sync)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _InfGrad(torch.autograd.Function):
    """Test hook: adds 0 to the loss and an infinite gradient to ``p``."""

    @staticmethod
    def forward(ctx, p: torch.Tensor) -> torch.Tensor:
        ctx.like = p.detach()
        return p.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(ctx.like, float("inf"))


def make_step(model: torch.nn.Module, device: torch.device, *, d_model: int, lr: float = 1.0,
              warmup: int = 4000, amp: str = "off", clip: float = 1.0, label_smoothing: float = 0.0,
              compile: bool = False, shapes: int = 1, ema: float = 0.0, ema_every: int = 1, ddp: bool = False,
              bucket_cap_mb: float = 25.0, loss_model: nn.Module | None = None) -> NMTStep:
    """The optimizer, schedule, grad scaler and step function for ``model`` (trainer and bench).

    With ``compile``, the model is compiled for each of its ``shapes`` batch shapes (static shapes:
    what CUDA graph capture needs); the compile cache is made large enough to hold all of them, and
    the compiled artefacts persist under ``$STREAMNMT_HOME/compile`` (:mod:`.compile_cache`; the key
    that ``recipe.resolve_compile`` staged, else the directories alone).
    ``ddp``: wrap the model in DistributedDataParallel (the process group is initialised), at the
    step's first forward or :meth:`NMTStep.parallel` (compiled after wrapping), in buckets of
    ``bucket_cap_mb``. ``loss_model``: the
    module that computes the loss sums (default :class:`LossModel` of ``model``; the bench's stock
    peer brings its own), whose parameters the optimizer then updates.
    """
    schedule = NoamSchedule(d_model, warmup, lr, device)
    # Fused Adam reading the learning rate from a device tensor; capturable so that graph mode
    # can put the step inside a CUDA graph (used by every strategy, so all compute the same).
    loss_model = LossModel(model, label_smoothing, compiled=compile) if loss_model is None else loss_model
    optimizer = Adam(loss_model.parameters(), lr=schedule.lr_t, betas=(0.9, 0.98), eps=1e-9,
                     fused=True, capturable=device.type == "cuda")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
    cache = None
    if compile:
        fit_compile_cache(shapes)
        cache = compile_cache.for_step(model)  # before torch.compile first runs: it reads the directories

    def parallelize(m: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
        from streamnmt.dist import parallelize as wrap
        wrapped = wrap(m, device, bucket_cap_mb)
        return (compiled(wrapped) if compile else wrapped), wrapped

    step_model = compiled(loss_model) if compile and not ddp else loss_model
    step = NMTStep(step_model, optimizer, schedule, amp_dtype=amp_dtype, scaler=scaler, clip=clip,
                   label_smoothing=label_smoothing, parallelize=parallelize if ddp else None)
    if ema > 0:
        step.ema = EMA(step.params, ema, schedule.step_t, every=ema_every)
    step.compile_cache = cache
    return step


def compiled(m: torch.nn.Module) -> torch.nn.Module:
    """``m`` compiled as the training step compiles it (static shapes: what CUDA graph capture needs)."""
    backend = testhooks.compile_backend()
    if backend is not None:
        return torch.compile(m, dynamic=False, backend=backend)
    return torch.compile(m, dynamic=False, options=inductor_options() or None)


def inductor_options() -> dict[str, bool]:
    """Inductor settings of the training step's compile (``torch.compile(options=...)``).

    Mix-order reduction off. With it (on by default in the torch 2.11 and 2.13 builds used here)
    Inductor fuses each layer norm's backward with its weight and bias gradient sums over the rows
    into one kernel (16 rows per program in the kernels read). In the packed base-model step
    those kernels, with the residual dropout's mask fused in, were slow, and with the setting off
    the step ran faster (docs/PERFORMANCE.md, "Inductor's mix-order reduction"). Where this torch has
    no such setting, or the user set ``TORCHINDUCTOR_MIX_ORDER_REDUCTION`` themselves, nothing is
    changed."""
    import torch._inductor.config as inductor_config

    triton_config = getattr(inductor_config, "triton", None)
    if not hasattr(triton_config, "mix_order_reduction") or "TORCHINDUCTOR_MIX_ORDER_REDUCTION" in os.environ:
        return {}
    return {"triton.mix_order_reduction": False}


def inductor_key() -> dict[str, str]:
    """What :func:`inductor_options` depends on, for the compile cache's key, without importing
    Inductor (seconds of a run's start-up where the run may not compile at all): the user's
    ``TORCHINDUCTOR_MIX_ORDER_REDUCTION``, and torch's version, which the key holds besides and which
    decides whether the setting exists."""
    return {"mix_order_reduction": os.environ.get("TORCHINDUCTOR_MIX_ORDER_REDUCTION", "off unless absent")}


def fit_compile_cache(shapes: int) -> None:
    """Let torch.compile keep one compiled graph per batch shape (it stops compiling, and runs
    eagerly, after ``recompile_limit`` shapes: 8 by default, fewer than a real corpus has)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the name differs across torch versions
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), shapes + 2))


def example_batch(shape: tuple[int, int, int], model: ModelShape, seed: int, packed: bool = False) -> Batch:
    """A batch of random tokens of ``shape`` (B, S, T), e.g. to capture a graph for that shape. It
    carries a loss normaliser as the loader's batches do (graph mode keys graphs on every tensor);
    ``packed``: and the segment tensors of a packed batch."""
    if packed:
        from streamnmt.data.packbatch import example_packed

        return example_packed(shape, model.src_vocab, model.tgt_vocab, seed)
    b, s, t = shape
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, model.src_vocab, (b, s), generator=g)
    tgt = torch.randint(4, model.tgt_vocab, (b, t + 1), generator=g)
    return Batch(src=src, tgt_in=tgt[:, :-1].contiguous(), tgt_out=tgt[:, 1:].contiguous(),
                 ntokens=b * t, src_tokens=b * s, norm=torch.tensor(1.0 / (b * t), dtype=torch.float32),
                 norm_tokens=b * t)
