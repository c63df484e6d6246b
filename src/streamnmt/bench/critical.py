"""A view of the step's critical path: how much of a step could still run beside the rest.

``streamnmt bench --profile`` derives, per row, from the kernel trace of the profiled steps (the
exported Chrome trace that :mod:`streamnmt.bench.profile` reads), per step:

* **kernel time**: the durations of the step's GPU ops (kernels, copies, memsets) summed;
* **span**: from the step's first GPU op's start to its last op's end;
* **concurrency shares**: the share of the span in which two or more of the step's ops run at once,
  exactly one runs, and none runs (gaps: dependencies waiting on launch latency, or the host);
* **critical path**: the longest chain of dependent ops, each weighted by its duration in the trace.

What a "step" is: in graph mode one replay (all GPU ops carry the correlation id of the
``cudaGraphLaunch`` that launched them); in eager mode the ops launched while one step's phases
(``step.forward`` to ``step.optimizer``, :class:`streamnmt.training.monitor.TimedStep`) were open.
Work a strategy queues between steps (the next batch's copy, graph mode's copy into the static
inputs) is not part of a step. Figures are means over the profiled steps; the shares are of the
summed spans. (The benchmark captures one graph per step; with accumulation each replay would count.)

Graph mode's dependencies are the captured graph's edges: the graph strategy dumps each graph as
DOT (:meth:`streamnmt.engine.graphs.GraphStrategy.dump_graphs`, ``cudaGraphDebugDotPrint``), whose
nodes carry their type (KERNEL, MEMSET, MEMCPY, EVENT_RECORD, EMPTY...), capture ID and kernel
(mangled name and launch configuration ``<<<grid,block,smem>>>``). A replay's ops are mapped to
the nodes by replaying the topology: in start order, each op takes a node whose predecessors all
have their op already and whose kernel agrees (every identifier of the trace's demangled name
appears in the DOT's mangled one; grid and block equal); among several such nodes, one whose predecessors finished
before the op began, then one with a predecessor on the op's stream, then the lowest capture ID.
Node weights are the mapped ops' durations; other nodes (events, empty joins) weigh 0. Where the
counts differ (no dumped graph has as many GPU-op nodes as the replay ran ops) or an op finds no
node of its kind, the critical path is n/a with the reason: no number rather than a wrong one.
Approximations: the path sums durations only, not the gaps between dependent ops (launch latency
inside the graph), so it can be shorter than the span even with no overlap left; identical
kernels ready at once may swap durations (counted as ``ambiguous``); an edge whose successor began
before its predecessor ended is counted (``out_of_order_edges``: programmatic launches, or a swap).

Eager mode has no topology: the figure given is the longest single-stream chain, the most GPU time
of one stream in the step. Ops on one stream run one after another, so the critical path is at
least that long: a lower bound, labelled so. Graph rows get it too, beside the path.
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_NODE_KINDS = {"KERNEL": "kernel", "MEMSET": "memset", "MEMCPY": "memcpy"}
GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
GRAPH_LAUNCHES = frozenset({"cudaGraphLaunch", "cuGraphLaunch"})
STEP_PHASES = ("step.forward", "step.backward", "step.optimizer")
REPLAY = "graph.replay"  # the range around each of the graph strategy's replays
ORDER_TOLERANCE_US = 1.0  # GPU timestamps: a successor that starts this much before its predecessor ends

_NODE = re.compile(r'^"([^"]+)"\s*\[(.*?)"\];[ \t]*$', re.S | re.M)
_EDGE = re.compile(r'^"([^"]+)"\s*->\s*"([^"]+)"', re.M)
_KIND = re.compile(r'label="\{?\s*([A-Z_]+)')
_CAPTURE_ID = re.compile(r"(\d+) \(topoId: \d+\)")
_KERNEL = re.compile(r"\(topoId: \d+\) \| (.+?)\\<\\<\\<(.+?)\\>\\>\\>", re.S)
_CLUSTER = re.compile(r"^subgraph\s+cluster_", re.M)


@dataclass
class Node:
    """One node of a captured graph, as ``cudaGraphDebugDotPrint`` writes it."""

    key: str                # the DOT node name, e.g. graph_1_node_7
    kind: str               # KERNEL, MEMSET, MEMCPY, EVENT_RECORD, EMPTY, ...
    capture_id: int         # the ID the node got at capture (capture order)
    name: str = ""          # kernel nodes: the (mangled) kernel name
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None

    @property
    def gpu(self) -> bool:
        return self.kind in GPU_NODE_KINDS


@dataclass
class Graph:
    """A captured graph's nodes and dependency edges (``path``: the DOT file it came from)."""

    nodes: dict[str, Node]
    edges: list[tuple[str, str]]
    path: str = ""
    clusters: int = 1

    @property
    def gpu_nodes(self) -> int:
        return sum(n.gpu for n in self.nodes.values())


