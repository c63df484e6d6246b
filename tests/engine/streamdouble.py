"""A test double of :class:`streamnmt.engine.StreamManager` that runs on the CPU and records.

On a CPU device the real manager does nothing: streams are null contexts, waits are free and
host waits are not counted, so a CPU test cannot see a strategy's schedule. This double keeps the
same API and logs, in order, every stream use, event record, device-side wait and host sync, and
counts the host syncs through ``host_sync`` (so ``STATS`` sees them as on CUDA). The work itself
runs on the CPU as usual, so results stay those of the real run.

Events are named after the work they complete: recording an event on stream ``i`` labels it
with the last phase logged on stream ``i`` (``("copy", 3)``: it completes when batch 3's copy has).
A wait is logged with that label, so a test reads "forward 5 waited for copy 5 and push 4".

Phases are logged by the test's batches and step function through :meth:`phase`, with the stream
that is current at that moment: ``("copy", j)`` when batch ``j`` is moved to the device,
``("forward", j)``, ``("backward", j)``, ``("optimizer", j)``, ``("push", j)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from streamnmt.syncstats import host_sync

Label = tuple


@dataclass
class FakeEvent:
    id: int
    label: Label | None = None  # what it completes after; None: never recorded
    records: int = 0


@dataclass
class Op:
    kind: str        # phase, record, wait, wait_stream, sync, query, guard, use
    stream: int | None
    what: Any = None  # phase label, event label, site ...

    def __repr__(self) -> str:
        return f"{self.kind}@{self.stream}:{self.what}"


@dataclass
class RecordingStreamManager:
    """Same interface as ``StreamManager``; ``answer(event) -> bool`` decides what ``query`` says
    (it may raise, as a failed device's query does); by default every event is complete."""

    device: torch.device
    n: int
    answer: Callable[[FakeEvent], bool] = lambda ev: True
    ops: list[Op] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)
    current: int | None = None  # the stream made current by ``use``; None: the caller's stream
    last: dict[int | None, Label] = field(default_factory=dict)  # stream -> its last phase

    cuda = False

    # -- what the test's step function and batches call ------------------------------------------
    def phase(self, name: str, index: int) -> None:
        self.ops.append(Op("phase", self.current, (name, index)))
        self.last[self.current] = (name, index)

    # -- the StreamManager API ---------------------------------------------------------------------
    def _check(self, i: int) -> None:
        assert 0 <= i < self.n, f"stream {i} used; the manager has {self.n}"

    def stream(self, i: int) -> None:
        self._check(i)
        return None

    @contextlib.contextmanager
    def use(self, i: int) -> Iterator[None]:
        self._check(i)
        outer, self.current = self.current, i
        self.ops.append(Op("use", i))
        try:
            yield
        finally:
            self.current = outer

    def event(self) -> FakeEvent:
        ev = FakeEvent(len(self.events))
        self.events.append(ev)
        return ev

    def record(self, event: FakeEvent, i: int) -> None:
        self._check(i)
        event.label = self.last.get(i, ("nothing", -1))
        event.records += 1
        self.ops.append(Op("record", i, event.label))

    def query(self, event: FakeEvent) -> bool:
        self.ops.append(Op("query", None, event.label))
        return self.answer(event)

    def wait(self, event: FakeEvent, i: int) -> None:
        self._check(i)
        # A wait on an event never recorded is a no-op on CUDA: a missing dependency, not a wait.
        assert event.label is not None, f"stream {i} waits on event {event.id}, which was never recorded"
        self.ops.append(Op("wait", i, event.label))

    def wait_stream(self, i: int, j: int) -> None:
        self._check(i)
        self._check(j)
        self.ops.append(Op("wait_stream", i, j))

    def synchronize(self, i: int, site: str) -> None:
        self._check(i)
        self.ops.append(Op("sync", i, (site, ("stream", i))))
        host_sync(site, lambda: None)

    def block(self, event: FakeEvent, site: str) -> None:
        assert event.label is not None, f"the host blocks on event {event.id}, which was never recorded"
        self.ops.append(Op("sync", None, (site, event.label)))
        host_sync(site, lambda: None)

    def fork(self) -> None:
        self.ops.append(Op("fork", None))

    def join(self) -> None:
        self.ops.append(Op("join", None))

    def guard(self, tensors: Iterator[torch.Tensor], i: int) -> None:
        self._check(i)
        self.ops.append(Op("guard", i, sum(1 for _ in tensors)))

    def drain(self, site: str) -> None:
        for i in range(self.n):
            self.synchronize(i, site)

    # -- reading the log ---------------------------------------------------------------------------
    def phases(self, name: str) -> dict[int, int | None]:
        """Batch index -> the stream its ``name`` phase ran on."""
        return {op.what[1]: op.stream for op in self.ops if op.kind == "phase" and op.what[0] == name}

    def waits_before(self) -> dict[Label, set[Label]]:
        """Each phase -> the events its stream waited on since the previous phase on that stream
        (what the device orders before it)."""
        pending: dict[int | None, set[Label]] = {}
        out: dict[Label, set[Label]] = {}
        for op in self.ops:
            if op.kind == "wait":
                pending.setdefault(op.stream, set()).add(op.what)
            elif op.kind == "phase":
                out[op.what] = pending.pop(op.stream, set())
        return out

    def host_syncs(self) -> list[tuple[str, Label]]:
        """(site, what the host waited on) in order; ``("stream", i)``: all of stream ``i``."""
        return [op.what for op in self.ops if op.kind == "sync"]


@dataclass
class Probe:
    """A host batch that logs its copy to the device (``move`` calls ``.to``) on the stream current then."""

    index: int
    x: torch.Tensor
    y: torch.Tensor
    sm: RecordingStreamManager | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> OnDevice:
        self.sm.phase("copy", self.index)
        return OnDevice(self.index, self.x.to(device, non_blocking=non_blocking),
                        self.y.to(device, non_blocking=non_blocking))


@dataclass
class OnDevice:
    index: int
    x: torch.Tensor
    y: torch.Tensor


class RecordingStep:
    """Wraps a step function whose batches are ``(x, y)``: logs each phase with its stream."""

    def __init__(self, inner: Any, sm: RecordingStreamManager):
        self.inner, self.sm = inner, sm
        self.index = -1

    def begin_micro(self, last: bool) -> None:
        hook = getattr(self.inner, "begin_micro", None)
        if hook is not None:
            hook(last)

    def forward(self, batch: OnDevice) -> torch.Tensor:
        self.index = batch.index
        self.sm.phase("forward", batch.index)
        return self.inner.forward((batch.x, batch.y))

    def backward(self, loss: torch.Tensor) -> None:
        self.sm.phase("backward", self.index)
        self.inner.backward(loss)

    def optimizer_step(self) -> None:
        self.sm.phase("optimizer", self.index)
        self.inner.optimizer_step()


class RecordingLosses:
    """Wraps ``DeferredLosses``: logs each push with its stream."""

    def __init__(self, inner: Any, sm: RecordingStreamManager, step: RecordingStep):
        self.inner, self.sm, self.step = inner, sm, step

    def push(self, step: int, loss: torch.Tensor) -> None:
        self.sm.phase("push", self.step.index)
        self.inner.push(step, loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
