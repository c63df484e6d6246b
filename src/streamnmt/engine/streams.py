"""StreamManager: a fixed set of CUDA streams and the event operations the strategies use.

The seed design's ``CudaStreamManager`` in Python. Streams are created once per trainer and
reused across epochs (the caching allocator keeps a pool per stream, so creating streams per epoch
fragments memory). On a CPU device the same API works and does nothing: ``use`` is a null
context, events are always complete, and waits are free, so training code runs unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from streamnmt.syncstats import host_sync

MAX_STREAMS = 8


class _NullEvent:
    """Event stand-in on CPU: work is synchronous there, so it is always complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StreamManager:
    """``n`` streams on ``device``, addressed by index 0..n-1."""

    def __init__(self, device: torch.device | str, n: int):
        if not 1 <= n <= MAX_STREAMS:
            raise ValueError(f"StreamManager: {n} streams requested; allowed 1 to {MAX_STREAMS} "
                             "(each stream gets its own allocator pool, and more streams than "
                             "independent work only fragment memory)")
        self.device = torch.device(device)
        self.n = n
        self.cuda = self.device.type == "cuda"
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(n)] if self.cuda else []

    def stream(self, i: int) -> torch.cuda.Stream | None:
        return self.streams[i] if self.cuda else None

    def use(self, i: int) -> contextlib.AbstractContextManager:
        """Make stream ``i`` current for the block (kernels launched inside run on it)."""
        return torch.cuda.stream(self.streams[i]) if self.cuda else contextlib.nullcontext()

    def event(self) -> torch.cuda.Event | _NullEvent:
        return torch.cuda.Event() if self.cuda else _NullEvent()

    def record(self, event, i: int) -> None:
        """Record ``event`` on stream ``i``: it completes when the work queued so far does."""
        if self.cuda:
            event.record(self.streams[i])

    def query(self, event) -> bool:
        """Non-blocking: has the work before ``event`` finished?"""
        return event.query()

    def wait(self, event, i: int) -> None:
        """Device-side wait: stream ``i`` runs later work only after ``event``. The host does not block."""
        if self.cuda:
            self.streams[i].wait_event(event)

    def wait_stream(self, i: int, j: int) -> None:
        """Device-side wait: stream ``i`` waits for the work queued so far on stream ``j``."""
        if self.cuda:
            self.streams[i].wait_stream(self.streams[j])

    def synchronize(self, i: int, site: str) -> None:
        """Host blocks until stream ``i`` is idle (counted under ``site``)."""
        if self.cuda:
            host_sync(site, self.streams[i])

    def fork(self) -> None:
        """Every stream waits for the work queued so far on the current stream (model set-up,
        optimizer state, buffers made by the caller): device-side, at the start of a run."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams:
                s.wait_stream(cur)

    def join(self) -> None:
        """The current stream waits for all of ours (device-side): the caller's later work
        (evaluation, checkpoints) is ordered after the run's."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            for s in self.streams:
                cur.wait_stream(s)

    def block(self, event, site: str) -> None:
        """Host blocks until ``event`` has completed (counted under ``site``); free on CPU."""
        if self.cuda:
            host_sync(site, event)

    def guard(self, tensors: Iterator[torch.Tensor], i: int) -> None:
        """Tell the allocator these tensors are used on stream ``i`` (``record_stream``), so their
        memory is not handed out again until the work queued there has finished."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.streams[i])

    def drain(self, site: str) -> None:
        """Host blocks until every stream of this manager is idle (end of epoch, before a save)."""
        for i in range(self.n):
            self.synchronize(i, site)