@dataclass
class Op:
    """A GPU op of the trace."""

    start: float  # us
    end: float
    stream: int
    kind: str     # kernel, memcpy, memset
    name: str
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None

    @property
    def dur(self) -> float:
        return self.end - self.start


def _dims(text: str) -> tuple[int, int, int] | None:
    vals = [int(v) for v in re.findall(r"\d+", text)]
    if not 1 <= len(vals) <= 3:
        return None
    return tuple(vals + [1] * (3 - len(vals)))  # type: ignore[return-value]


def _launch(text: str) -> list[str]:
    """Split ``grid,block,smem`` where grid and block may be ``{x,y,z}``."""
    parts, depth, cur = [], 0, ""
    for ch in text.replace("\\", ""):
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "{") - (ch == "}")
        cur += ch
    return parts + [cur]


def parse_dot(text: str, path: str = "") -> Graph:
    """Nodes and edges of a ``cudaGraphDebugDotPrint`` file (verbose or not). ValueError when it has no nodes."""
    nodes: dict[str, Node] = {}
    for key, attrs in _NODE.findall(text):
        kind_m = _KIND.search(attrs)
        kind = kind_m.group(1) if kind_m else "UNKNOWN"
        id_m = _CAPTURE_ID.search(attrs)
        tail = re.search(r"(\d+)$", key)
        capture_id = int(id_m.group(1)) if id_m else int(tail.group(1)) if tail else len(nodes)
        node = Node(key, kind, capture_id)
        k = _KERNEL.search(attrs) if kind == "KERNEL" else None
        if k:
            node.name = k.group(1).replace("\\", "").strip()
            launch = _launch(k.group(2))
            if len(launch) >= 2:
                node.grid, node.block = _dims(launch[0]), _dims(launch[1])
        nodes[key] = node
    if not nodes:
        raise ValueError(f"{path or 'DOT text'}: no graph nodes (not a cudaGraphDebugDotPrint file?)")
    edges = [(a, b) for a, b in _EDGE.findall(text) if a in nodes and b in nodes]
    return Graph(nodes, edges, path, max(1, len(_CLUSTER.findall(text))))


def load_dot(path: str | Path) -> Graph:
    return parse_dot(Path(path).read_text(encoding="utf-8", errors="replace"), str(path))


# Words of a demangled name that a mangled one spells otherwise (builtin types, std::, lambdas, ABI tags)
_NOT_SPELLED = frozenset({"void", "int", "float", "double", "char", "bool", "long", "short", "unsigned", "signed",
                          "const", "volatile", "operator", "lambda", "std", "anonymous", "namespace", "unnamed",
                          "type", "true", "false", "abi", "auto", "decltype", "__int128", "wchar_t", "nullptr"})
_WORD = re.compile(r"(?<!\w)[A-Za-z_]\w*")


@functools.lru_cache(maxsize=4096)
def name_words(demangled: str) -> tuple[str, ...]:
    """The identifiers of a demangled kernel name that its mangled name spells out too:
    ``void at::native::foo<4, at::native::BarFunctor<float>>(int)`` -> at, native, foo, BarFunctor."""
    return tuple(w for w in dict.fromkeys(_WORD.findall(demangled)) if w not in _NOT_SPELLED)


def agrees(node: Node, op: Op) -> bool:
    """The op can be the node's: same kind; kernels by name (loosely: every identifier of the trace's
    demangled name appears in the DOT's mangled one) and by launch shape (grid and block)."""
    if op.kind == "kernel" and node.kind in ("MEMCPY", "MEMSET"):
        # a copy or fill node the driver runs as a kernel of its own (the trace names it, e.g.
        # ``memcpy32_post``, where the graph holds a MEMCPY node)
        return op.name.lower().startswith(GPU_NODE_KINDS[node.kind])
    if GPU_NODE_KINDS.get(node.kind) != op.kind:
        return False
    if op.kind != "kernel":
        return True
    words = name_words(op.name)
    if not (node.name == op.name or (words and all(w in node.name for w in words))):
        return False
    if node.grid and op.grid and node.grid != op.grid:
        return False
    return not (node.block and op.block and node.block != op.block)


