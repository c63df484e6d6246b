"""``--sync-strategy auto`` and ``--compile auto``: the fastest mode a device supports, chosen once.

Measured (docs/PERFORMANCE.md): graph mode runs the base model several times faster than any eager
strategy at small batches and is never slower, so ``auto`` is ``graph`` on CUDA (graph mode still
falls back to ``full`` by itself, in one line, where capture fails) and ``full`` on a CPU, where
there is nothing to capture.

Compiling pays only when the time it saves outweighs the time it costs. torch.compile traces and
tunes the step once per batch shape (``COMPILE_S_PER_SHAPE``, measured) and then saves a share of
each step (``COMPILE_SAVING``, measured at the packed shape of the GPU defaults). ``auto``
compiles when ``planned training time x saving >= 2 x compile time``: when the run is long enough
to win the compile time back twice. The planned time is the planned steps times graph mode's step
time, estimated from the tokens a step holds (``GRAPH_MS_PER_KTOKEN``, measured on packed batches
of the base model, scaled by the model's matrix sizes; at least ``GRAPH_MS_PER_STEP``, the
launch-bound floor of small batches), and at most ``--time-limit``. With the packed batches of
the GPU defaults (one shape) that compiles any run of more than about six minutes. Only graph mode
is considered: compiled eager steps are still bound by kernel launches.

The compile time is the caller's argument (``compile_s``): a cold compile costs
``COMPILE_S_PER_SHAPE``; where the persistent compile cache already holds the artefacts of the same
model, batch shapes and environment (``streamnmt.training.compile_cache``), a warm one costs
``COMPILE_S_PER_SHAPE_WARM``, and much shorter runs win it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The compile model's constants, measured with the base model, bf16, vocabulary 32k, packed batches
# of 16,384 target positions on the built-in corpus (docs/PERFORMANCE.md, "Compile and Inductor
# settings"): graph mode's step time per 1,000 positions, the saving of --compile (Inductor's
# mix-order reduction off, as the step compiles) and its time from start to ready (the mean of
# several runs, rounded up). The packed figures rule: they are the shape the defaults train.
COMPILE_S_PER_SHAPE = 34.0
# A compile whose artefacts the persistent cache holds (Dynamo still traces; AOTAutograd, Inductor and
# Triton load their results): ready in a fraction of the cold time, base model, with torch's bytecode
# compiled as pip installs it, scripts/bench_compile_cache.py (docs/PERFORMANCE.md, "The warm compile
# cache"), rounded up.
COMPILE_S_PER_SHAPE_WARM = 7.0
COMPILE_SAVING = 0.194
GRAPH_MS_PER_STEP = 6.0  # the launch-bound floor of small batches (32 x 32; docs/PERFORMANCE.md)
GRAPH_MS_PER_KTOKEN = 1.96
BASE_MATRICES = 6 * 512 * (4 * 512 + 2 * 2048)  # n_layers x d_model x (4 d_model + 2 d_ff) of the base model


def graph_step_s(tokens_per_step: int, n_layers: int = 6, d_model: int = 512, d_ff: int = 2048) -> float:
    """Estimated seconds of one graph-mode step of ``tokens_per_step`` target positions."""
    scale = n_layers * d_model * (4 * d_model + 2 * d_ff) / BASE_MATRICES
    return max(GRAPH_MS_PER_STEP, tokens_per_step / 1e3 * GRAPH_MS_PER_KTOKEN * scale) / 1e3


@dataclass(frozen=True)
class Choice:
    value: str | bool
    why: str


def choose_strategy(requested: str, device: torch.device) -> Choice:
    """The strategy ``requested`` resolves to on ``device`` (``auto``; any other name is kept)."""
    if requested != "auto":
        return Choice(requested, "as requested")
    if device.type == "cuda":
        return Choice("graph", "auto: CUDA is present, and a captured step is the fastest mode")
    return Choice("full", f"auto: no CUDA graphs on {device.type}; 'full' is the fastest eager strategy")


def choose_compile(requested: str, device: torch.device, strategy: str, planned_steps: int,
                   n_shapes: int, step_s: float = GRAPH_MS_PER_STEP / 1e3, time_limit_s: float = 0.0,
                   compile_s: float = COMPILE_S_PER_SHAPE, open_ended: bool = False) -> Choice:
    """Whether to torch.compile the model (``on``/``off`` kept; ``auto`` by the rule above).
    ``step_s``: graph mode's estimated step time (:func:`graph_step_s`); ``time_limit_s``: the
    run's ``--time-limit`` (0: none); ``compile_s``: seconds of compiling one batch shape
    (``COMPILE_S_PER_SHAPE`` cold, ``COMPILE_S_PER_SHAPE_WARM`` from a warm compile cache);
    ``open_ended``: no end was given (the run trains until its plateau, so ``planned_steps`` is a
    bound, not a plan, and the line says so instead of a duration)."""
    if requested in ("on", "off"):
        return Choice(requested == "on", "as requested")
    if device.type != "cuda" or strategy != "graph":
        return Choice(False, "auto: compiling pays only inside graph mode on CUDA")
    cost = compile_s * max(n_shapes, 1)
    planned = planned_steps * step_s
    if time_limit_s:
        planned = min(planned, time_limit_s)
    steps = min(planned_steps, round(planned / step_s)) if step_s > 0 else planned_steps  # what the limit leaves
    gain = planned * COMPILE_SAVING
    run = f"a run of ~{planned / 60:.0f} min (~{steps:,} steps of ~{step_s * 1e3:.0f} ms)"
    if open_ended and not time_limit_s:
        return Choice(True, f"auto: a run with no end given trains until its plateau (--patience evaluations "
                            f"past its best): minutes, long enough to repay the ~{cost:.0f} s of compiling "
                            f"{n_shapes} batch shape(s) (--compile off to skip it)")
    if gain >= 2 * cost:
        return Choice(True, f"auto: {run} saves ~{gain:.0f} s, >= 2x the ~{cost:.0f} s of compiling "
                            f"{n_shapes} batch shape(s)")
    return Choice(False, f"auto: {run} would save ~{gain:.0f} s, < 2x the ~{cost:.0f} s of compiling "
                         f"{n_shapes} batch shape(s) (--compile on to force it)")
