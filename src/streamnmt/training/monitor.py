"""Measuring how busy the GPU and the CPU are while training, without slowing the training down.

The strategies exist to keep the GPU busy, so "GPU busy" must be a measured number. Three
sources, each cheap enough to leave on in every epoch:

* :class:`GpuTimer`: a pair of CUDA events around each step, recorded on the stream the step runs
  on. Reading an event's time would block the host, so pairs are read only once they have
  completed (checked with the non-blocking ``query``) and reused, a ring that grows only as far as
  the GPU lags behind; :meth:`GpuTimer.collect` waits once, counted, at the end of an epoch.
  A pair measures the span from the GPU reaching the step's first work to finishing its last, so
  gaps *between* steps (data loading, host syncs, bookkeeping) are excluded, but gaps *inside* a
  step, where the stream ran dry waiting for the host to launch the next kernel, are included:
  for launch-bound eager steps this is an upper bound on true kernel time (the profiler's kernel
  timeline in ``streamnmt bench --profile`` gives the exact figure).
* :class:`NvmlSampler`: a thread reading NVML's utilisation (the share of each sample period in
  which any kernel ran) and memory every ~100 ms.
* :class:`CpuSampler`: CPU time of this process and of its children (loader workers) over wall time.

:class:`TimedStep` and :func:`time_graph_replays` put the timer around a training step function
and around CUDA graph replays, so a trainer or the benchmark gets per-step GPU time without touching
the engine. Everything here is a no-op on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Any

import psutil
import torch

from streamnmt.engine import host_sync


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device to watch, or None when there is none (CPU run, no driver)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class GpuTimer:
    """GPU milliseconds spent between ``start()`` and ``stop()`` pairs, read without blocking steps.

    Usage::

        timer = GpuTimer(device)
        for batch in batches:
            timer.start()              # on the current stream, or start(stream)
            ...                        # the step's kernels
            timer.stop()
        gpu_ms = timer.collect()       # one counted host wait; resets for the next epoch
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = _cuda_device(device)
        self.enabled = self.device is not None
        self.free: list[tuple[Any, Any]] = []      # completed pairs, ready for reuse
        self.pending: deque[tuple[Any, Any]] = deque()  # recorded, not yet read
        self.open: tuple[Any, Any] | None = None
        self.total_ms = 0.0
        self.count = 0        # pairs read since the last collect
        self.collected = 0    # pairs read by the last collect

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def start(self, stream: torch.cuda.Stream | None = None) -> None:
        if not self.enabled:
            return
        if self.open is not None:
            raise RuntimeError("GpuTimer.start() called twice without stop()")
        self._harvest()
        pair = self.free.pop() if self.free else (torch.cuda.Event(enable_timing=True),
                                                  torch.cuda.Event(enable_timing=True))
        pair[0].record(self._stream(stream))
        self.open = pair

    def stop(self, stream: torch.cuda.Stream | None = None) -> None:
        if not self.enabled:
            return
        if self.open is None:
            raise RuntimeError("GpuTimer.stop() called without start()")
        self.open[1].record(self._stream(stream))
        self.pending.append(self.open)
        self.open = None

    def _read(self, pair: tuple[Any, Any]) -> None:
        self.total_ms += pair[0].elapsed_time(pair[1])
        self.count += 1
        self.free.append(pair)

    def _harvest(self) -> None:
        """Read the pairs that have completed, oldest first; never blocks."""
        while self.pending and self.pending[0][1].query() and self.pending[0][0].query():
            self._read(self.pending.popleft())

    def collect(self, site: str = "monitor.gpu_timer") -> float:
        """Total GPU ms of the pairs since the last collect; waits (counted) for any still running."""
        if not self.enabled:
            return 0.0
        if self.open is not None:
            raise RuntimeError("GpuTimer.collect() called between start() and stop()")
        if self.pending and not self.pending[-1][1].query():
            # Needed: the epoch's GPU time is reported now. Pairs complete in order on one
            # stream, so waiting for the newest covers the rest (usually already done: callers
            # drain their streams first).
            host_sync(site, self.pending[-1][1])
        while self.pending:
            pair = self.pending.popleft()
            if not (pair[0].query() and pair[1].query()):
                # Needed: a pair recorded on another stream than the newest; rare.
                host_sync(site, pair[1])
                host_sync(site, pair[0])
            self._read(pair)
        total, self.collected = self.total_ms, self.count
        self.total_ms, self.count = 0.0, 0
        return total