@dataclass
class PathResult:
    """The critical path of one replay, or why there is none (``reason``)."""

    us: float | None
    reason: str = ""
    nodes: int = 0             # GPU-op nodes on the path
    ambiguous: int = 0         # ops that had several agreeing ready nodes
    out_of_order_edges: int = 0


def _gpu_preds(g: Graph) -> tuple[list[str], dict[str, set[str]]] | None:
    """A topological order and, per GPU node, its nearest GPU predecessors (through 0-weight nodes).
    None when the edges have a cycle."""
    preds: dict[str, list[str]] = {k: [] for k in g.nodes}
    succs: dict[str, list[str]] = {k: [] for k in g.nodes}
    for a, b in g.edges:
        preds[b].append(a)
        succs[a].append(b)
    indeg = {k: len(v) for k, v in preds.items()}
    order, ready = [], sorted((k for k, d in indeg.items() if d == 0), key=lambda k: g.nodes[k].capture_id)
    while ready:
        k = ready.pop()
        order.append(k)
        for s in succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(g.nodes):
        return None
    via: dict[str, set[str]] = {}
    for k in order:
        got: set[str] = set()
        for p in preds[k]:
            got |= {p} if g.nodes[p].gpu else via[p]
        via[k] = got
    return order, via


def map_ops(g: Graph, ops: list[Op]) -> tuple[dict[str, Op] | None, str, int]:
    """Assign each op of one replay to a GPU node of ``g`` (see the module docstring).
    Returns (node -> op, "", ambiguous) or (None, reason, 0)."""
    if g.clusters > 1:
        return None, f"{Path(g.path).name or 'the graph'} nests child graphs", 0
    if g.gpu_nodes != len(ops):
        return None, f"the replay ran {len(ops)} GPU ops, {Path(g.path).name or 'the graph'} has {g.gpu_nodes}", 0
    topo = _gpu_preds(g)
    if topo is None:
        return None, f"{Path(g.path).name or 'the graph'} has a cycle", 0
    _, via = topo
    waiting = {k: len(via[k]) for k, n in g.nodes.items() if n.gpu}
    after: dict[str, list[str]] = {k: [] for k in waiting}
    for k in waiting:
        for p in via[k]:
            after[p].append(k)
    ready = sorted((k for k, w in waiting.items() if w == 0), key=lambda k: g.nodes[k].capture_id)
    got: dict[str, Op] = {}
    ambiguous = 0
    for i, op in enumerate(sorted(ops, key=lambda o: (o.start, o.end))):
        cands = [k for k in ready if agrees(g.nodes[k], op)]
        if not cands:
            return None, f"op {i} ({op.kind} {op.name[:60]!r}) agrees with no node ready in the graph", 0
        if len(cands) > 1:
            ambiguous += 1
            cands.sort(key=lambda k: (any(got[p].end > op.start + ORDER_TOLERANCE_US for p in via[k]),
                                      not any(got[p].stream == op.stream for p in via[k]), g.nodes[k].capture_id))
        k = cands[0]
        got[k] = op
        ready.remove(k)
        for s in after[k]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return got, "", ambiguous


def longest_path(g: Graph, weight: dict[str, float]) -> tuple[float, list[str]]:
    """The heaviest chain through the DAG (nodes absent from ``weight`` weigh 0) and its nodes.
    ValueError on a cycle."""
    topo = _gpu_preds(g)
    if topo is None:
        raise ValueError(f"{g.path or 'the graph'} has a cycle")
    order, _ = topo
    preds: dict[str, list[str]] = {k: [] for k in g.nodes}
    for a, b in g.edges:
        preds[b].append(a)
    best: dict[str, float] = {}
    prev: dict[str, str | None] = {}
    for k in order:
        p = max(preds[k], key=lambda q: best[q], default=None)
        best[k] = weight.get(k, 0.0) + (best[p] if p is not None else 0.0)
        prev[k] = p
    end = max(best, key=best.get)
    path, k2 = [], end
    while k2 is not None:
        path.append(k2)
        k2 = prev[k2]
    return best[end], path[::-1]


