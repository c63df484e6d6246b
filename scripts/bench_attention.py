"""Attention alone at the packed training shape, on CUDA: SDPA with additive dense masks (the model's
default path) against FlexAttention block masks at block sizes 128, 64 and 32 and against the Triton
segment kernels (``--attention triton``, variant ``triton``).

Forward + backward of 6 layers x (encoder self, causal decoder self, cross) on the segment ids of
real packed batches (base-model heads, bf16, ``--max-tokens 16384 --max-len 128``, the bench's
32,000 random ids). Prints one JSON line per batch: ms of attention per training step for each
variant, eager and (``_graph``) replayed from a CUDA graph as the trainer runs it (an error string
where a variant did not compile), the mask build times, and flex's
largest difference from SDPA on real positions.

Usage: python3 scripts/bench_attention.py builtin|DATA_DIR [VARIANT,...] [BATCHES] [MAX_TOKENS]
(PERFORMANCE.md, "Attention"; MAX_TOKENS default 16384). Variant ``triton`` is the Triton segment
kernels at their default tiles, ``triton-QxK[-wW-sS]`` at other tiles and launch settings (e.g.
``triton-64x32-w8``); each also prints the share of the tiles its forward visits per attention
(``_visited``) and its largest difference from SDPA on real positions over the three outputs.
VARIANT ``widths`` alone: SDPA at the same positions in rows of 32-128 (:func:`width_sweep`).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from streamnmt.bench.synthvocab import random_tokens
from streamnmt.data import DataConfig, prepare_data
from streamnmt.data.loader import make_loader
from streamnmt.syncstats import host_sync
from streamnmt.models.attention import dense_masks, flex_masks, segment_masks
from streamnmt.models.segments import visited_fraction

HEADS, HEAD_DIM, LAYERS = 8, 64, 6
# (name, block size, kernel options, autotuned): flex's defaults at 128; smaller blocks need kernel tiles
# that divide them. On sm90 at head dim 64 Inductor's one default backward tile is (64, 128, 128, 64),
# and a tile that does not divide the block size is dropped before kernel_options apply, so blocks
# under 128 compile only with max-autotune's wider list of tiles ("tuned").
FLEX_VARIANTS = (
    ("flex128", 128, None, False),
    ("flex64", 64, {"BLOCK_M": 64, "BLOCK_N": 64}, False),
    ("flex32", 32, {"BLOCK_M": 32, "BLOCK_N": 32, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32,
                    "bwd_BLOCK_N2": 32}, False),
    ("flex64-tuned", 64, None, True),
    ("flex32-tuned", 32, None, True),
)


def wait(why: str) -> None:
    """Block the host until the GPU is idle, counted (streamnmt's one place for host syncs)."""
    host_sync(f"bench_attention.{why}", lambda: torch.cuda.synchronize())


def cuda_ms(fn, repeats: int = 10) -> float:
    """Mean ms of ``fn`` on the GPU after 3 warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wait("timing")  # needed: the timed calls start on an idle GPU
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    wait("timing")  # needed: elapsed_time reads both events, so the calls must be done
    return start.elapsed_time(end) / repeats


def graph_ms(step, masks, make_calls, repeats: int = 20) -> float:
    """Mean ms of one replay of ``step`` captured in a CUDA graph: the GPU's time for the kernels
    without the host's launch cost, as the trainer runs them (its step replays from a graph). The
    eager timing (``cuda_ms``) of small kernels is the host's launch time. Fresh leaves are made on
    the capture stream: a leaf's gradient node keeps the stream of its first backward
    (pytorch/pytorch#137483), and a stream outside the capture cannot join it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls = make_calls()
        for _ in range(3):
            step(masks, calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step(masks, calls)
    torch.cuda.current_stream().wait_stream(stream)
    ms = cuda_ms(graph.replay, repeats)
    del graph
    return ms


def measure(src_seg: torch.Tensor, tgt_seg: torch.Tensor, plain_flex, tuned_flex, only: set[str]) -> dict:
    dev = src_seg.device
    b, s = src_seg.shape
    t = tgt_seg.size(1)

    def make_calls():
        def qkv(tq: int, tk: int) -> list[torch.Tensor]:
            return [torch.randn(b, HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
                    for n in (tq, tk, tk)]

        grad_s = torch.randn(b, HEADS, s, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        grad_t = torch.randn(b, HEADS, t, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        return ((qkv(s, s), grad_s), (qkv(t, t), grad_t), (qkv(t, s), grad_t))

    calls = make_calls()

    def step(attend, masks, on=calls) -> None:
        for _ in range(LAYERS):
            for (inputs, grad), mask in zip(on, masks):
                attend(inputs, mask).backward(grad)

    dense = dense_masks(src_seg, tgt_seg, torch.bfloat16)
    sdpa = lambda inputs, mask: F.scaled_dot_product_attention(*inputs, attn_mask=mask)  # noqa: E731
    row = {"shape": [b, s, t], "sdpa": cuda_ms(lambda: step(sdpa, dense)),
           "sdpa_graph": graph_ms(lambda m, c: step(sdpa, m, c), dense, make_calls),
           "sdpa_masks": cuda_ms(lambda: dense_masks(src_seg, tgt_seg, torch.bfloat16))}

    for name in sorted(n for n in only if n.startswith("triton")) if only else ["triton"]:
        row.update(measure_triton(name, src_seg, tgt_seg, step, sdpa, dense, calls, make_calls))
    for name, size, options, tuned in FLEX_VARIANTS:
        if only and name not in only:
            continue
        kw = {} if options is None else {"kernel_options": options}
        flex = tuned_flex if tuned else plain_flex

        def blocks():
            return flex_masks(src_seg, tgt_seg, block_size=size)

        try:
            block_masks = blocks()
            attend = lambda inputs, mask: flex(*inputs, block_mask=mask, **kw)  # noqa: E731
            began = time.time()
            step(attend, block_masks)
            wait("compile")  # needed: the first call's wall time (compiling) includes its kernels
            first_s = time.time() - began
            real = (src_seg > 0)[:, None, :, None]
            enc_in = calls[0][0]  # the encoder self-attention's q, k, v
            diff = (attend(enc_in, block_masks[0]) - sdpa(enc_in, dense[0])).abs() * real
            # needed: the largest difference is printed from the host
            max_diff = host_sync("bench_attention.check", lambda: diff.max().item())
            row.update({name: cuda_ms(lambda: step(attend, block_masks)), f"{name}_masks": cuda_ms(blocks),
                        f"{name}_max_diff": max_diff, f"{name}_first_s": first_s})
        except Exception as e:  # a variant Inductor cannot compile: say so, measure the others
            row[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    return row


def measure_triton(name, src_seg, tgt_seg, step, sdpa, dense, calls, make_calls) -> dict:
    """The Triton segment kernels in the same step: ms (eager, and replayed from a CUDA graph:
    ``_graph``), the ranges' build ms, the share of tiles visited, the first call's seconds (Triton
    compiling), and the largest difference from SDPA.
    ``name``: ``triton`` (the default tiles) or ``triton-QxK[-wW-sS]`` (tiles and launch settings)."""
    try:
        from streamnmt.models import segattn_triton
        from streamnmt.models.segattn_triton import Tiles, segment_attention

        tiles = Tiles.parse(name.split("-", 1)[1]) if "-" in name else Tiles()
        segattn_triton.set_tiles(tiles)

        def ranges():
            m = segment_masks("triton", src_seg, tgt_seg, src_seg, tgt_seg)
            return m.enc, m.dec, m.cross

        masks = ranges()
        attend = lambda inputs, r: segment_attention(*inputs, r)  # noqa: E731
        began = time.time()
        step(attend, masks)
        wait("compile")  # needed: the first call's wall time (Triton compiling) includes its kernels
        first_s = time.time() - began
        real = {"enc": (src_seg > 0), "dec": (tgt_seg > 0), "cross": (tgt_seg > 0)}
        diffs = [((attend(inputs, r) - sdpa(inputs, d)).abs() * real[n][:, None, :, None]).max()
                 for n, (inputs, _), r, d in zip(real, calls, masks, dense)]
        # needed: the largest difference and the visited shares are printed from the host
        max_diff, visited = host_sync("bench_attention.check", lambda: (
            torch.stack(diffs).max().item(),
            [round(visited_fraction(r, tiles.query, tiles.key).item(), 4) for r in masks]))
        return {name: cuda_ms(lambda: step(attend, masks)),
                f"{name}_graph": graph_ms(lambda m, c: step(attend, m, c), masks, make_calls),
                f"{name}_masks": cuda_ms(ranges),
                f"{name}_visited": dict(zip(real, visited)), f"{name}_max_diff": max_diff, f"{name}_first_s": first_s}
    except Exception as e:  # a kernel that does not compile here: say so, measure the others
        return {name: f"error: {type(e).__name__}: {str(e)[:300]}"}


def width_sweep(src_seg: torch.Tensor, tgt_seg: torch.Tensor, widths=(32, 48, 64, 96, 128)) -> dict:
    """SDPA with dense masks at the same number of positions in rows of other widths: what attention
    would cost if short pairs were packed into narrower rows (a second packed shape). Segments are
    synthetic here (rows cut into pairs of the batch's mean pair length), so the row width alone
    changes between the entries. ms of attention per step, forward + backward as in ``measure``."""
    dev = src_seg.device
    b, s = src_seg.shape
    t = tgt_seg.size(1)
    # needed: the batch's pair count and positions, on the host, to lay out the synthetic rows
    pairs, src_pos, tgt_pos = host_sync("bench_attention.pairs", lambda: (
        int(src_seg.max(dim=1).values.sum()), int((src_seg > 0).sum()), int((tgt_seg > 0).sum())))
    src_len, tgt_len = max(src_pos // max(pairs, 1), 1), max(tgt_pos // max(pairs, 1), 1)
    row: dict = {"mean_pair": [src_len, tgt_len]}
    for w in widths:
        if w < max(src_len, tgt_len):
            continue
        rows = max((b * max(s, t)) // w, 1)

        def segs(length: int) -> torch.Tensor:
            cols = torch.arange(w, device=dev)
            per = w // length
            seg = torch.where(cols < per * length, cols // length + 1, torch.zeros_like(cols))
            return seg.expand(rows, w).contiguous()

        ss, ts = segs(src_len), segs(tgt_len)
        masks = dense_masks(ss, ts, torch.bfloat16)
        calls = []
        for n_q, n_k, grad_n in ((w, w, w), (w, w, w), (w, w, w)):
            inputs = [torch.randn(rows, HEADS, n, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
                      for n in (n_q, n_k, n_k)]
            calls.append((inputs, torch.randn(rows, HEADS, grad_n, HEAD_DIM, device=dev, dtype=torch.bfloat16)))

        def step() -> None:
            for _ in range(LAYERS):
                for (inputs, grad), mask in zip(calls, masks):
                    F.scaled_dot_product_attention(*inputs, attn_mask=mask).backward(grad)

        row[f"w{w}"] = {"rows": rows, "ms": cuda_ms(step)}
    return row


def main() -> None:
    torch.manual_seed(0)
    data = None if sys.argv[1] == "builtin" else sys.argv[1]
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else set()  # variant names (default: all)
    batches = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 16384
    cfg = DataConfig(data=data, max_tokens=max_tokens, max_len=128, builtin_size=40000)
    bundle = prepare_data(cfg, log=lambda line: None)
    loader = make_loader(random_tokens(bundle.train, 32000, 0), cfg, train=True, seed=0, pin_memory=False)
    plain = torch.compile(flex_attention, dynamic=False)
    tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
    source = iter(loader)
    for _ in range(batches):
        batch = next(source)
        if only == {"widths"}:
            print(json.dumps(width_sweep(batch.src_seg.cuda(), batch.tgt_seg.cuda())), flush=True)
            continue
        print(json.dumps(measure(batch.src_seg.cuda(), batch.tgt_seg.cuda(), plain, tuned, only)), flush=True)


if __name__ == "__main__":
    main()
