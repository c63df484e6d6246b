"""Bounds on what overlapping the update with the step can buy (GPU only; one graph per variant).

Captures the packed base model's training step (bf16, vocabulary 32k, compiled) as CUDA graphs in
variants and times their replays:

* ``step``: today's graph mode: forward, backward, gradient norm, fused Adam, gradients set to None;
* ``no-update``: the same without Adam: the step's time if the update were hidden completely;
* ``static-grads``: gradients kept in place between steps (backward accumulates into them, zeroed
  after Adam), which an update deferred into the next replay needs: the cost of that;
* ``side-update``: static gradients, and Adam on a second stream beside the forward and backward,
  without the per-layer waits a correct schedule needs (numbers meaningless, timing only): an upper
  bound on the overlap with the GPU shared between the two streams;
* ``update-only``: Adam and the zeroing alone.

Usage: PYTHONPATH=src python3 scripts/overlap_probe.py [--tokens 4096] [--replays 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def build(shape, attention: str, compile: bool, seed: int = 0):
    from streamnmt.models.transformer import Transformer
    from streamnmt.training.step import make_step

    torch.manual_seed(seed)
    model = Transformer(shape).cuda()
    model.set_attention(attention)
    return make_step(model, torch.device("cuda"), d_model=shape.d_model, amp="bf16", clip=1.0,
                     label_smoothing=0.1, compile=compile, shapes=1)


def capture(step, static, body, warmup: int = 3) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body(step, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        body(step, static)
    torch.cuda.synchronize()
    return graph


def fwd_bwd(step, static) -> None:
    loss = step.forward(static)
    step.backward(loss)


def norm_only(step) -> torch.Tensor:
    grads = [p.grad for p in step.params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, foreach=True)


def body_step(step, static) -> None:
    fwd_bwd(step, static)
    step.optimizer_step()


def body_no_update(step, static) -> None:
    fwd_bwd(step, static)
    step.stats[0].copy_(norm_only(step))
    step.optimizer.zero_grad(set_to_none=True)


def body_update_only(step, static) -> None:
    step.optimizer.grad_scale = step._fixed_scale
    step.optimizer.found_inf = step._fixed_inf
    step.optimizer.step()
    step.optimizer.zero_grad(set_to_none=False)


def body_side_update(step, static) -> None:
    main = torch.cuda.current_stream()
    side = step._side
    side.wait_stream(main)
    with torch.cuda.stream(side):
        body_update_only(step, static)
    fwd_bwd(step, static)
    step.stats[0].copy_(norm_only(step))
    main.wait_stream(side)


def time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--src-width", type=int, default=144)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--variants", default="step,no-update,static-grads,side-update,update-only")
    args = ap.parse_args()

    from streamnmt.models.attention import resolve_attention
    from streamnmt.models.transformer import ModelShape
    from streamnmt.training.step import example_batch
    from streamnmt.engine.base import move

    shape = ModelShape(32000, 32000)
    attention = resolve_attention("auto", torch.device("cuda"), print, head_dim=64)
    rows = args.tokens // args.max_len
    batch = example_batch((rows, args.src_width, args.max_len), shape, seed=0, packed=True)
    bodies = {"step": body_step, "no-update": body_no_update, "static-grads": body_step,
              "side-update": body_side_update, "update-only": body_update_only}
    graphs, keep = {}, []  # the steps and static batches live as long as the graphs that read them
    for name in args.variants.split(","):
        step = build(shape, attention, not args.no_compile)
        static = move(batch, torch.device("cuda"))
        if name in ("static-grads", "side-update", "update-only"):
            step.grads_to_none = False
            for p in step.params:
                p.grad = torch.zeros_like(p)
            step._fixed_scale = torch.ones((), device="cuda")
            step._fixed_inf = torch.zeros((), device="cuda")
            step._side = torch.cuda.Stream()
        if name == "update-only":  # Adam's state exists before its graph is captured
            capture(step, static, body_step, warmup=1)
        graphs[name] = capture(step, static, bodies[name])
        keep.append((step, static))
        print(f"captured {name}", flush=True)
    times = {name: [] for name in graphs}
    for _ in range(args.repeats):
        for name, graph in graphs.items():  # interleaved, so drift touches every variant alike
            times[name].append(time_graph(graph, args.replays))
    base = statistics.median(times["step"]) if "step" in times else None
    print(f"\n{'variant':14s} {'ms/step (median [min-max])':30s} vs step")
    for name, ts in times.items():
        med = statistics.median(ts)
        rel = f"{base / med:.3f}x" if base else ""
        print(f"{name:14s} {med:7.3f} [{min(ts):.3f}-{max(ts):.3f}]{'':10s} {rel}")


if __name__ == "__main__":
    main()