def critical_path(graphs: list[Graph], ops: list[Op]) -> PathResult:
    """The critical path of one replay: the first dumped graph its ops map onto."""
    if not graphs:
        return PathResult(None, "no graph topology was dumped")
    reasons = []
    for g in graphs:
        got, reason, ambiguous = map_ops(g, ops)
        if got is None:
            reasons.append(reason)
            continue
        us, path = longest_path(g, {k: o.dur for k, o in got.items()})
        _, via = _gpu_preds(g)  # type: ignore[misc]
        late = sum(got[k].start < got[p].end - ORDER_TOLERANCE_US for k in got for p in via[k])
        return PathResult(us, "", sum(g.nodes[k].gpu for k in path), ambiguous, late)
    return PathResult(None, "; ".join(dict.fromkeys(reasons)))


def concurrency(ops: list[Op]) -> tuple[float, float, float, float]:
    """(span, none, one, two or more) in us: how long 0, 1, 2+ of ``ops`` ran at once within their span."""
    if not ops:
        return 0.0, 0.0, 0.0, 0.0
    events = sorted([(o.start, 1) for o in ops] + [(o.end, -1) for o in ops], key=lambda e: (e[0], e[1]))
    levels = [0.0, 0.0, 0.0]
    running, t = 0, events[0][0]
    for when, delta in events:
        levels[min(running, 2)] += when - t
        running, t = running + delta, when
    span = max(o.end for o in ops) - min(o.start for o in ops)
    return span, levels[0], levels[1], levels[2]


def stream_chain(ops: list[Op]) -> float:
    """The most GPU time of one stream among ``ops`` (us): a lower bound on their critical path."""
    per: dict[int, float] = {}
    for o in ops:
        per[o.stream] = per.get(o.stream, 0.0) + o.dur
    return max(per.values(), default=0.0)


@dataclass
class StepView:
    """Per-step figures of one row (means over ``steps``); ``to_dict`` for bench.json."""

    mode: str                      # graph (replays, with topology) or eager (phases)
    steps: int
    kernel_ms: float
    span_ms: float
    none_pct: float
    one_pct: float
    two_plus_pct: float
    stream_chain_ms: float
    critical_path_ms: float | None = None
    critical_path_na: str = ""     # why there is no critical path ("" when there is one)
    path_kernels: float = 0.0      # GPU ops on the path, mean per step
    ambiguous: int = 0
    out_of_order_edges: int = 0
    graphs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        k = max(self.kernel_ms, 1e-12)
        return {"mode": self.mode, "steps": self.steps, "kernel_ms": self.kernel_ms, "span_ms": self.span_ms,
                "overlap_pct": {"none": self.none_pct, "one": self.one_pct, "two_plus": self.two_plus_pct},
                "critical_path_ms": self.critical_path_ms,
                "critical_path_pct_of_kernel": None if self.critical_path_ms is None
                else 100 * self.critical_path_ms / k,
                "critical_path_na": self.critical_path_na or None, "critical_path_ops": self.path_kernels,
                "stream_chain_ms": self.stream_chain_ms, "stream_chain_is_lower_bound": True,
                "ambiguous_matches": self.ambiguous, "out_of_order_edges": self.out_of_order_edges,
                "graphs": self.graphs}


def _op(e: dict[str, Any], kind: str) -> Op:
    args = e.get("args") or {}
    ts = float(e["ts"])
    grid, block = args.get("grid"), args.get("block")
    return Op(ts, ts + float(e.get("dur", 0.0)), int(args.get("stream", e.get("tid", -1))), kind, e.get("name", ""),
              _dims(str(grid)) if grid else None, _dims(str(block)) if block else None)


