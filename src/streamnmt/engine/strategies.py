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

With ``accum_steps`` K > 1 every strategy runs forward and backward on each micro-batch and the
optimizer step after every K-th (see :mod:`streamnmt.engine.base`); host waits keep counting
micro-batches.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from streamnmt.engine.base import (STRATEGIES, StepFunction, StepInfo, Strategy, begin_micro, lookahead,  # noqa: F401
                                   make_strategy, move, register, step_values, tensors)


class Baseline(Strategy):
    """The original loop: 2 streams; the host synchronises at every batch."""

    name, n_streams = "baseline", 2
    T, C = 0, 1  # transfer, compute

    def _run(self, batches, step, losses, start_step):
        sm, ev_t = self.sm, self.sm.event()
        for i, (batch, last) in enumerate(lookahead(batches)):
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
                self._compute(b, step, losses, self.gstep(start_step, i), self.ends_step(i, last))
            yield StepInfo(i, self.gstep(start_step, i), batch, self.ends_step(i, last))


class EventSync(Strategy):
    """Plan 2: an event after each compute, queried without blocking; no per-batch synchronize."""

    name, n_streams = "event", 2
    T, C = 0, 1

    def _run(self, batches, step, losses, start_step):
        sm = self.sm
        ev_t, ev_c = sm.event(), sm.event()
        self.not_ready = 0  # how often the host was ahead of the GPU when it looked
        for i, (batch, last) in enumerate(lookahead(batches)):
            b = self._copy_in(batch, ev_t, self.T)
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            ends = self.ends_step(i, last)
            with sm.use(self.C):
                self._compute(b, step, losses, self.gstep(start_step, i), ends)
                sm.record(ev_c, self.C)
            self.not_ready += not sm.query(ev_c)  # non-blocking look, as the seed does
            yield StepInfo(i, self.gstep(start_step, i), batch, ends)


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
            ends = self.ends_step(i, last)
            with sm.use(self.C):
                self._compute(b, step, losses, self.gstep(start_step, i), ends)
                ev = ring[i % len(ring)]
                sm.record(ev, self.C)
                queue.append(ev)
            yield StepInfo(i, self.gstep(start_step, i), batch, ends)


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
            ends, gstep = self.ends_step(i, last), self.gstep(start_step, i)
            with sm.use(self.F):
                begin_micro(step, ends)
                loss = step.forward(b)
                sm.record(ev_f, self.F)
            sm.wait(ev_f, self.B)  # backward N waits forward N
            with sm.use(self.B):
                step.backward(loss)  # kernels run on F (autograd keeps the forward stream)
                if ends:
                    step.optimizer_step()
                losses.push(gstep, loss, **step_values(step))
                sm.record(ev_b, self.B)
            sm.wait(ev_b, self.F)  # forward N+1 must see the updated weights
            if not self.prefetch_early and nxt is not None:
                sm.wait(ev_b, self.T1)  # seed design: transfer N+1 after backward N released memory
                b_next = self._copy_in(nxt[0], ev_t, self.T1)
            if (i + 1) % k == 0 or last:
                # Bound how far the host runs ahead of the GPU (seed: every SYNC_INTERVAL batches).
                sm.block(ev_b, f"{self.name}.backward")
            yield StepInfo(i, gstep, batch, ends)
            i += 1


class FullPipeline(DeepPipeline):
    """Plan 4: deep + worker-process loading + the next batch copied while this one computes."""

    name = "full"
    wants_workers = True
    prefetch_early = True


for _cls in (Baseline, EventSync, IntervalSync, DeepPipeline, FullPipeline):
    register(_cls)
