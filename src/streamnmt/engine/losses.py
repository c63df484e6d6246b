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

``extras``: further per-step device values read with the losses (the trainer's gradient norm and
skipped flag): at each push their current values are copied into the step's column of the same
buffer (the last push of a step wins), so they travel in the same copy and cost no extra sync.
They are not reduced across ranks (they are equal on every rank). ``wait``: how :meth:`flush`
blocks on a copy's event (default ``event.synchronize()``; with replayed collectives a polling
wait with a deadline).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamnmt.engine.syncstats import host_sync


@dataclass
class _Pending:
    steps: list[int]
    host: torch.Tensor  # pinned (1 + extras, interval) float32, filled by a non_blocking copy
    event: object       # completes when the copy into ``host`` has


class DeferredLosses:
    def __init__(self, device: torch.device | str, interval: int = 10, *, group: int = 1,
                 reduce: Callable[[torch.Tensor], None] | None = None, extras: torch.Tensor | None = None,
                 wait: Callable[[object], None] | None = None):
        """``group``: pushes per step (accumulation micro-batches); a full buffer is extracted
        after the last push of its last step. ``reduce``: in-place cross-rank sum of a slice.
        ``extras``: a device vector whose values at each push are kept with the step (see above)."""
        if interval < 1:
            raise ValueError(f"loss interval must be at least 1; got {interval}")
        self.group, self.reduce, self.extras, self.wait = group, reduce, extras, wait
        self.extra: dict[int, list[float]] = {}  # step -> its extras, for the steps poll/flush returned
        self._pushes = 0  # pushes into the newest slot
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.interval = interval
        n_extra = 0 if extras is None else extras.numel()
        # Row 0: the losses (contiguous, for the all-reduce); rows 1..: the extras, one column per step.
        self.table = torch.zeros(1 + n_extra, interval, dtype=torch.float32, device=self.device)
        self.buf = self.table[0]
        self.steps: list[int] = []              # steps whose losses sit in ``buf``
        self.pending: deque[_Pending] = deque()  # copies in flight, oldest first
        self.free_host: list[torch.Tensor] = []  # pinned buffers whose copy has been read

    def push(self, step: int, loss: torch.Tensor) -> None:
        """Queue ``loss`` (a device scalar) of ``step``; a repeated ``step`` adds to its slot.
        Call on the stream that produced it."""
        if self.steps and self.steps[-1] == step:
            self.buf[len(self.steps) - 1].add_(loss.detach())
            self._pushes += 1
        else:
            if len(self.steps) == self.interval:  # a step of fewer than ``group`` pushes came before
                self._extract()
            self.buf[len(self.steps)].copy_(loss.detach())
            self.steps.append(step)
            self._pushes = 1
        if self.extras is not None:
            self.table[1:, len(self.steps) - 1].copy_(self.extras)
        if len(self.steps) == self.interval and self._pushes >= self.group:
            self._extract()

    def _extract(self) -> None:
        n = len(self.steps)
        if n == 0:
            return
        if self.reduce is not None:
            self.reduce(self.buf[:n])  # every rank extracts at the same steps: one collective each
        if not self.cuda:
            self.pending.append(_Pending(self.steps, self.table[:, :n].clone(), None))
        else:
            # A pinned buffer is reused only after the copy into it completed and was read
            # (it returns to ``free_host`` in ``_take``), so no copy ever overwrites unread values.
            host = self.free_host.pop() if self.free_host else torch.empty(
                self.table.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(self.table, non_blocking=True)  # whole (contiguous) table: a few floats; [:, :n] is read
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))  # right after the copy
            self.pending.append(_Pending(self.steps, host, event))
            # ``buf`` is overwritten by later pushes on the same stream, i.e. after this copy.
        self.steps = []

    def _take(self, p: _Pending) -> list[tuple[int, float]]:
        rows = p.host[:, :len(p.steps)].tolist()  # host memory: no device sync
        if self.cuda:
            self.free_host.append(p.host)
        if self.extras is not None:
            self.extra.update(zip(p.steps, (list(col) for col in zip(*rows[1:]))))
        return list(zip(p.steps, rows[0]))

    def poll(self) -> list[tuple[int, float]]:
        """(step, loss) pairs whose copies have completed; never blocks."""
        out: list[tuple[int, float]] = []
        while self.pending and (self.pending[0].event is None or self.pending[0].event.query()):
            out += self._take(self.pending.popleft())
        return out

    def flush(self, site: str = "losses.flush") -> list[tuple[int, float]]:
        """Extract what is left and wait for every copy in flight; returns all remaining pairs."""
        self._extract()
        out: list[tuple[int, float]] = []
        while self.pending:
            p = self.pending.popleft()
            if p.event is not None:
                # Needed: the caller (epoch end, checkpoint, exit) must have every loss now.
                host_sync(site, p.event if self.wait is None else lambda ev=p.event: self.wait(ev))
            out += self._take(p)
        return out
