"""Exponential moving average of the weights, kept on the device and updated inside the step.

Averaging the weights over the last few thousand updates gives a model that usually translates a
little better than the last raw weights (``--ema 0.9999``). The average must cost no host sync and
must live inside graph mode's captured step, so it is a list of device tensors beside the
parameters, updated with ``torch._foreach_*`` kernels whose decay is computed on the device from
the schedule's step counter: ``decay_n = min(decay, (1 + n) / (10 + n))`` (the usual warm-up, so
that early averages are not dominated by the random initialisation), then
``shadow += (1 - decay_n) * (param - shadow)`` (``lerp_``). With ``every`` N > 1 (``--ema-every``) the
average is updated after the first optimizer step, then after every N-th only, with the decay
compounded over the N steps (``1 - decay_n ** N``), so that it spans as many steps as an average updated at every step; fairseq's
``--ema-update-freq`` also skips steps. At vocabulary 32k an update costs about a tenth of the base
model's step (docs/PERFORMANCE.md, "The weights' moving average"). Graph mode captures the step with
and without the update and replays the one due. :meth:`EMA.swapped` puts the averaged weights
into the model for evaluation and restores the trained ones afterwards, in place (graph mode's
captured kernels keep their addresses).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from streamnmt.engine import host_sync


class EMA:
    """Shadow copies of ``params`` (one per parameter; a tied tensor is listed once)."""

    def __init__(self, params: list[torch.Tensor], decay: float, step_t: torch.Tensor, every: int = 1):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1); got {decay}")
        if every < 1:
            raise ValueError(f"EMA update interval must be at least 1; got {every}")
        self.params, self.decay, self.step_t, self.every = params, decay, step_t, every
        self.shadow = [p.detach().clone() for p in params]

    def due(self, updates: int) -> bool:
        """Whether the optimizer step that follows ``updates`` earlier ones updates the average: the
        first, then every ``every``-th (steps 1, 1 + every, ...), so that an evaluation after the first
        step already sees trained weights in the average."""
        return updates % self.every == 0

    @torch.no_grad()
    def update(self) -> None:
        """One update after an optimizer step; device kernels only (graph-capturable)."""
        n = self.step_t  # optimizer steps so far, a device scalar
        decay_n = torch.clamp((1.0 + n) / (10.0 + n), max=self.decay)
        # every ``every`` steps: the decay of the steps since the last update, compounded
        weight = 1.0 - (decay_n if self.every == 1 else decay_n ** self.every)  # () = 1 - decay_n^every
        # One pass per tensor (read both, write the average): a third of the memory traffic of the
        # foreach subtract, scale and add (which take the device weight but run three passes); at
        # vocabulary 32k the average covers 93M parameters (docs/PERFORMANCE.md, "The weights'
        # moving average"). The weight is a device scalar: no host sync, and graph replays see it change.
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p, weight)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": [t.detach() for t in self.shadow]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy saved averages in place (their addresses may be held by captured graphs)."""
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError("the saved EMA does not match this model's parameters")
        for dst, src in zip(self.shadow, shadow):
            dst.copy_(src)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """The averaged weights in the model for the body of the ``with``; the trained ones after."""
        backup = [p.detach().clone() for p in self.params]
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)
        try:
            yield
        finally:
            for p, b in zip(self.params, backup):
                p.copy_(b)
            if self.params[0].is_cuda:
                # Needed: training continues on other streams, which must read the restored weights.
                host_sync("ema.restore", torch.cuda.current_stream(self.params[0].device))
