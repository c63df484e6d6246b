"""``--sync-strategy auto`` and ``--compile auto``: the fastest mode a device supports, chosen once.

Measured on an H100 (docs/PERFORMANCE.md): graph mode runs the base model 8x faster than any eager
strategy at small batches and is never slower, so ``auto`` is ``graph`` on CUDA (graph mode still
falls back to ``full`` by itself, in one line, where capture fails) and ``full`` on a CPU, where
there is nothing to capture.

Compiling pays only when the steps it saves outweigh the time it costs. torch.compile traces and
tunes the step once per batch shape (``COMPILE_S_PER_SHAPE``, measured) and then saves a share of
each step (``COMPILE_SAVING``, measured at the smallest shape, where it is lowest). ``auto``
compiles when ``planned steps x saving x step time >= 2 x compile time``, with the step time of
graph mode estimated from the measured ``GRAPH_MS_PER_STEP``; i.e. when the run is long enough to
win the compile time back twice. Only graph mode is considered: compiled eager steps are still
bound by kernel launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Measured on the H100, base model, bf16, 32 x 32 batches (docs/PERFORMANCE.md, section 4): compiling
# forward + backward for one batch shape took 42-52 s (cold cache); graph mode ran 6.23 ms/step
# uncompiled and 4.72 ms compiled (a 24 % saving; more at larger shapes).
COMPILE_S_PER_SHAPE = 45.0
COMPILE_SAVING = 0.25
GRAPH_MS_PER_STEP = 6.0


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
                   n_shapes: int) -> Choice:
    """Whether to torch.compile the model (``on``/``off`` kept; ``auto`` by the rule above)."""
    if requested in ("on", "off"):
        return Choice(requested == "on", "as requested")
    if device.type != "cuda" or strategy != "graph":
        return Choice(False, "auto: compiling pays only inside graph mode on CUDA")
    cost = COMPILE_S_PER_SHAPE * max(n_shapes, 1)
    gain = planned_steps * COMPILE_SAVING * GRAPH_MS_PER_STEP / 1e3
    if gain >= 2 * cost:
        return Choice(True, f"auto: {planned_steps} steps save ~{gain:.0f} s, >= 2x the ~{cost:.0f} s "
                            f"of compiling {n_shapes} batch shape(s)")
    return Choice(False, f"auto: {planned_steps} steps would save ~{gain:.0f} s, < 2x the ~{cost:.0f} s of "
                         f"compiling {n_shapes} batch shape(s) (--compile on to force it)")
