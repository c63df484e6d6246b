"""Deferred loss extraction: per-step losses stay on the device until a batch of them is read.

Reading a loss with ``.item()`` blocks the host until the step that produced it has finished,
which drains the launch queue every step. Here each step's loss is copied (device-side) into a
slot of a device buffer; every ``interval`` steps the filled slots are copied in one
``non_blocking`` transfer to a pinned host buffer and an event is recorded after the copy. The
host reads those values only once the event has completed: :meth:`poll` never blocks, and
:meth:`flush` (epoch end, before a checkpoint) blocks once, counted, for what is still in flight.

Every pushed step comes out exactly once, in push order. Consecutive pushes for the same step
(the micro-batches of one optimizer step under gradient accumulation) are added into its slot.
With several ranks, ``reduce`` (an in-place all-reduce sum across ranks) runs on the filled slots
once per extraction, on the device, just before the copy: never once per step.

Besides the loss, a step may push further named device scalars (``values``: e.g. the plain NLL
beside a smoothed loss); they travel in the same buffer (one column each), the same copy and the
same event, and come out as ``.values`` of the step's (step, loss) pair.

``extras``: further named device scalars read with the losses but not summed (the trainer's
gradient norm and skipped flag, written by each optimizer step): at each push their current values
are copied into the step's row (the last push of a step wins). They are not reduced across ranks
(they are equal on every rank). ``wait``: how :meth:`flush` blocks on a copy's event (default
``event.synchronize()``; with replayed collectives a polling wait with a deadline).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamnmt.syncstats import host_sync


@dataclass
class _Pending:
    steps: list[int]
    host: torch.Tensor  # pinned (interval, 1 + values + extras) float32, filled by a non_blocking copy
    event: object       # completes when the copy into ``host`` has


class StepLoss(tuple):
    """A (step, loss) pair -- it unpacks and compares as one -- that also carries every named value
    of its step in ``values`` ({name: float}, the loss included)."""

    values: dict[str, float]

    def __new__(cls, step: int, values: dict[str, float]) -> StepLoss:
        self = super().__new__(cls, (step, values["loss"]))
        self.values = values
        return self


class DeferredLosses:
    def __init__(self, device: torch.device | str, interval: int = 10, *, group: int = 1,
                 reduce: Callable[[torch.Tensor], None] | None = None, values: tuple[str, ...] = (),
                 extras: dict[str, torch.Tensor] | None = None, wait: Callable[[object], None] | None = None):
        """``group``: pushes per step (accumulation micro-batches); a full buffer is extracted
        after the last push of its last step. ``reduce``: in-place cross-rank sum of a slice.
        ``values``: names of the further device scalars a push may carry (summed like the loss).
        ``extras``: named device scalars copied at each push, not summed (see above)."""
        if interval < 1:
            raise ValueError(f"loss interval must be at least 1; got {interval}")
        self.extras = dict(extras or {})
        names = ("loss", *values, *self.extras)
        if len(set(names)) != len(names):
            raise ValueError(f"named values must be distinct and not 'loss'; got {names[1:]}")
        self.names, self.summed = names, 1 + len(values)  # columns [0, summed) add up and are reduced
        self.group, self.reduce, self.wait = group, reduce, wait
        self._pushes = 0  # pushes into the newest slot
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.interval = interval
        self.buf = torch.zeros(interval, len(self.names), dtype=torch.float32, device=self.device)
        self.steps: list[int] = []              # steps whose losses sit in ``buf``
        self.pending: deque[_Pending] = deque()  # copies in flight, oldest first
        self.free_host: list[torch.Tensor] = []  # pinned buffers whose copy has been read

    def push(self, step: int, loss: torch.Tensor, **values: torch.Tensor) -> None:
        """Queue ``loss`` (a device scalar) of ``step`` and its named ``values`` (device scalars); a
        repeated ``step`` adds to its slot. The buffer keeps the names given to its constructor (one
        left out counts 0) and no others: a step may offer more than its caller reads. Call on the
        stream that produced them."""
        if self.steps and self.steps[-1] == step:
            row = self.buf[len(self.steps) - 1]
            self._pushes += 1
        else:
            if len(self.steps) == self.interval:  # a step of fewer than ``group`` pushes came before
                self._extract()
            row = self.buf[len(self.steps)]
            row.zero_()
            self.steps.append(step)
            self._pushes = 1
        row[0].add_(loss.detach())
        for j, name in enumerate(self.names[1:self.summed], 1):
            if name in values:
                row[j].add_(values[name].detach())
        for j, t in enumerate(self.extras.values(), self.summed):
            row[j].copy_(t.detach())
        if len(self.steps) == self.interval and self._pushes >= self.group:
            self._extract()

    def _extract(self) -> None:
        n = len(self.steps)
        if n == 0:
            return
        if self.reduce is not None:  # every rank extracts at the same steps: one collective each
            if self.summed == len(self.names):
                self.reduce(self.buf[:n])
            else:  # the summed columns only (the extras are equal on every rank)
                part = self.buf[:n, :self.summed].contiguous()
                self.reduce(part)
                self.buf[:n, :self.summed].copy_(part)
        if not self.cuda:
            self.pending.append(_Pending(self.steps, self.buf[:n].clone(), None))
        else:
            # A pinned buffer is reused only after the copy into it completed and was read
            # (it returns to ``free_host`` in ``_take``), so no copy ever overwrites unread values.
            host = self.free_host.pop() if self.free_host else torch.empty(
                self.interval, len(self.names), dtype=torch.float32, pin_memory=True)
            host[:n].copy_(self.buf[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # right after the copy
            self.pending.append(_Pending(self.steps, host, event))
            # ``buf`` is overwritten by later pushes on the same stream, i.e. after this copy.
        self.steps = []

    def _take(self, p: _Pending) -> list[StepLoss]:
        rows = p.host[:len(p.steps)].tolist()  # host memory: no device sync
        if self.cuda:
            self.free_host.append(p.host)
        return [StepLoss(step, dict(zip(self.names, row))) for step, row in zip(p.steps, rows)]

    def poll(self) -> list[StepLoss]:
        """(step, loss) pairs whose copies have completed; never blocks."""
        out: list[StepLoss] = []
        while self.pending and (self.pending[0].event is None or self.pending[0].event.query()):
            out += self._take(self.pending.popleft())
        return out

    def flush(self, site: str = "losses.flush") -> list[StepLoss]:
        """Extract what is left and wait for every copy in flight; returns all remaining pairs."""
        self._extract()
        out: list[StepLoss] = []
        while self.pending:
            p = self.pending.popleft()
            if p.event is not None:
                # Needed: the caller (epoch end, checkpoint, exit) must have every loss now.
                host_sync(site, p.event if self.wait is None else lambda ev=p.event: self.wait(ev))
            out += self._take(p)
        return out
