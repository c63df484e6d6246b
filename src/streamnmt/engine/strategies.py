"""The seed design's synchronisation strategies, one small class each behind one interface.

A strategy drives a :class:`StepFunction` (forward, backward, optimizer step: supplied by the
application, which may be any PyTorch model) over an iterable of host batches on a device. It
decides on which streams the transfer and the compute run, how streams are ordered (events, device
side) and when the host blocks (counted through ``host_sync``). ``run`` is a generator that yields
once per batch, so the caller keeps the loop: progress, loss polling, ``max_steps``, signals.

All strategies issue the same kernels in the same order on the data, so their results are equal;
only where and when the host waits differs. Stream rules followed everywhere:
* a tensor made on one stream and used on another: the consumer waits on an event recorded after
  the producer's work, and ``record_stream`` tells the allocator about the use;
* host batches come pinned from the loader's pinning thread; PyTorch's pinned-memory allocator
  records the stream of each ``non_blocking`` copy out of a block and does not hand that block out
  again before the copy has completed, so a pinned buffer is never rewritten under a copy;
* autograd runs each backward kernel on the stream of its forward op, so the ``deep`` strategy's
  "backward on stream 2" moves only the gradient seed and the optimizer step there (shown by the
  profiler in docs/PERFORMANCE.md); it is implemented as the seed describes all the same.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch

from streamnmt.engine.config import EngineConfig
from streamnmt.engine.losses import DeferredLosses
from streamnmt.engine.streams import StreamManager


class StepFunction(Protocol):
    """What the application supplies: one training step split in its three phases."""

    def forward(self, batch: Any) -> torch.Tensor: ...   # device scalar loss, graph attached
    def backward(self, loss: torch.Tensor) -> None: ...
    def optimizer_step(self) -> None: ...


@dataclass
class StepInfo:
    index: int   # batch index within this run
    step: int    # global optimizer step (1-based) whose loss was pushed
    batch: Any   # the host batch (for token counts); never touched on the device


def move(obj: Any, device: torch.device) -> Any:
    """Copy a batch to ``device`` without blocking (tensors, tuples/lists/dicts, or ``.to``)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(move(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    return obj.to(device, non_blocking=True)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a batch, for ``record_stream``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors(x)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from tensors(getattr(obj, f.name))


def lookahead(items: Iterable) -> Iterator[tuple[Any, bool]]:
    """Yield (item, is_last)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


class Strategy:
    name: ClassVar[str]
    n_streams: ClassVar[int]
    wants_workers: ClassVar[bool] = False  # full: loading in worker processes is part of the plan

    def __init__(self, device: torch.device | str, cfg: EngineConfig, log: Callable[[str], None] = print):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Streams, events and graph captures made without a device argument use the current one.
            torch.cuda.set_device(self.device)
        self.cfg = cfg
        self.log = log
        self.sm = StreamManager(self.device, self.n_streams)  # created once per trainer
        self.report: dict[str, Any] = {}

    def prepare(self, step: StepFunction, examples: Iterable[Any]) -> None:
        """Set-up before training, given one example host batch per batch shape (graph capture)."""

    def run(self, batches: Iterable, step: StepFunction, losses: DeferredLosses,
            start_step: int = 0) -> Iterator[StepInfo]:
        """Drive ``step`` over ``batches``; yields once per batch. The caller's earlier work on the
        current stream is ordered before the run, and its later work after it (device-side)."""
        self.sm.fork()
        try:
            yield from self._run(batches, step, losses, start_step)
        finally:
            self.sm.join()

    def _run(self, batches: Iterable, step: StepFunction, losses: DeferredLosses,
             start_step: int) -> Iterator[StepInfo]:
        raise NotImplementedError

    def drain(self, site: str) -> None:
        """Block until all work this strategy queued is done (epoch end, before a save)."""
        self.sm.drain(site)

    def _copy_in(self, host_batch: Any, event, i: int) -> Any:
        """Start the host->device copy of a batch on stream ``i``; ``event`` completes with it."""
        with self.sm.use(i):
            b = move(host_batch, self.device)
            self.sm.record(event, i)
        return b

    def _compute(self, b: Any, step: StepFunction, losses: DeferredLosses, gstep: int) -> torch.Tensor:
        loss = step.forward(b)
        step.backward(loss)
        step.optimizer_step()
        losses.push(gstep, loss)
        return loss


class Baseline(Strategy):
    """The original loop: 2 streams; the host synchronises at every batch."""

    name, n_streams = "baseline", 2
    T, C = 0, 1  # transfer, compute

    def _run(self, batches, step, losses, start_step):
        sm, ev_t = self.sm, self.sm.event()
        for i, batch in enumerate(batches):
            b = self._copy_in(batch, ev_t, self.T)
            if i == 0:
                # Seed design: the first batch waits for its transfer on the host.
                sm.synchronize(self.T, "baseline.transfer")
            else:
                # Seed design: every later batch waits on the host for the previous compute.
                sm.synchronize(self.C, "baseline.compute")
            # The seed relied on the host syncs above for ordering; the transfer of this batch is
            # not covered by them after batch 0, so order it on the device as well.
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            with sm.use(self.C):
                self._compute(b, step, losses, start_step + i + 1)
            yield StepInfo(i, start_step + i + 1, batch)


class EventSync(Strategy):
    """Plan 2: an event after each compute, queried without blocking; no per-batch synchronize."""

    name, n_streams = "event", 2
    T, C = 0, 1

    def _run(self, batches, step, losses, start_step):
        sm = self.sm
        ev_t, ev_c = sm.event(), sm.event()
        self.not_ready = 0  # how often the host was ahead of the GPU when it looked
        for i, batch in enumerate(batches):
            b = self._copy_in(batch, ev_t, self.T)
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            with sm.use(self.C):
                self._compute(b, step, losses, start_step + i + 1)
                sm.record(ev_c, self.C)
            self.not_ready += not sm.query(ev_c)  # non-blocking look, as the seed does
            yield StepInfo(i, start_step + i + 1, batch)


class IntervalSync(Strategy):
    """Plan 3: events as plan 2; the host blocks only every ``sync_interval`` batches and at the last."""

    name, n_streams = "interval", 2
    T, C = 0, 1

    def _run(self, batches, step, losses, start_step):
        sm, k = self.sm, self.cfg.sync_interval
        ev_t = sm.event()
        ring = [sm.event() for _ in range(k + 1)]  # compute events, reused round-robin
        queue: deque = deque()                     # recorded, not yet waited on
        for i, (batch, last) in enumerate(lookahead(batches)):
            b = self._copy_in(batch, ev_t, self.T)
            if i == 0:
                # Seed design (kept from the baseline): the first batch waits for its transfer.
                sm.synchronize(self.T, "interval.transfer")
            elif (i + 1) % k == 0 or last:
                # Seed design: bound how far the host runs ahead; one wait covers the whole queue
                # (events on one stream complete in order), so only the newest is waited on.
                sm.block(queue[-1], "interval.compute")
                queue.clear()
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            with sm.use(self.C):
                self._compute(b, step, losses, start_step + i + 1)
                ev = ring[i % len(ring)]
                sm.record(ev, self.C)
                queue.append(ev)
            yield StepInfo(i, start_step + i + 1, batch)


class DeepPipeline(Strategy):
    """Plan 1 / stage 2: 4 streams: transfer N (0), forward N (1), backward N (2), transfer N+1 (3)."""

    name, n_streams = "deep", 4
    T0, F, B, T1 = 0, 1, 2, 3
    prefetch_early: ClassVar[bool] = False  # full: issue the next transfer before this compute

    def _run(self, batches, step, losses, start_step):
        sm, k = self.sm, self.cfg.sync_interval
        ev_t, ev_f, ev_b = sm.event(), sm.event(), sm.event()
        it = lookahead(batches)
        nxt = next(it, None)
        if nxt is None:
            return
        b_next = self._copy_in(nxt[0], ev_t, self.T0)  # stream 0: the first transfer
        i = 0
        while nxt is not None:
            batch, last = nxt
            b = b_next
            sm.wait(ev_t, self.F)  # forward N waits transfer N
            sm.guard(tensors(b), self.F)
            sm.guard(tensors(b), self.B)
            nxt = None if last else next(it)
            if self.prefetch_early and nxt is not None:
                b_next = self._copy_in(nxt[0], ev_t, self.T1)  # overlaps this batch's compute
            with sm.use(self.F):
                loss = step.forward(b)
                sm.record(ev_f, self.F)
            sm.wait(ev_f, self.B)  # backward N waits forward N
            with sm.use(self.B):
                step.backward(loss)  # kernels run on F (autograd keeps the forward stream)
                step.optimizer_step()
                losses.push(start_step + i + 1, loss)
                sm.record(ev_b, self.B)
            sm.wait(ev_b, self.F)  # forward N+1 must see the updated weights
            if not self.prefetch_early and nxt is not None:
                sm.wait(ev_b, self.T1)  # seed design: transfer N+1 after backward N released memory
                b_next = self._copy_in(nxt[0], ev_t, self.T1)
            if (i + 1) % k == 0 or last:
                # Bound how far the host runs ahead of the GPU (seed: every SYNC_INTERVAL batches).
                sm.block(ev_b, f"{self.name}.backward")
            yield StepInfo(i, start_step + i + 1, batch)
            i += 1


class FullPipeline(DeepPipeline):
    """Plan 4: deep + worker-process loading + the next batch copied while this one computes."""

    name = "full"
    wants_workers = True
    prefetch_early = True


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Baseline, EventSync, IntervalSync, DeepPipeline, FullPipeline)}


def make_strategy(name: str, device: torch.device | str, cfg: EngineConfig,
                  log: Callable[[str], None] = print) -> Strategy:
    if name == "graph":
        from streamnmt.engine.graphs import GraphStrategy  # registers itself
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](device, cfg, log=log)
