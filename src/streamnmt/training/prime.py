"""CUDA's lazy start-up paid beside the set-up instead of inside graph capture's warm-up.

A fresh process pays for its first training step on the host: CUDA loads each kernel's module at
its first launch (lazy loading), cuBLAS makes its handle and workspace, Triton loads the loss
kernel, autograd starts its device thread. In a 120-s run on the built-in corpus graph mode's
warm-up took 1.8 s of host time for three steps of ~16 ms on the GPU, a fifth of the run's set-up
(docs/PERFORMANCE.md, "Evaluation and checkpoints in a run"). :func:`prime` runs one training step
of a one-layer model of the run's widths, vocabularies, batch shape, precision and loss on a
thread while the main thread builds the model and its optimizer, so those loads are made once the
warm-up runs; the main thread waits for what is left of it (said in the set-up line).

What it must leave alone: the run's random numbers (dropout 0; its weights are a constant written
on the device, not drawn from the generators the run's seed set), everything the run keeps (its
model, optimizer and tensors are its own and freed when it ends), and any fork or capture (it is
joined before the loaders fork their planner and before graph capture). It never fails the run: an
error ends the priming, and the warm-up pays what is left.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import torch

from streamnmt.engine.syncstats import host_sync
from streamnmt.models.transformer import ModelShape, Transformer


class Primer:
    """One priming step on a daemon thread; :meth:`join` returns the seconds waited for it."""

    def __init__(self, target: Any):
        self.error: str | None = None
        self.took_s = 0.0

        def run() -> None:
            t0 = time.perf_counter()
            try:
                target()
            except Exception as e:  # noqa: BLE001: priming is an optimisation, the warm-up covers for it
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            self.took_s = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="streamnmt-prime", daemon=True)
        self._thread.start()

    def join(self) -> float:
        t0 = time.perf_counter()
        self._thread.join()
        return time.perf_counter() - t0


def primer_shape(shape: ModelShape) -> ModelShape:
    """One layer each side of ``shape``'s widths and vocabularies, no dropout (no random numbers)."""
    return dataclasses.replace(shape, n_layers=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def prime(shape: ModelShape, batch: Any, device: torch.device, *, attention: str, step_kwargs: dict[str, Any]) -> None:
    """One forward, backward and optimizer step of a one-layer ``shape`` model on ``batch`` (a
    batch of the run's shape, on the host), as the run's step makes them (``step_kwargs``: the
    arguments of :func:`streamnmt.training.step.make_step` less model and device)."""
    from streamnmt.training.step import make_step

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the current device is per thread
    with torch.device("meta"):  # built without drawing from the run's generators
        model = Transformer(primer_shape(shape))
    model.to_empty(device=device)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(0.02)
    model.set_attention(attention)
    step = make_step(model, device, **step_kwargs)
    loss = step.forward(batch.to(device, non_blocking=False))
    step.backward(loss)
    step.optimizer_step()
    del loss, step, model
    if device.type == "cuda":
        # Needed: the priming's kernels must have run (and failed here, if they fail) before its
        # thread ends; a host wait on this thread only, while the main thread builds the model.
        host_sync("prime", torch.cuda.current_stream(device))


def start(shape: ModelShape, batch: Any, device: torch.device, *, attention: str,
          step_kwargs: dict[str, Any]) -> Primer | None:
    """A :class:`Primer` where the run trains on a GPU, else None: the CPU loads nothing lazily, and
    under ``torch.cuda.set_sync_debug_mode`` (a hunt for hidden host syncs) a second thread's counted
    waits would switch the mode off and on beside the main thread's."""
    if device.type != "cuda" or torch.cuda.get_sync_debug_mode():
        return None
    return Primer(lambda: prime(shape, batch, device, attention=attention, step_kwargs=step_kwargs))
