"""Graph mode: the whole training step captured in one CUDA graph per batch shape.

Eager steps are bound by the rate at which Python launches kernels (hundreds per step); no
placement of streams or syncs changes that. Capturing forward, loss, backward, gradient clipping,
the learning-rate update and the optimizer step into a CUDA graph turns each step into one
``replay()``: the host launches one graph, the GPU runs the kernels back to back.

How it fits the engine:
* one graph per padded batch shape (the data layer keeps the set of shapes small); all graphs
  share one memory pool;
* before training, for each shape: warm-up steps on a side stream (lazy initialisations, cuBLAS
  handles, optimizer state), then capture. Warm-up steps change the weights, so every tensor the
  step mutates is saved before and restored after (same storage, so the graphs stay valid), and
  tensors that warm-up created (the optimizer's moments) are zeroed, as fresh ones are;
* static input buffers per shape. The next host batch is copied to the GPU on a side stream while
  the current graph replays, then copied device-to-device into the static buffers on the compute
  stream (ordered after the previous replay, which read them);
* randomness (dropout) inside graphs comes from PyTorch's graph-safe Philox offsets, so a replay
  draws the same numbers an eager step would at the same generator state;
* the step function must be capturable: no host syncs, learning rate as a device tensor,
  ``Adam(capturable=True)``. It provides ``state_tensors()`` listing what a step mutates.

Gradient accumulation (``accum_steps`` K > 1): one micro-step graph per shape (forward and
backward, accumulating into the ``.grad`` tensors; the loss normaliser is a tensor of the batch,
so it is one of the static inputs) and one optimizer graph (clipping, learning rate, Adam, zeroing
the gradients in place). A global step is K micro replays and one optimizer replay, no host sync.
On several ranks the micro graph of a step's last micro-batch is a second variant whose backward
all-reduces the gradients (DDP inside the capture: NCCL collectives can be captured); the other
micro-batches' variant skips the all-reduce (DDP's ``no_sync``).

Several ranks (DistributedDataParallel, at any world size under torchrun): the all-reduce runs
inside the captured backward. As PyTorch's CUDA-graph notes require, DDP is built, warmed up and
captured under ONE stream, the capture stream (the step builds DDP lazily: ``step.parallel()``
under that stream), and the warm-up runs at least 11 DDP iterations before capture (DDP rebuilds
its buckets on the host in its first iterations; with fewer, capture fails even on one rank). A
DDP capture failure is not handled on one rank alone: the strategy records it in
``report["capture_error"]`` and does not fall back; the caller agrees on the outcome across ranks
(``streamnmt.dist.Dist.agree_on_capture``), and every rank stops with the same line. NCCL's
watchdog stays on, but it does not watch captured collectives: the host waits of a replayed step
poll their event with a deadline (``--dist-timeout``, ``streamnmt.dist.wait_event``), so a dead
peer ends the run with one ``PeerLost`` line instead of a hang.

Where capture is impossible (no CUDA, an error during capture) the strategy says so in one line
and runs the ``full`` strategy instead.

Topology for profiling: with ``keep_topology`` set before ``prepare`` (the benchmark's ``--profile``;
off otherwise, so training captures as before), each graph keeps its captured ``cudaGraph_t``
(``CUDAGraph(keep_graph=True)`` where the torch version accepts it, debug mode otherwise), and
``dump_graphs`` writes its nodes and dependency edges as Graphviz DOT (``cudaGraphDebugDotPrint``),
from which ``streamnmt.bench.critical`` derives the step's critical path.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from streamnmt.engine.base import (StepFunction, StepInfo, Strategy, begin_micro, lookahead, move, register,
                                   step_values, tensors)
from streamnmt.engine.config import EngineConfig
from streamnmt.engine.losses import DeferredLosses
from streamnmt.engine.strategies import FullPipeline
from streamnmt.errors import one_line
from streamnmt.syncstats import host_sync
from streamnmt.fsutil import atomic_path
from streamnmt import testhooks

DDP_WARMUP_STEPS = 11  # PyTorch's notes on DDP with CUDA graphs: at least 11 eager iterations first


def _data_parallel(step: StepFunction) -> bool:
    """The step's gradients are all-reduced by DDP (built or about to be), at any world size."""
    return bool(getattr(step, "data_parallel", False))


