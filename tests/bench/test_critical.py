"""The per-step view of ``bench --profile``: DOT parsing, mapping a replay onto its graph, the
critical path, the concurrency shares, the n/a cases and eager mode's lower bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamnmt.bench.critical import (Op, analyze_steps, concurrency, critical_path, format_view, load_dot,
                                      longest_path, parse_dot, step_ops)

DATA = Path(__file__).parent / "data"


def sample() -> tuple[str, dict]:
    return (DATA / "graph.dot").read_text(), json.loads((DATA / "trace.json").read_text())


def _node(i: int, kind: str, body: str = "") -> str:
    """A node as cudaGraphDebugDotPrint (verbose) writes it."""
    label = f"{{{kind}\n| {{ID | {i} (topoId: 0) | {body}}}\n}}"
    return f'"graph_1_node_{i}"[style="bold" shape="record" label="{label}"];\n'


def kernel_node(i: int, name: str, grid: str = "1", block: str = "32") -> str:
    return _node(i, "KERNEL", f"{name}\\<\\<\\<{grid},{block},0\\>\\>\\>")


def dot(nodes: list[str], edges: list[tuple[int, int]]) -> str:
    lines = "".join(f'"graph_1_node_{a}" -> "graph_1_node_{b}" [headlabel=0];\n' for a, b in edges)
    return ('digraph dot {\nsubgraph cluster_1 {\nlabel="graph_1" graph[style="dashed"];\n'
            + "\n".join(nodes) + "\n" + lines + "}\n}\n")


def test_dot_parser_reads_kinds_capture_ids_kernels_and_edges():
    g = parse_dot(sample()[0], "graph.dot")
    assert len(g.nodes) == 9 and g.gpu_nodes == 9
    assert sorted(n.capture_id for n in g.nodes.values()) == list(range(9))  # not the topoIds
    first = g.nodes["graph_1_node_0"]
    assert first.kind == "KERNEL" and first.name.startswith("sm80_xmma_gemm") and first.name.endswith("cublas")
    assert first.grid == (8, 8, 4) and first.block == (64, 1, 1)
    assert g.nodes["graph_1_node_1"].grid == (8, 8, 1)  # {8,8}: z defaults to 1
    assert "sin_kernel_cuda" in g.nodes["graph_1_node_6"].name and g.nodes["graph_1_node_6"].grid == (64, 1, 1)
    assert ("graph_1_node_1", "graph_1_node_6") in g.edges and ("graph_1_node_6", "graph_1_node_7") in g.edges
    assert len(g.edges) == 9
    # other node types: only kernels, memsets and copies are GPU ops
    mixed = parse_dot(dot([kernel_node(0, "k"), _node(1, "EVENT_RECORD"), _node(2, "MEMSET", "0x1"),
                           _node(3, "EMPTY"), _node(4, "MEMCPY", "0x2")], [(0, 1), (1, 2), (2, 3), (3, 4)]))
    assert [(n.kind, n.gpu) for n in mixed.nodes.values()] == [
        ("KERNEL", True), ("EVENT_RECORD", False), ("MEMSET", True), ("EMPTY", False), ("MEMCPY", True)]
    with pytest.raises(ValueError, match="no graph nodes"):
        parse_dot("digraph dot {\n}\n", "empty.dot")


def test_sample_replays_map_onto_the_graph_and_give_its_critical_path():
    text, trace = sample()
    g = parse_dot(text, "graph.dot")
    replays = step_ops(trace, graph_mode=True)
    assert [len(r) for r in replays] == [9, 9]
    for ops in replays:
        res = critical_path([g], ops)
        # the side branch (mul, clamp, two GEMMs) is longer than sin, which ran alone on a second stream:
        # the path is every kernel but sin, summed from the trace's durations
        side = [o for o in ops if "sin_kernel_cuda" in o.name]
        assert len(side) == 1 and side[0].stream != ops[0].stream
        assert res.us == pytest.approx(sum(o.dur for o in ops) - side[0].dur)
        assert res.nodes == 8 and res.reason == "" and res.out_of_order_edges == 0
    v = analyze_steps(trace, [g])
    assert v.mode == "graph" and v.steps == 2 and v.critical_path_na == ""
    kernel = [sum(o.dur for o in ops) for ops in replays]
    spans = [max(o.end for o in ops) - min(o.start for o in ops) for ops in replays]
    assert v.kernel_ms == pytest.approx(sum(kernel) / 2e3) and v.span_ms == pytest.approx(sum(spans) / 2e3)
    # 2+ at once: while sin ran beside the main stream's kernels (pairwise intersections)
    beside = sum(max(0.0, min(s.end, o.end) - max(s.start, o.start))
                 for ops in replays for s in ops if "sin_kernel" in s.name for o in ops if o is not s)
    assert v.two_plus_pct == pytest.approx(100 * beside / sum(spans))
    assert v.none_pct + v.one_pct + v.two_plus_pct == pytest.approx(100)
    assert v.critical_path_ms < v.kernel_ms and v.critical_path_ms <= v.span_ms
    d = v.to_dict()
    assert d["critical_path_pct_of_kernel"] == pytest.approx(100 * v.critical_path_ms / v.kernel_ms)
    line = format_view("graph", v)
    assert "critical path" in line and "n/a" not in line and f"{d['critical_path_pct_of_kernel']:.0f} %" in line


def test_longest_path_takes_the_heavier_side_of_a_fork_and_join():
    # 0 -> 1 -> 2 -> 5 (a chain) beside 0 -> 3 -> 4 -> 5 (a branch), joined through an EMPTY node 6
    nodes = [kernel_node(i, f"k{i}") for i in (0, 1, 2, 3, 4, 5)] + [_node(6, "EMPTY")]
    g = parse_dot(dot(nodes, [(0, 1), (1, 2), (2, 6), (0, 3), (3, 4), (4, 6), (6, 5)]))
    w = {f"graph_1_node_{i}": d for i, d in enumerate([1.0, 2.0, 2.0, 5.0, 1.0, 1.0])}
    us, path = longest_path(g, w)
    assert us == pytest.approx(1 + 5 + 1 + 1) and path == ["graph_1_node_0", "graph_1_node_3", "graph_1_node_4",
                                                         "graph_1_node_6", "graph_1_node_5"]
    w["graph_1_node_1"] = 4.0  # now the chain weighs more
    us, path = longest_path(g, w)
    assert us == pytest.approx(1 + 4 + 2 + 1) and "graph_1_node_3" not in path
    # through the trace: the branch on stream 2 beside the chain on stream 1; names in trace form
    ops = [Op(0, 1, 1, "kernel", "k0"), Op(1, 3, 1, "kernel", "k1"), Op(1, 6, 2, "kernel", "k3"),
           Op(3, 5, 1, "kernel", "k2"), Op(6, 7, 2, "kernel", "k4"), Op(7, 8, 1, "kernel", "k5")]
    res = critical_path([g], ops)
    assert res.us == pytest.approx(1 + 5 + 1 + 1) and res.nodes == 4


def test_concurrency_shares_of_overlapping_ops():
    ops = [Op(0, 10, 1, "kernel", "a"), Op(5, 15, 2, "kernel", "b"), Op(20, 30, 1, "kernel", "c"),
           Op(22, 24, 3, "kernel", "d"), Op(23, 26, 2, "kernel", "e")]
    span, none, one, two = concurrency(ops)
    # 0-5 one, 5-10 two, 10-15 one, 15-20 none, 20-22 one, 22-26 two or three, 26-30 one
    assert (span, none, one, two) == pytest.approx((30, 5, 16, 9))
    assert concurrency([Op(0, 1, 1, "kernel", "a"), Op(1, 2, 2, "kernel", "b")])[3] == 0  # back to back


def test_critical_path_is_na_when_counts_or_names_disagree(tmp_path):
    text, trace = sample()
    ops = step_ops(trace, graph_mode=True)[0]
    fewer = text.replace('"graph_1_node_8" -> ', '"graph_1_node_7" -> ')  # drop node 8 and its edge
    start = fewer.index('"graph_1_node_8"[')
    fewer = fewer[:start] + fewer[fewer.index('"];', start) + 3:]
    res = critical_path([parse_dot(fewer, "fewer.dot")], ops)
    assert res.us is None and "ran 9 GPU ops" in res.reason and "has 8" in res.reason
    renamed = parse_dot(text.replace("15sin_kernel_cuda", "15cos_kernel_cuda"), "renamed.dot")
    res = critical_path([renamed], ops)
    assert res.us is None and "agrees with no node" in res.reason
    path = tmp_path / "graph_0.dot"
    path.write_text(text.replace("{8,8,4\\}", "{8,8,2\\}"))  # a grid the replay did not run
    v = analyze_steps(trace, [load_dot(path)])
    assert v.critical_path_ms is None and v.critical_path_na and v.kernel_ms > 0
    line = format_view("graph", v)
    assert "critical path n/a (" in line and "lower bound" in line
    assert v.to_dict()["critical_path_na"] == v.critical_path_na
    assert critical_path([], ops).reason == "no graph topology was dumped"


def _trace(events: list[tuple]) -> dict:
    return {"traceEvents": [{"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d, "args": a, "pid": 0, "tid": 0}
                            for c, n, ts, d, a in events]}


def test_eager_steps_give_the_longest_single_stream_chain_as_a_lower_bound():
    def launch(ts, corr):
        return ("cuda_runtime", "cudaLaunchKernel", ts, 1, {"correlation": corr})

    def kernel(ts, dur, stream, corr):
        return ("kernel", f"k{corr}", ts, dur, {"stream": stream, "correlation": corr})

    trace = _trace([
        ("user_annotation", "bench.window", 0, 200, {}),
        ("user_annotation", "step.forward", 0, 10, {}), ("user_annotation", "step.backward", 10, 10, {}),
        ("user_annotation", "step.optimizer", 20, 5, {}),
        launch(1, 1), kernel(30, 10, 7, 1), launch(11, 2), kernel(35, 20, 8, 2), launch(21, 3), kernel(55, 5, 7, 3),
        launch(28, 4), kernel(61, 50, 7, 4),  # launched between the steps' phases: not a step's
        ("user_annotation", "step.forward", 100, 10, {}), ("user_annotation", "step.optimizer", 110, 5, {}),
        launch(101, 5), kernel(120, 4, 9, 5), launch(111, 6), kernel(125, 6, 9, 6),
    ])
    steps = step_ops(trace, graph_mode=False)
    assert [sorted(o.name for o in s) for s in steps] == [["k1", "k2", "k3"], ["k5", "k6"]]
    v = analyze_steps(trace)
    assert v.mode == "eager" and v.steps == 2 and v.critical_path_ms is None
    # step 1: stream 7 ran 10 + 5, stream 8 ran 20; step 2: stream 9 ran 4 + 6
    assert v.stream_chain_ms == pytest.approx((20 + 10) / 2 / 1e3)
    assert v.kernel_ms == pytest.approx((35 + 10) / 2 / 1e3) and v.span_ms == pytest.approx((30 + 11) / 2 / 1e3)
    line = format_view("resident", v)
    assert f">= {v.stream_chain_ms:.2f} ms" in line and "lower bound" in line
    assert v.to_dict()["stream_chain_is_lower_bound"] and v.to_dict()["critical_path_ms"] is None
    assert analyze_steps(_trace([("cpu_op", "aten::mm", 0, 5, {})])) is None  # a CPU run


def test_a_copy_the_driver_runs_as_a_kernel_agrees_with_its_copy_node():
    from streamnmt.bench.critical import Node, agrees

    copy, fill = Node("n0", "MEMCPY", 0), Node("n1", "MEMSET", 1)
    assert agrees(copy, Op(0, 1, 1, "kernel", "memcpy32_post")) and agrees(copy, Op(0, 1, 1, "memcpy", "Memcpy DtoD"))
    assert agrees(fill, Op(0, 1, 1, "kernel", "memset32_aligned"))
    assert not agrees(copy, Op(0, 1, 1, "kernel", "vectorized_elementwise_kernel"))
    assert not agrees(fill, Op(0, 1, 1, "kernel", "memcpy32_post"))
