"""What every strategy shares: the step-function interface, the per-batch report, batch helpers,
the :class:`Strategy` base class and the registry of strategies.

It sits below ``strategies`` (the seed design's strategies) and ``graphs`` (graph mode), which
both import from here and register themselves here, so imports run one way: ``base`` <- the
strategy modules <- ``engine/__init__``.

Gradient accumulation lives here too, as two helpers every strategy calls: an optimizer step
("global step") is made of ``accum_steps`` consecutive micro-batches; the strategy runs forward
and backward on each and the optimizer step after the last. A run always starts at the first
micro-batch of a global step (checkpoints and stops happen between global steps), so micro-batch
``i`` of a run belongs to global step ``start_step + i // accum_steps + 1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from streamnmt.engine.config import EngineConfig
from streamnmt.engine.losses import DeferredLosses
from streamnmt.engine.streams import StreamManager


class StepFunction(Protocol):
    """What the application supplies: one training step split in its three phases.

    Optional: ``begin_micro(last: bool)``, called before each ``forward`` when gradients are
    accumulated over several micro-batches (``last``: the micro-batch after which the optimizer
    steps, e.g. the one whose backward all-reduces the gradients across ranks); ``values``, a dict
    of named device scalars pushed beside each loss (see :func:`step_values`).
    """

    def forward(self, batch: Any) -> torch.Tensor: ...   # device scalar loss, graph attached
    def backward(self, loss: torch.Tensor) -> None: ...
    def optimizer_step(self) -> None: ...


@dataclass
class StepInfo:
    index: int   # micro-batch index within this run
    step: int    # global optimizer step (1-based) whose loss was pushed
    batch: Any   # the host batch (for token counts); never touched on the device
    ends_step: bool = True  # the optimizer stepped after this micro-batch (the last of its step)


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


def step_values(step: StepFunction) -> dict[str, torch.Tensor]:
    """The named device scalars ``step`` pushes beside its loss (``step.values``, if it has them).
    They must be tensors updated in place by the step (graph replays write the same storage)."""
    return getattr(step, "values", None) or {}


def begin_micro(step: StepFunction, last: bool) -> None:
    """Tell ``step`` whether the coming micro-batch ends its optimizer step (if it wants to know)."""
    hook = getattr(step, "begin_micro", None)
    if hook is not None:
        hook(last)


ManagerFactory = Callable[[torch.device, int], StreamManager]


class Strategy:
    """``manager``: what makes the stream manager (default :class:`StreamManager`); tests pass a
    recording double that runs on the CPU and logs every stream use, event, wait and host sync."""

    name: ClassVar[str]
    n_streams: ClassVar[int]  # the default; ``self.n_streams`` is the count this instance uses
    wants_workers: ClassVar[bool] = False  # full: loading in worker processes is part of the plan

    def __init__(self, device: torch.device | str, cfg: EngineConfig, log: Callable[[str], None] = print,
                 manager: ManagerFactory | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Streams, events and graph captures made without a device argument use the current one.
            torch.cuda.set_device(self.device)
        self.cfg = cfg
        self.log = log
        self.n_streams = self.streams_for(cfg)
        self.sm = (manager or StreamManager)(self.device, self.n_streams)  # created once per trainer
        self.report: dict[str, Any] = {}

    @classmethod
    def streams_for(cls, cfg: EngineConfig) -> int:
        """How many streams this strategy uses under ``cfg`` (``--streams`` where it applies)."""
        return cls.n_streams

    def counters(self) -> dict[str, int]:
        """Per-epoch counters of the strategy's own (e.g. ``event``: how often the host was ahead),
        returned and reset; the trainer writes them into ``sync_stats.json``."""
        return {}

    @property
    def accum(self) -> int:
        return getattr(self.cfg, "accum_steps", 1)

    def gstep(self, start_step: int, i: int) -> int:
        """The global optimizer step (1-based) of micro-batch ``i`` of a run."""
        return start_step + i // self.accum + 1

    def ends_step(self, i: int, last: bool) -> bool:
        """Does micro-batch ``i`` end its optimizer step? (The run's last one always does.)"""
        return last or (i + 1) % self.accum == 0

    def prepare(self, step: StepFunction, examples: Iterable[Any], again: bool = False) -> str | None:
        """Set-up before training, given one example host batch per batch shape (graph capture);
        ``again``: between epochs, for a step whose model changed (``--compile background``). None,
        or why it could not (``again`` only: the strategy is then as it was). Eager strategies
        capture nothing."""
        return None

    def run(self, batches: Iterable, step: StepFunction, losses: DeferredLosses,
            start_step: int = 0) -> Iterator[StepInfo]:
        """Drive ``step`` over ``batches``; yields once per batch. The caller's earlier work on the
        current stream is ordered before the run, and its later work after it (device-side); so is
        what it queues there between two batches (an evaluation, an EMA weight swap)."""
        self.sm.fork()
        run = self._run(batches, step, losses, start_step)
        try:
            for info in run:
                yield info
                self.sm.fork()  # device-side: the caller's work of this pause comes before the next batch
        except BaseException:  # an error, or the caller closed the run early (GeneratorExit)
            # A device that failed (a sticky CUDA error) fails this call too: the first error is
            # the one to report, not this one.
            with contextlib.suppress(RuntimeError):
                self.sm.join()
            raise
        finally:
            run.close()
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

    def _compute(self, b: Any, step: StepFunction, losses: DeferredLosses, gstep: int,
                 ends: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch; the optimizer step after the last of a step."""
        begin_micro(step, ends)
        loss = step.forward(b)
        step.backward(loss)
        if ends:
            step.optimizer_step()
        losses.push(gstep, loss, **step_values(step))
        return loss


STRATEGIES: dict[str, type[Strategy]] = {}  # filled by the strategy modules as they are imported


def register(cls: type[Strategy]) -> type[Strategy]:
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(name: str, device: torch.device | str, cfg: EngineConfig,
                  log: Callable[[str], None] = print, manager: ManagerFactory | None = None) -> Strategy:
    """``manager``: see :class:`Strategy` (only the seed strategies take one; left out when None)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](device, cfg, log=log, **({"manager": manager} if manager is not None else {}))