def _ema_variants(step: StepFunction) -> tuple[bool, ...]:
    """The optimizer steps to capture: without the moving average's update, and with it where the step
    keeps an average that skips steps (``--ema-every`` > 1); with one updated every step, only that."""
    ema = getattr(step, "ema", None)
    if ema is None:
        return (False,)
    return (False, True) if ema.every > 1 else (True,)


def _optimizer_step(step: StepFunction, ema: bool) -> None:
    """``step.optimizer_step``, told whether to update the average where the step has one."""
    if getattr(step, "ema", None) is not None:
        step.optimizer_step(ema=ema)
    else:
        step.optimizer_step()


def _ema_due(step: StepFunction) -> bool:
    """The step's next update refreshes its average (host-side count; never a sync)."""
    return bool(getattr(step, "ema", None) is not None and step.ema.every > 1 and step.ema_due())


def shape_key(batch: Any) -> tuple:
    return tuple(tuple(t.shape) for t in tensors(batch))


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, static_batch: Any, static_loss: torch.Tensor):
        self.graph, self.static_batch, self.static_loss = graph, static_batch, static_loss


def _new_graph(keep_topology: bool, deferred: list[torch.cuda.CUDAGraph]) -> torch.cuda.CUDAGraph:
    """A graph to capture into; with ``keep_topology`` one that keeps its topology for ``dump_graphs``
    (kept graphs go to ``deferred``, instantiated after their capture)."""
    if not keep_topology:
        return torch.cuda.CUDAGraph()
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        deferred.append(graph)
    except TypeError:  # a torch without keep_graph: debug mode alone keeps the topology until dumped
        graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    return graph


def _graph_for(graphs: dict[tuple, _Captured], accum: int, b: Any, ends: bool) -> _Captured | None:
    """The captured graph for batch ``b`` (a micro-step's variant with --accum-steps), or None."""
    if accum == 1:
        return graphs.get(shape_key(b))
    key = shape_key(b)
    return graphs.get((key, ends)) or graphs.get((key, True))  # one variant on one rank


def _note_uncaptured(report: dict[str, Any], log: Callable[[str], None], b: Any) -> None:
    """Say once per shape that a batch without a graph runs eagerly."""
    key = shape_key(b)
    if key not in report.setdefault("uncaptured", []):
        report["uncaptured"].append(key)
        log(f"engine: no graph for batch shape {key}; running it eagerly")


