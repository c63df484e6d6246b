"""Recipe: the job's 'auto' settings resolved once, before anything is built.

The model preset, the token budget sized for the device, the warm-up that follows the tokens per
update, mixed precision, the engine strategy and ``--compile auto``: each is decided here from the
device and the data, said in one start line, and recorded in config.yaml as the value it took.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from streamnmt.config import (TOKENS_PER_GIB, WARMUP_TOKENS, ModelConfig, OptimConfig, TrainJob, recipe_max_tokens,
                              recipe_warmup)
from streamnmt.data import TokenizedCorpus, batch_plan
from streamnmt.data.config import DataConfig
from streamnmt.engine.auto import choose_compile, choose_strategy, graph_step_s
from streamnmt.training.step import noam_lr
from streamnmt.training.stopping import parse_duration


def resolve_job(job: TrainJob, device: torch.device, world: int, log: Callable[[str], None]) -> TrainJob:
    """Fill the 'auto' settings from the device; the result is what config.yaml records."""
    cuda = device.type == "cuda"
    preset = job.model.model
    if preset == "auto":
        preset = "base" if cuda else "small"
        if not cuda:
            pairs = job.data.builtin_size or 16000
            corpus = f" and a {pairs}-pair built-in corpus" if job.data.data is None else ""  # not with --data
            log(f"no GPU: using the 'small' model preset{corpus} so a CPU run finishes in minutes "
                     "(--model base for the original size)")
    model = job.model.resolve(preset)
    optim, run, data = job.optim, job.run, job.data
    data, optim = resolve_recipe(data, optim, model, job.engine.accum_steps, device, world, log)
    if optim.amp == "auto":  # bf16 where the GPU has it natively, else fp16 with the grad scaler
        optim = dataclasses.replace(optim, amp=("bf16" if native_bf16() else "fp16") if cuda else "off")
    if run.epochs is None:
        run = dataclasses.replace(run, epochs=10 if cuda else 2)
    if data.builtin_size is None:
        data = dataclasses.replace(data, builtin_size=40000 if preset == "base" else 16000)
    run = dataclasses.replace(run, device=str(device))
    strategy = choose_strategy(job.engine.sync_strategy, device)
    if job.engine.sync_strategy == "auto":
        log(f"engine: strategy {strategy.value} ({strategy.why})")
    engine = dataclasses.replace(job.engine, sync_strategy=strategy.value)
    return dataclasses.replace(job, model=model, optim=optim, run=run, data=data, engine=engine)

def resolve_recipe(data: DataConfig, optim: OptimConfig, model: ModelConfig, accum: int, device: torch.device,
                   world: int, log: Callable[[str], None]) -> tuple[DataConfig, OptimConfig]:
    """The default token budget (on a GPU) and the warm-up that follows the tokens per update
    (rules and reference in streamnmt.config); one start line says what was chosen and why."""
    notes, d_model = [], model.d_model
    if data.max_tokens is None:
        if device.type == "cuda":
            gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
            tokens = max(recipe_max_tokens(gib, d_model), data.max_len)
            notes.append(f"--max-tokens {tokens} (auto: {TOKENS_PER_GIB} per GiB of the GPU's {gib:.0f} GiB at "
                         f"d_model 512, x 512/{d_model}, a power of two)")
        else:
            tokens = 0  # CPU: small batches of --batch-size sentences keep a CPU run short
        data = dataclasses.replace(data, max_tokens=tokens)
    if optim.warmup is None:
        if data.max_tokens:
            per_update = data.max_tokens * accum * world
            warmup = recipe_warmup(per_update)
            notes.append(f"--warmup {warmup} (auto: {WARMUP_TOKENS / 1e6:.1f}M tokens over {per_update} "
                         f"per update; peak lr {noam_lr(warmup, d_model, warmup, optim.lr):.2e})")
        else:
            warmup = 4000 if model.model == "base" else 400  # sentence batches: per preset
        optim = dataclasses.replace(optim, warmup=warmup)
    if notes:
        log("recipe: " + "; ".join(notes))
    return data, optim

def resolve_compile(job: TrainJob, train: TokenizedCorpus, device: torch.device, world: int,
                    log: Callable[[str], None]) -> TrainJob:
    """``--compile auto``: decided from the run's planned steps and batch shapes (see engine.auto)."""
    per_epoch, shapes = batch_plan(train, job.data)
    steps = per_epoch * job.run.epochs // world  # micro-batches each process runs
    if job.run.max_steps:
        steps = min(steps, job.run.max_steps * job.engine.accum_steps)
    tokens = max((b * t for b, _, t in shapes), default=0)  # target positions of the largest step
    m = job.model  # sizes resolved from the preset by now
    choice = choose_compile(job.engine.compile, device, job.engine.sync_strategy, steps, len(shapes),
                            graph_step_s(tokens, m.n_layers, m.d_model, m.d_ff),
                            parse_duration(job.run.time_limit) or 0.0)
    if job.engine.compile == "auto":
        log(f"engine: compile {'on' if choice.value else 'off'} ({choice.why})")
    return dataclasses.replace(job, engine=dataclasses.replace(job.engine, compile="on" if choice.value else "off"))


def native_bf16() -> bool:
    """The GPU computes bf16 natively (not emulated; torch < 2.4 has no ``including_emulation``)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:
        return torch.cuda.is_bf16_supported()
