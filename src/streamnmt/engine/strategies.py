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
  "backward on stream 2" moves only the gradient seed, the optimizer step and the loss push there
  (shown by the profiler in docs/PERFORMANCE.md); it is implemented as the seed describes all the
  same, with two batches copied ahead of the one computing (``DeepPipeline``).

With ``accum_steps`` K > 1 every strategy runs forward and backward on each micro-batch and the
optimizer step after every K-th (see :mod:`streamnmt.engine.base`); host waits keep counting
micro-batches.
"""

from __future__ import annotations

from collections import deque

from streamnmt.engine.base import (STRATEGIES, StepFunction, StepInfo, Strategy, begin_micro, lookahead,  # noqa: F401
                                   make_strategy, move, register, step_values, tensors)
from streamnmt.engine.config import EngineConfig
from streamnmt.errors import DeviceError


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
    """Plan 2: an event after each compute, queried without blocking; no per-batch synchronize.

    The query's answer is counted: ``not_ready`` is how often the host was ahead of the GPU when
    it looked (reported per epoch by :meth:`counters`, written into ``sync_stats.json``). A query
    that raises (a failed device) ends the run with a :class:`~streamnmt.errors.DeviceError`
    naming the batch, rather than waiting on a device that will not answer.
    """

    name, n_streams = "event", 2
    T, C = 0, 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queries = self.not_ready = 0

    def counters(self) -> dict[str, int]:
        out = {"event.queries": self.queries, "event.not_ready": self.not_ready}
        self.queries = self.not_ready = 0
        return out

    def _looked(self, ev, i: int) -> None:
        """Query ``ev`` without blocking and count a not-ready answer."""
        try:
            ready = self.sm.query(ev)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DeviceError(f"--sync-strategy event: the compute event of batch {i} could not be queried "
                              f"({first}); the device failed, so the run stops") from None
        self.queries += 1
        self.not_ready += not ready

    def _run(self, batches, step, losses, start_step):
        sm = self.sm
        ev_t, ev_c = sm.event(), sm.event()
        for i, (batch, last) in enumerate(lookahead(batches)):
            b = self._copy_in(batch, ev_t, self.T)
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            ends = self.ends_step(i, last)
            with sm.use(self.C):
                self._compute(b, step, losses, self.gstep(start_step, i), ends)
                sm.record(ev_c, self.C)
            self._looked(ev_c, i)  # non-blocking look, as the seed does
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
    """Plan 1 / stage 2: a pipeline with two batches in flight behind the one computing.

    Streams with ``--streams 4`` (the seed's layout, 000 section 3.1/7.3): 0 and 3 copy in turn
    (batch j on stream ``copy_streams[j % 2]``: while batch N computes, the copies of N+1 and N+2 are on
    streams 0 and 3), 1 runs the forward, 2 the backward. ``--streams 3`` (003 section 3.3):
    0 copies every batch, 1 forward, 2 backward.

    What waits for what, all device-side (events; the host never blocks here except every
    ``sync_interval`` batches):

    * copies: batch j goes into "slot" j % 2, the memory batch j - 2 held. Its copy waits on
      ``done[j % 2]``, recorded after batch j - 2's backward and optimizer step: the buffer it
      replaces is free. It never waits for the backward of batch j - 1, so the copy of N+1
      overlaps the compute of N. The first two copies wait for nothing;
    * forward N (stream 1) waits on ``copied[N % 2]`` (its batch is on the device) and on
      ``done[(N - 1) % 2]`` (the weights updated by step N - 1);
    * backward N (stream 2) waits on ``forward`` (recorded after forward N);
    * the host blocks on ``done[N % 2]`` every ``sync_interval`` batches and at the last.

    What actually runs on stream 2: autograd runs each backward kernel on the stream its forward
    op ran on, so the backward's kernels run on stream 1. On stream 2 run only the gradient seed,
    the optimizer step (gradient clipping, learning rate, Adam) and the loss push; ``backward()``
    makes stream 2 wait for the backward kernels on stream 1 before it returns, so ``done``
    covers them (the profile in docs/PERFORMANCE.md shows what ran where).

    Memory: a batch's device tensors are allocated on its copy stream and used on streams 1 and 2;
    ``record_stream`` keeps the allocator from reusing them before that work is done. At most
    three batches are on the device at once (computing, and two copied ahead).
    """

    name, n_streams = "deep", 4
    F, B = 1, 2  # forward, backward
    DEPTH = 2    # batches copied ahead of the one computing

    @classmethod
    def streams_for(cls, cfg: EngineConfig) -> int:
        return getattr(cfg, "streams", None) or cls.n_streams

    @property
    def copy_streams(self) -> tuple[int, int]:
        """The stream of each slot's copies: (0, 3) with 4 streams, (0, 0) with 3."""
        return (0, 3) if self.n_streams == 4 else (0, 0)

    def _run(self, batches, step, losses, start_step):
        sm, k, copy = self.sm, self.cfg.sync_interval, self.copy_streams
        copied = [sm.event() for _ in range(self.DEPTH)]  # slot's copy finished
        done = [sm.event() for _ in range(self.DEPTH)]    # slot's batch finished (backward, step)
        ev_f = sm.event()
        it = lookahead(batches)
        flight: deque = deque()  # (host batch, is_last, device batch), copies issued, oldest first
        for j in range(self.DEPTH):  # the first copies: their slots are empty, nothing to wait for
            if (nxt := next(it, None)) is None:
                break
            flight.append((*nxt, self._copy_in(nxt[0], copied[j], copy[j])))
        i = 0
        while flight:
            batch, last, b = flight.popleft()
            s = i % 2
            sm.wait(copied[s], self.F)  # forward N waits for its copy
            sm.guard(tensors(b), self.F)
            sm.guard(tensors(b), self.B)
            ends, gstep = self.ends_step(i, last), self.gstep(start_step, i)
            with sm.use(self.F):
                begin_micro(step, ends)
                loss = step.forward(b)
                sm.record(ev_f, self.F)
            sm.wait(ev_f, self.B)  # backward N waits for forward N
            with sm.use(self.B):
                step.backward(loss)  # kernels run on F (autograd keeps the forward stream)
                if ends:
                    step.optimizer_step()
                losses.push(gstep, loss, **step_values(step))
                sm.record(done[s], self.B)
            sm.wait(done[s], self.F)  # forward N+1 must see the updated weights
            del b, loss
            if (nxt := next(it, None)) is not None:  # batch N+2 into N's slot, once N is done with it
                sm.wait(done[s], copy[s])
                flight.append((*nxt, self._copy_in(nxt[0], copied[s], copy[s])))
            if (i + 1) % k == 0 or last:
                # Bound how far the host runs ahead of the GPU (seed: every SYNC_INTERVAL batches).
                sm.block(done[s], f"{self.name}.backward")
            yield StepInfo(i, gstep, batch, ends)
            i += 1


class FullPipeline(DeepPipeline):
    """Plan 4: the deep pipeline (same streams, events and host waits; ``--streams 3|4`` alike) fed
    by worker-process loading, so that the host batches N+1 and N+2 are being read and collated
    while the GPU computes N."""

    name = "full"
    wants_workers = True


for _cls in (Baseline, EventSync, IntervalSync, DeepPipeline, FullPipeline):
    register(_cls)