def step_ops(trace: dict[str, Any], graph_mode: bool, window: str = "bench.window") -> list[list[Op]]:
    """The GPU ops of each step in the trace, in step order (see the module docstring): per graph
    launch when ``graph_mode``, else per eager step's phases. Only launches inside ``window`` where
    the trace has that range."""
    calls: dict[Any, float] = {}    # correlation -> host time of the launching call
    launches: dict[Any, float] = {}  # the same, graph launches only
    phases: list[tuple[float, float, str]] = []
    span: tuple[float, float] | None = None
    by_corr: dict[Any, list[Op]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        ts = float(e["ts"])
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            calls.setdefault(args["correlation"], ts)
            if name in GRAPH_LAUNCHES:
                launches[args["correlation"]] = ts
        elif cat == "user_annotation":
            if name == window:
                span = (ts, ts + float(e.get("dur", 0.0)))
            elif name in STEP_PHASES:
                phases.append((ts, ts + float(e.get("dur", 0.0)), name))
        elif cat in GPU_CATS and "correlation" in args:
            by_corr.setdefault(args["correlation"], []).append(_op(e, GPU_CATS[cat]))

    def inside(t: float) -> bool:
        return span is None or span[0] <= t <= span[1]

    if graph_mode:
        return [by_corr[c] for ts, c in sorted((ts, c) for c, ts in launches.items() if inside(ts) and c in by_corr)]
    phases.sort()
    starts = [p[0] for p in phases]
    first = [i for i, p in enumerate(phases) if p[2] == "step.forward"]  # each step opens with its forward
    steps: list[list[Op]] = [[] for _ in first]
    for c, ops in by_corr.items():
        t = calls.get(c)
        if t is None or not inside(t):
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or phases[i][1] < t:
            continue  # launched outside a step's phases
        s = bisect.bisect_right(first, i) - 1
        if s >= 0:
            steps[s].extend(ops)
    return [s for s in steps if s]


def replays_graphs(trace: dict[str, Any]) -> bool:
    """The trace shows the graph strategy's replays (``graph.replay`` ranges)."""
    return any(e.get("cat") == "user_annotation" and e.get("name") == REPLAY for e in trace.get("traceEvents", []))


def analyze_steps(trace: dict[str, Any], graphs: list[Graph] | None = None) -> StepView | None:
    """The per-step view of one row (module docstring). ``graphs``: the row's dumped graphs; graph mode
    (a step per replay) with them or where the trace shows the graph strategy's replays.
    None when the trace holds no step's GPU ops (a CPU run)."""
    graph_mode = bool(graphs) or replays_graphs(trace)
    steps = step_ops(trace, graph_mode)
    if not steps:
        return None
    n = len(steps)
    kernel = span = none = one = two = chain = 0.0
    for ops in steps:
        kernel += sum(o.dur for o in ops)
        s, z, o1, o2 = concurrency(ops)
        span, none, one, two = span + s, none + z, one + o1, two + o2
        chain += stream_chain(ops)
    sp = max(span, 1e-12)
    view = StepView("graph" if graph_mode else "eager", n, kernel / n / 1e3, span / n / 1e3, 100 * none / sp,
                    100 * one / sp, 100 * two / sp, chain / n / 1e3,
                    graphs=[Path(g.path).name for g in graphs or []])
    if not graph_mode:
        view.critical_path_na = "eager steps have no graph topology"
        return view
    paths = [critical_path(graphs or [], ops) for ops in steps]
    failed = next((p for p in paths if p.us is None), None)
    if failed is not None:
        view.critical_path_na = failed.reason
        return view
    view.critical_path_ms = sum(p.us for p in paths) / n / 1e3  # type: ignore[misc]
    view.path_kernels = sum(p.nodes for p in paths) / n
    view.ambiguous = sum(p.ambiguous for p in paths)
    view.out_of_order_edges = sum(p.out_of_order_edges for p in paths)
    return view


def format_view(name: str, v: StepView | None) -> str:
    """One console line per row."""
    if v is None:
        return f"{name}: no step's GPU ops in the trace (CPU run): kernel time, span and critical path need CUDA"
    head = (f"{name}: kernels {v.kernel_ms:.2f} ms in a span of {v.span_ms:.2f} ms per step ({v.steps} "
            f"{'replays' if v.mode == 'graph' else 'steps'}); 2+ ops at once {v.two_plus_pct:.0f} % of the span "
            f"(one {v.one_pct:.0f} %, none {v.none_pct:.0f} %); ")
    chain = f"longest single-stream chain {v.stream_chain_ms:.2f} ms"
    if v.critical_path_ms is not None:
        pct = 100 * v.critical_path_ms / max(v.kernel_ms, 1e-12)
        return head + f"critical path {v.critical_path_ms:.2f} ms ({pct:.0f} % of kernel time); {chain}"
    if v.mode == "eager":
        return head + (f"critical path >= {v.stream_chain_ms:.2f} ms (a lower bound: the longest single-stream "
                       "chain; eager steps have no graph topology)")
    return head + f"critical path n/a ({v.critical_path_na}); {chain} (a lower bound)"
