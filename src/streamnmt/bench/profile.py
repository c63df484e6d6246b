"""Reading a profiler trace: which stream each kernel ran on, and why the GPU sat idle.

``streamnmt bench --profile`` records a few steps of each row with ``torch.profiler`` and exports
a Chrome/Perfetto trace. This module reads that trace back (the exported JSON, so that what the
table says can be checked against the picture) and derives:

**Kernels per stream.** Each GPU op (kernel, memcpy, memset) carries its CUDA stream and the
correlation id of the host call that launched it. The launch's host time is looked up in the
benchmark's phase ranges (``step.forward``, ``step.backward``, ``step.optimizer``,
``graph.replay``, recorded by :class:`streamnmt.training.monitor.TimedStep`): a kernel launched while
``step.backward`` was open is a backward kernel, whichever thread launched it (autograd launches
backward kernels from its own thread). Copies are classed by direction, NCCL kernels (DDP's
gradient all-reduce, on several processes) as ``nccl all-reduce`` whenever they were launched. So
the table shows, e.g., that the ``deep`` strategy's backward kernels ran on its forward stream, and
on which stream, and for how long, the all-reduce ran beside them.

**GPU busy and idle time.** Over the profiled window (the ``bench.window`` range: the steps and
their final drain), the union of all GPU ops on all streams is busy time, the rest is idle. Each
idle gap is given one cause, approximately, checked in this order:

1. *queued*: the op that ends the gap had been launched before the gap began, so the GPU had work
   and waited on something else: another stream's event, or launch latency (e.g. between the
   kernels of one graph, which are all launched by one ``cudaGraphLaunch``);
2. *sync*: when the GPU ran dry the host was blocked in a synchronisation call
   (``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, a synchronous
   ``cudaMemcpy``): the queue emptied while the host waited, and stayed empty until it woke and
   launched again. (A sync that starts after the GPU is already idle does not count: the GPU was
   idle because the host was slow, the next cause);
3. *data*: the op that ends the gap is a host-to-device copy: the GPU waited for the next batch;
4. *launch*: the host had not yet launched the next op (Python launch overhead, the launch-bound
   regime).

Approximations: one cause per gap (a sync gap also contains launch time after the host woke);
host times and GPU times come from one clock, aligned by the profiler, to a few microseconds; and
the profiler slows the host (about 2x for launch-bound eager steps), so launch idle is larger in
the profiled window than in an unprofiled run. Kernel time itself is not slowed: the benchmark's
"GPU kernels" column divides kernel ms per profiled step by the unprofiled ms per step.

Graph replays run some of their kernels on streams of the graph's own (parallel branches); those
streams are shown merged as one pseudo-stream, ``GRAPH_BRANCHES`` (-1).

**Per step** (:mod:`streamnmt.bench.critical`, which states each figure's approximations): kernel
time summed, the step's span, the share of the span with two or more ops at once, and the critical
path, the longest chain of dependent ops: over the captured graph's edges in graph mode (the graphs
dumped as DOT), and in eager mode only a lower bound, the longest single-stream chain.
"""

from __future__ import annotations