class GraphStrategy(Strategy):
    name, n_streams = "graph", 2
    T, C = 0, 1
    wants_workers = True

    def __init__(self, device: torch.device | str, cfg: EngineConfig, log: Callable[[str], None] = print,
                 warmup_steps: int = 3):
        self.log = log
        self.cfg = cfg
        self.warmup_steps = warmup_steps
        self.keep_topology = False  # set before prepare() to dump the graphs later (dump_graphs)
        self._deferred: list[torch.cuda.CUDAGraph] = []  # kept graphs, instantiated after their capture
        self.fallback: Strategy | None = None
        self.graphs: dict[tuple, _Captured] = {}  # K == 1: whole steps; K > 1: (key, ends) -> micro steps
        self.opt_graph: torch.cuda.CUDAGraph | None = None  # K > 1: the optimizer step
        self.opt_graph_ema: torch.cuda.CUDAGraph | None = None  # and with the average's update (--ema-every)
        self.ema_graphs: dict[Any, _Captured] = {}  # K = 1, --ema-every > 1: the steps that update the average
        self.report: dict[str, Any] = {}
        self._warmup_s = 0.0  # host seconds of the eager warm-up steps before the captures
        self._ddp_s: float | None = None  # host seconds of building DDP (its first collective) before them
        self.polling = False  # set by prepare(): with DDP, host waits poll with a deadline
        dev = torch.device(device)
        if dev.type != "cuda":
            self._fall_back(dev, cfg, "CUDA graphs need a CUDA device; this run is on " + str(dev))
            return
        super().__init__(dev, cfg, log)

    def _fall_back(self, device: torch.device, cfg: EngineConfig, why: str) -> None:
        self.log(f"engine: graph mode unavailable ({why}); using the 'full' strategy instead")
        self.fallback = FullPipeline(device, cfg, self.log)
        self.sm = self.fallback.sm
        self.device = torch.device(device)
        self.report = {"fallback": why}

    # -- capture -------------------------------------------------------------------------------
    def prepare(self, step: StepFunction, examples: Iterable[Any], again: bool = False) -> str | None:
        """Capture one graph per example batch's shape (before training).

        A failed capture falls back to ``full`` on one process; with DDP it is recorded in
        ``report["capture_error"]`` instead, for the caller to agree on across ranks.

        ``again``: between epochs, the step's model changed (``--compile background``: now compiled;
        the warm-up compiles it) on one process. The graphs in use stay until the new ones are
        captured; a capture that fails leaves them in use and is returned (why, one line), with no
        fallback. ``report["recapture_s"]``: the seconds it took."""
        if again:
            if self.fallback is not None:
                return self.fallback.prepare(step, examples, again=True)
            old = (self.graphs, self.ema_graphs, self.opt_graph, self.opt_graph_ema, self._deferred, self.report)
            self.graphs, self.ema_graphs, self._deferred = {}, {}, []
            self.opt_graph = self.opt_graph_ema = None
            t0 = time.perf_counter()
            try:
                self._capture_all(step, list(examples))
            except Exception as e:  # noqa: BLE001 - a compile's error too: the graphs in use stay
                # Needed: the failed capture's work must be finished before the old graphs replay again.
                host_sync("graph.recapture", lambda: torch.cuda.synchronize(self.device))
                self.graphs, self.ema_graphs, self.opt_graph, self.opt_graph_ema, self._deferred, self.report = old
                return one_line(e)
            self.report = {**self.report, "recapture_s": round(time.perf_counter() - t0, 2)}
            return None
        self.polling = _data_parallel(step)  # replayed collectives: host waits poll with a deadline
        injected = testhooks.capture_failure()  # test hook (streamnmt.testhooks)
        if injected is not None:
            self._capture_failed(step, injected)
            return
        if self.fallback is not None:
            return
        examples = list(examples)
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_reserved(self.device)
        try:
            self._capture_all(step, examples)
        except (RuntimeError, NotImplementedError) as e:
            self.graphs.clear()
            self.ema_graphs.clear()
            self.opt_graph = self.opt_graph_ema = None
            self._deferred.clear()
            # Needed: the failed capture's work must be finished before the fallback strategy starts.
            host_sync("graph.capture", lambda: torch.cuda.synchronize(self.device))
            self._capture_failed(step, one_line(e))
            return
        shapes = {key if self.accum == 1 else key[0] for key in self.graphs}
        self.report = {"shapes": len(shapes), "capture_s": round(time.perf_counter() - t0, 2),
                       "warmup_s": round(self._warmup_s, 2),
                       "pool_mb": round((torch.cuda.memory_reserved(self.device) - mem0) / 2**20, 1)}
        if self._ddp_s is not None:
            self.report["ddp_s"] = round(self._ddp_s, 2)
        # warm-up: the host's time to queue the eager steps, where a fresh process's lazy set-up
        # (kernel loading, Triton compiles, library handles) lands; the capture waits for them to run
        ddp = f"DDP built in {self.report['ddp_s']} s, " if "ddp_s" in self.report else ""
        self.log(f"engine: graph mode captured {self.report['shapes']} shape(s) in {self.report['capture_s']} s "
                 f"({ddp}warm-up {self.report['warmup_s']} s), memory pool +{self.report['pool_mb']} MiB")

    def _capture_failed(self, step: StepFunction, why: str) -> None:
        if _data_parallel(step):  # no fallback on one rank alone: the caller agrees across ranks
            self.report = {"capture_error": why}
            self.log(f"engine: graph capture failed ({why})")
        elif self.fallback is None:
            self._fall_back(self.device, self.cfg, f"capture failed: {why}")
        else:
            self.report["capture_error"] = why

    def _capture_all(self, step: StepFunction, examples: list[Any]) -> None:
        # One stream for DDP's construction, the warm-up and the capture (see the module docstring).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        t_ddp = time.perf_counter()
        with torch.cuda.stream(stream):
            if hasattr(step, "parallel"):
                step.parallel()  # DDP built (and its parameters broadcast) before the state is saved
        # host seconds of DDP's construction: its parameter broadcast is the process group's first
        # collective, where NCCL makes its communicator (2-GPU set-up: docs/PERFORMANCE.md)
        self._ddp_s = time.perf_counter() - t_ddp if _data_parallel(step) else None
        # Keyed by storage address: the graphs hold these addresses, so restoring is in place.
        torch.cuda.current_stream(self.device).wait_stream(stream)
        saved = {t.data_ptr(): t.detach().clone() for t in step.state_tensors()}
        rng = torch.cuda.get_rng_state(self.device)
        counted = hasattr(step, "count_updates")  # the host's count of updates, which warm-up advances
        updates = step.updates if counted else None
        try:
            self._warm_up_and_capture(step, examples, stream)
        finally:  # also after a failed capture, so that the fallback starts from the same state
            self._restore(step, saved, rng)
            if counted:
                step.count_updates(updates)

    def _warm_up_and_capture(self, step: StepFunction, examples: list[Any], stream: torch.cuda.Stream) -> None:
        pool = torch.cuda.graph_pool_handle()
        k, ddp = self.accum, _data_parallel(step)
        warmup = max(self.warmup_steps, DDP_WARMUP_STEPS) if ddp else self.warmup_steps
        if k > 1 and hasattr(step, "grads_to_none"):
            step.grads_to_none = False  # the micro graphs accumulate into .grad tensors that stay put
        # Variants of the micro graph: without and with the cross-rank all-reduce (DDP).
        variants = (False, True) if ddp else (True,)
        self._warmup_s = 0.0
        for example in examples:
            key = shape_key(example)
            if key in self.graphs or (key, True) in self.graphs:
                continue
            static = move(example, self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the copy into ``static`` first
            tw = time.perf_counter()
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    for m in range(k):
                        begin_micro(step, m == k - 1)
                        loss = step.forward(static)
                        step.backward(loss)
                        del loss  # no autograd graph (and its AccumulateGrad nodes) outlives its backward
                    step.optimizer_step()
            self._warmup_s += time.perf_counter() - tw
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if k == 1:
                variants = _ema_variants(step)
                for ema in variants:  # the step without and with the average's update
                    graph = _new_graph(self.keep_topology, self._deferred)
                    begin_micro(step, True)
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        static_loss = step.forward(static)
                        step.backward(static_loss)
                        _optimizer_step(step, ema)
                    extra = ema and len(variants) > 1  # the variant replayed only where the average is due
                    (self.ema_graphs if extra else self.graphs)[key] = _Captured(graph, static, static_loss.detach())
                    del static_loss  # the next shape's warm-up and capture hold no earlier autograd graph
                continue
            for ends in variants:  # K > 1: forward + backward only
                graph = _new_graph(self.keep_topology, self._deferred)
                begin_micro(step, ends)
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    static_loss = step.forward(static)
                    step.backward(static_loss)
                self.graphs[(key, ends)] = _Captured(graph, static, static_loss.detach())
                del static_loss
        if k > 1 and self.opt_graph is None:
            variants = _ema_variants(step)
            for ema in variants:
                graph = _new_graph(self.keep_topology, self._deferred)
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    _optimizer_step(step, ema)
                if ema and len(variants) > 1:
                    self.opt_graph_ema = graph
                else:
                    self.opt_graph = graph
        for graph in self._deferred:  # keep_graph defers instantiation to the first replay: do it now
            graph.instantiate()
        self._deferred.clear()

    def captured_graphs(self) -> list[Any]:
        """Every captured graph: step (or micro-step) graphs, their average-updating variants, optimizer graphs."""
        return [*(c.graph for c in self.graphs.values()), *(c.graph for c in self.ema_graphs.values()),
                *(g for g in (self.opt_graph, self.opt_graph_ema) if g is not None)]

    def dump_graphs(self, directory: str | os.PathLike) -> list[Path]:
        """Write each captured graph as a Graphviz DOT file (``cudaGraphDebugDotPrint``'s verbose format:
        nodes with their type, capture ID and kernel, and the dependency edges) into ``directory``, as
        ``graph_<i>.dot``. Only graphs captured with ``keep_topology`` can be dumped; the files written
        are returned (none without it, on a fallback, or where torch wrote nothing). Once per capture:
        without ``keep_graph`` torch frees a graph's topology when it dumps it."""
        if not self.keep_topology or self.fallback is not None:
            return []
        written = []
        for i, graph in enumerate(self.captured_graphs()):
            path = Path(directory) / f"graph_{i}.dot"
            try:
                with atomic_path(path, suffix=".dot") as tmp, warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # torch announces each dump with a "DEBUG:" warning
                    graph.debug_dump(str(tmp))
                    if tmp.stat().st_size == 0:
                        raise FileNotFoundError(path)  # nothing dumped: leave no empty file behind
            except FileNotFoundError:
                continue
            written.append(path)
        return written

    def _restore(self, step: StepFunction, saved: dict[int, torch.Tensor], rng: torch.Tensor) -> None:
        """Undo the warm-up steps: restore in place (the graphs hold these addresses)."""
        with torch.no_grad():
            for t in step.state_tensors():
                if t.data_ptr() in saved:
                    t.copy_(saved[t.data_ptr()])
                else:
                    t.zero_()  # created by warm-up (optimizer moments, step counts): fresh ones are zeros
        torch.cuda.set_rng_state(rng, self.device)
        # Needed: set-up ends with warm-up and restores finished, before the first timed epoch.
        host_sync("graph.capture", lambda: torch.cuda.synchronize(self.device))

    # -- training --------------------------------------------------------------------------------
    def run(self, batches, step, losses: DeferredLosses, start_step: int = 0):
        if self.fallback is not None:
            return self.fallback.run(batches, step, losses, start_step)
        return super().run(batches, step, losses, start_step)

    def _run(self, batches, step, losses: DeferredLosses, start_step: int):
        sm, k = self.sm, self.cfg.sync_interval
        ev_t, ev_c = sm.event(), sm.event()
        it = lookahead(batches)
        nxt = next(it, None)
        if nxt is None:
            return
        b_next = self._copy_in(nxt[0], ev_t, self.T)
        i = 0
        while nxt is not None:
            batch, last = nxt
            b = b_next
            sm.wait(ev_t, self.C)
            sm.guard(tensors(b), self.C)
            nxt = None if last else next(it)
            if nxt is not None:
                b_next = self._copy_in(nxt[0], ev_t, self.T)  # copies while this step replays
            ends, gstep = self.ends_step(i, last), self.gstep(start_step, i)
            with sm.use(self.C):
                cap = _graph_for(self.graphs, self.accum, b, ends)
                if cap is None:
                    _note_uncaptured(self.report, self.log, b)
                    self._compute(b, step, losses, gstep, ends)  # records its own loss
                else:
                    for dst, src in zip(tensors(cap.static_batch), tensors(b)):
                        dst.copy_(src)  # after the previous replay on this stream read them
                    due = ends and _ema_due(step)  # this step's update refreshes the average
                    if due and self.accum == 1:
                        cap = self.ema_graphs[shape_key(b)]  # captured beside every step graph
                    cap.graph.replay()
                    if ends and self.opt_graph is not None:
                        # K > 1: the optimizer step after the last micro-batch
                        (self.opt_graph_ema if due and self.opt_graph_ema is not None else self.opt_graph).replay()
                    if ends and hasattr(step, "count_updates"):
                        step.count_updates()  # the replayed update, counted as an eager one counts itself
                    losses.push(gstep, cap.static_loss, **step_values(step))
                sm.record(ev_c, self.C)
            if (i + 1) % k == 0 or last:
                # Bound how far the host runs ahead of the GPU, as the interval strategy does.
                self._block(ev_c, "graph.compute")
            yield StepInfo(i, gstep, batch, ends)
            i += 1

    def _block(self, event, site: str) -> None:
        """Host waits until ``event`` completes; with DDP by polling with a deadline (``PeerLost``)."""
        if not self.polling:
            self.sm.block(event, site)
            return
        from streamnmt.dist import wait_event
        # Needed: the caller's wait (run-ahead bound, drain); polled, since a replayed all-reduce whose
        # peer died never completes and NCCL's watchdog does not watch captured work.
        host_sync(site, lambda: wait_event(event, self.cfg.dist_timeout))

    def drain(self, site: str) -> None:
        if self.fallback is not None:
            self.fallback.drain(site)
        elif self.polling and self.sm.cuda:
            for i in range(self.sm.n):  # every stream idle, each wait polled with a deadline
                ev = self.sm.event()
                self.sm.record(ev, i)
                self._block(ev, site)
        else:
            super().drain(site)


register(GraphStrategy)