class TimedStep:
    """Wraps a step function (``forward``, ``backward``, ``optimizer_step``) to time each step.

    While ``timer`` is set, a pair is started before ``forward`` on the stream it runs on and
    stopped after ``optimizer_step`` on the stream that runs on (they differ in the ``deep``
    strategy). While ``annotate`` is set, each phase is a ``torch.profiler.record_function``
    range (``step.forward``, ``step.backward``, ``step.optimizer``), used to attribute kernels to
    phases in a profile. Other attributes (``state_tensors``...) pass through.
    """

    def __init__(self, step: Any, timer: GpuTimer | None = None, annotate: bool = False):
        self.step, self.timer, self.annotate = step, timer, annotate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def _range(self, name: str) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def forward(self, batch: Any) -> torch.Tensor:
        if self.timer is not None and not _capturing():
            self.timer.start()
        with self._range("step.forward"):
            return self.step.forward(batch)

    def backward(self, loss: torch.Tensor) -> None:
        with self._range("step.backward"):
            self.step.backward(loss)

    def optimizer_step(self, **kw: Any) -> None:
        with self._range("step.optimizer"):
            self.step.optimizer_step(**kw)
        if self.timer is not None and not _capturing():
            self.timer.stop()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _TimedReplay:
    """Stands in for a captured ``torch.cuda.CUDAGraph``: times and annotates each ``replay``."""

    def __init__(self, graph: Any, owner: TimedStep):
        self.graph, self.owner = graph, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    def replay(self) -> None:
        timer = self.owner.timer
        if timer is not None:
            timer.start()
        with self.owner._range("graph.replay"):
            self.graph.replay()
        if timer is not None:
            timer.stop()


def time_graph_replays(strategy: Any, owner: TimedStep) -> int:
    """Put ``owner``'s timer and annotations around every graph a graph-mode strategy captured.

    Call after ``strategy.prepare``. Returns how many graphs were wrapped (0 for a strategy with
    no graphs, e.g. one that fell back to eager steps, which ``owner`` times already).
    """
    graphs = [*(getattr(strategy, "graphs", None) or {}).values(),
              *(getattr(strategy, "ema_graphs", None) or {}).values()]  # --ema-every: the steps that update it
    n = 0
    for captured in graphs:
        if hasattr(captured, "graph") and not isinstance(captured.graph, _TimedReplay):
            captured.graph = _TimedReplay(captured.graph, owner)
            n += 1
    return n


class NvmlSampler:
    """A thread sampling NVML utilisation (%) and used memory (MB) of one GPU while active.

    ``start()`` ... ``stop() -> dict``, or as a context manager (``sampler.result`` afterwards).
    Without NVML or a GPU, ``available`` is False and ``stop()`` returns an empty dict.
    """

    def __init__(self, device: torch.device | str | None = None, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.handle = None
        self.samples: list[tuple[float, float]] = []
        self.result: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        dev = _cuda_device(device)
        if dev is None:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                index = torch.cuda._get_nvml_device_index(dev)  # respects CUDA_VISIBLE_DEVICES
            except (AttributeError, RuntimeError):
                index = dev.index
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # no library, no driver, no permission: sampling is optional
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def _sample(self) -> None:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
        self.samples.append((float(util), float(mem)))

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> NvmlSampler:
        self.samples, self.result = [], {}
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.samples:
            utils = [u for u, _ in self.samples]
            self.result = {"util_mean_pct": sum(utils) / len(utils), "util_max_pct": max(utils),
                           "mem_max_mb": max(m for _, m in self.samples), "samples": len(self.samples)}
        return self.result

    def __enter__(self) -> NvmlSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CpuSampler:
    """CPU time of this process and of its children (loader workers) over a wall-clock interval.

    Percentages are of one core (a process using two cores fully reads 200 %): ``process_pct`` this
    process (all its threads), ``workers_pct`` its child processes (loader workers), ``util_pct``
    the two together (the trainer's ``cpu_util`` column); ``system_pct`` is the whole machine's busy
    share (0-100). ``start()`` ... ``stop() -> dict``.
    """

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self._t0 = 0.0
        self._own0 = 0.0
        self._children0: dict[int, float] = {}

    def _children(self) -> dict[int, float]:
        out = {}
        for child in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                t = child.cpu_times()
                out[child.pid] = t.user + t.system
        return out

    def start(self) -> CpuSampler:
        t = self.proc.cpu_times()
        self._own0 = t.user + t.system
        self._children0 = self._children()
        psutil.cpu_percent(interval=None)  # sets the reference point for the system-wide figure
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        t = self.proc.cpu_times()
        own = t.user + t.system - self._own0
        children = sum(v - self._children0.get(pid, 0.0) for pid, v in self._children().items())
        return {"process_pct": 100 * own / wall, "workers_pct": 100 * children / wall,
                "util_pct": 100 * (own + children) / wall, "system_pct": psutil.cpu_percent(interval=None)}