import bisect
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = "bench.window"
PHASES = {"step.forward": "forward", "step.backward": "backward", "step.optimizer": "optimizer",
          "graph.replay": "graph replay"}
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize", "cuMemcpy"})
IDLE_CAUSES = ("launch", "data", "sync", "queued")
ALL_REDUCE = "nccl all-reduce"  # the category of NCCL's kernels (several processes, DDP)
GRAPH_BRANCHES = -1  # pseudo-stream: streams that only ran graph-internal kernels
TOP_KERNELS = 12     # kernels named in the summary, by GPU time
# Kernel families by name (first match wins; lower-case substrings): where a step's GPU time goes
# when a hundred kernels share it. Names as CUDA/cuBLAS/CUTLASS/PyTorch give them.
FAMILIES = (
    ("attention", ("fmha", "flash", "attention", "attn", "flex")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul")),
    ("nccl", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("softmax/reduce", ("softmax", "reduce", "logsumexp", "norm_kernel", "layer_norm", "scan")),
    ("dropout/random", ("fused_dropout", "bernoulli", "philox", "random")),
    ("copy/index", ("copy", "gather", "scatter", "index", "cat", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton")),
)


def kernel_family(name: str) -> str:
    """The family of a kernel name (:data:`FAMILIES`), ``other`` when none matches."""
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")
_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass
class GpuOp:
    stream: int
    start: float   # us, profiler clock
    end: float
    kind: str      # kernel, memcpy, memset
    name: str
    launch: float | None  # host time of the launching call
    category: str = ""


@dataclass
class TraceSummary:
    """What :func:`analyze_trace` derives; ``ops``/``syncs`` (ms from the window start) feed the timeline."""

    window_ms: float
    busy_ms: float
    idle_ms: dict[str, float]
    streams: dict[str, dict[int, list[float]]]  # category -> stream -> [kernels, ms]
    ops: list[tuple[int, float, float, str]] = field(default_factory=list)  # (stream, start, duration, category)
    syncs: list[tuple[float, float]] = field(default_factory=list)         # (start, duration)
    top_kernels: list[tuple[str, int, float]] = field(default_factory=list)  # (name, count, ms), by ms
    n_kernels: int = 0  # kernels that ran inside the window
    families: dict[str, tuple[int, float]] = field(default_factory=dict)  # kernel_family -> (count, ms), by ms
    all_reduce_ms: float = 0.0         # the union of NCCL kernels' time in the window
    all_reduce_hidden_ms: float = 0.0  # the part of it that other kernels ran beside (see _overlap)

    def to_dict(self) -> dict[str, Any]:
        w = max(self.window_ms, 1e-9)
        return {"window_ms": self.window_ms, "busy_ms": self.busy_ms, "busy_pct": 100 * self.busy_ms / w,
                "idle_ms": self.idle_ms, "idle_pct": {k: 100 * v / w for k, v in self.idle_ms.items()},
                "kernels_per_stream": {cat: {str(s): {"count": int(c), "ms": ms} for s, (c, ms) in by.items()}
                                       for cat, by in self.streams.items()},
                "host_syncs": len(self.syncs), "kernels": self.n_kernels,
                "top_kernels": [{"name": n, "count": c, "ms": ms, "pct_of_busy": 100 * ms / max(self.busy_ms, 1e-9)}
                                for n, c, ms in self.top_kernels],
                "kernel_families": {f: {"count": c, "ms": ms} for f, (c, ms) in self.families.items()},
                "all_reduce_ms": self.all_reduce_ms, "all_reduce_hidden_ms": self.all_reduce_hidden_ms,
                "all_reduce_hidden_pct": 100 * self.all_reduce_hidden_ms / max(self.all_reduce_ms, 1e-9)}


def load_trace(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _category(op: GpuOp, starts: list[float], phases: list[tuple[float, float, str]]) -> str:
    if op.kind == "memcpy":
        for direction in ("HtoD", "DtoH", "DtoD", "HtoH", "PtoP"):
            if direction in op.name:
                return f"copy {direction}"
        return "copy"
    if op.kind == "memset":
        return "memset"
    if op.kind == "kernel" and op.name.lower().startswith("nccl"):
        return ALL_REDUCE  # DDP's gradient all-reduce (in a graph replay too): on NCCL's own stream
    if op.launch is None:
        return "other"
    i = bisect.bisect_right(starts, op.launch) - 1  # the phase open at launch time (phases do not nest)
    if i >= 0 and phases[i][1] >= op.launch:
        return PHASES[phases[i][2]]
    return "other"


def _merge_graph_branches(ops: list[GpuOp]) -> None:
    """Relabel streams that ran only graph-replay kernels, other than the main one, as GRAPH_BRANCHES."""
    cats: dict[int, set[str]] = {}
    replays: dict[int, int] = {}
    for o in ops:
        cats.setdefault(o.stream, set()).add(o.category)
        if o.category == "graph replay":
            replays[o.stream] = replays.get(o.stream, 0) + 1
    if not replays:
        return
    main = max(replays, key=replays.get)
    branches = {s for s, c in cats.items() if s != main and c <= {"graph replay", "memset"} and s in replays}
    for o in ops:
        if o.stream in branches:
            o.stream = GRAPH_BRANCHES


def analyze_trace(trace: dict[str, Any], window: str = WINDOW) -> TraceSummary | None:
    """Summarise a trace exported by ``torch.profiler``; None when it has no GPU activity (CPU run)."""
    launches: dict[Any, float] = {}
    syncs: list[tuple[float, float]] = []
    phases: list[tuple[float, float, str]] = []
    raw: list[tuple[dict[str, Any], str]] = []
    span: tuple[float, float] | None = None
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if cat in ("cuda_runtime", "cuda_driver"):
            if "correlation" in args:
                launches.setdefault(args["correlation"], ts)
            if name in SYNC_CALLS:
                syncs.append((ts, ts + dur))
        elif cat == "user_annotation":
            if name == window:
                span = (ts, ts + dur)
            elif name in PHASES:
                phases.append((ts, ts + dur, name))
        elif cat in _GPU_CATS:
            raw.append((e, _GPU_CATS[cat]))
    if not raw:
        return None
    phases.sort()
    starts = [p[0] for p in phases]
    ops = []
    for e, kind in raw:
        args = e.get("args") or {}
        ts = float(e["ts"])
        op = GpuOp(int(args.get("stream", e.get("tid", -1))), ts, ts + float(e.get("dur", 0.0)), kind,
                   e.get("name", ""), launches.get(args.get("correlation")))
        op.category = _category(op, starts, phases)
        ops.append(op)
    ops.sort(key=lambda o: o.start)
    w0, w1 = span if span is not None else (ops[0].start, max(o.end for o in ops))
    syncs.sort()

    # 1. busy: the union of GPU ops on all streams, clipped to the window
    busy: list[list[float]] = []
    for o in ops:
        a, b = max(o.start, w0), min(o.end, w1)
        if b <= a:
            continue
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])
    busy_ms = sum(b - a for a, b in busy) / 1e3

    # 2. idle gaps, one cause each (see the module docstring)
    sync_starts = [s for s, _ in syncs]
    sync_max_end, m = [], float("-inf")
    for _, e in syncs:
        m = max(m, e)
        sync_max_end.append(m)
    op_starts = [o.start for o in ops]
    idle = dict.fromkeys(IDLE_CAUSES, 0.0)
    edges = [w0] + [x for iv in busy for x in iv] + [w1]
    for g0, g1 in zip(edges[0::2], edges[1::2]):
        if g1 <= g0:
            continue
        j = bisect.bisect_left(op_starts, g1)
        nxt = ops[j] if j < len(ops) and g1 < w1 else None
        k = bisect.bisect_right(sync_starts, g0) - 1  # syncs that began before the GPU ran dry
        if nxt is not None and nxt.launch is not None and nxt.launch < g0:
            cause = "queued"
        elif k >= 0 and sync_max_end[k] > g0:
            cause = "sync"
        elif nxt is not None and nxt.category == "copy HtoD":
            cause = "data"
        else:
            cause = "launch"
        idle[cause] += (g1 - g0) / 1e3

    # 3. kernels per stream and category; the ops relative to the window, for the timeline
    _merge_graph_branches(ops)
    streams: dict[str, dict[int, list[float]]] = {}
    for o in ops:
        cell = streams.setdefault(o.category, {}).setdefault(o.stream, [0, 0.0])
        cell[0] += 1
        cell[1] += (o.end - o.start) / 1e3
    rel = [(o.stream, (o.start - w0) / 1e3, (o.end - o.start) / 1e3, o.category) for o in ops]
    rel_syncs = [((s - w0) / 1e3, (e - s) / 1e3) for s, e in syncs if e > w0 and s < w1]
    # 4. where the GPU time goes: kernels by name (time inside the window)
    by_name: dict[str, list[float]] = {}
    for o in ops:
        if o.kind == "kernel" and o.end > w0 and o.start < w1:
            cell = by_name.setdefault(o.name, [0, 0.0])
            cell[0] += 1
            cell[1] += (min(o.end, w1) - max(o.start, w0)) / 1e3
    top = sorted(((n, int(c), ms) for n, (c, ms) in by_name.items()), key=lambda t: -t[2])[:TOP_KERNELS]
    fams: dict[str, list[float]] = {}
    for n, (c, ms) in by_name.items():
        cell = fams.setdefault(kernel_family(n), [0, 0.0])
        cell[0] += c
        cell[1] += ms
    families = {f: (int(c), ms) for f, (c, ms) in sorted(fams.items(), key=lambda kv: -kv[1][1])}
    reduce_ms, hidden_ms = _overlap(ops, w0, w1)
    return TraceSummary((w1 - w0) / 1e3, busy_ms, idle, streams, rel, rel_syncs, top,
                        sum(int(c) for c, _ in by_name.values()), families, reduce_ms, hidden_ms)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(ops: list[GpuOp], w0: float, w1: float) -> tuple[float, float]:
    """(all-reduce ms, of which hidden ms): the union of NCCL kernels' spans in the window, and the
    part of it during which a kernel of another category ran (DDP's buckets reduced behind the
    backward). An NCCL kernel's span includes its wait for the peer rank, so "hidden" counts time
    the all-reduce could have cost, not only transfer time; the exposed rest is what a step waits."""
    clip = [(max(o.start, w0), min(o.end, w1), o.category == ALL_REDUCE) for o in ops if o.kind == "kernel"]
    reduce = _union([(a, b) for a, b, r in clip if r and b > a])
    other = _union([(a, b) for a, b, r in clip if not r and b > a])
    hidden, j = 0.0, 0
    for a, b in reduce:
        while j < len(other) and other[j][1] <= a:
            j += 1
        k = j
        while k < len(other) and other[k][0] < b:
            hidden += min(b, other[k][1]) - max(a, other[k][0])
            k += 1
    return sum(b - a for a, b in reduce) / 1e3, hidden / 1e3


def stream_label(stream: int) -> str:
    return "graph branches" if stream == GRAPH_BRANCHES else f"stream {stream}"


def format_summary(name: str, s: TraceSummary | None) -> str:
    """A few lines per row for the console: busy/idle breakdown and kernels per stream."""
    if s is None:
        return f"{name}: no GPU activity in the trace (CPU run): the stream timeline and idle breakdown need CUDA"
    d = s.to_dict()
    idle = ", ".join(f"{k} {v:.0f}%" for k, v in d["idle_pct"].items())
    lines = [f"{name}: GPU busy {d['busy_pct']:.0f}% of {s.window_ms:.1f} ms (kernel timeline); idle: {idle}"]
    stream_ids = sorted({st for by in s.streams.values() for st in by})
    head = f"    {'kernels (count / ms)':<22}" + "".join(f"{stream_label(st):>18}" for st in stream_ids)
    lines.append(head)
    for cat in sorted(s.streams):
        cells = [s.streams[cat].get(st) for st in stream_ids]
        lines.append(f"    {cat:<22}" + "".join(f"{'-' if c is None else f'{int(c[0])} / {c[1]:.2f}':>18}"
                                             for c in cells))
    if s.all_reduce_ms:
        lines.append(f"    all-reduce: {s.all_reduce_ms:.2f} ms in the window, {d['all_reduce_hidden_pct']:.0f}% of it "
                     f"beside other kernels (hidden), {s.all_reduce_ms - s.all_reduce_hidden_ms:.2f} ms exposed")
    if s.families:
        busy = max(s.busy_ms, 1e-9)
        lines.append("    by family: " + ", ".join(f"{f} {100 * ms / busy:.0f}% ({c})" for f, (c, ms) in s.families.items()))
    if s.top_kernels:
        lines.append(f"    {s.n_kernels} kernels in the window; by GPU time (count, ms, share of busy):")
        for kernel, count, ms in s.top_kernels:
            lines.append(f"    {count:>7} {ms:>9.2f} {100 * ms / max(s.busy_ms, 1e-9):>5.1f}%  {kernel[:110]}")
    return "\n".join(lines)
