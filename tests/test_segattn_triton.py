"""--attention triton: the segment ranges cover exactly the masks' pairs, the kernels equal dense-mask
attention (outputs and gradients) on packed batches, and a packed model trains alike with them.

The kernels run on the CPU under Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``,
which Triton reads when the kernels are defined); skipped where Triton is not installed. The GPU
tests (bf16 and fp32, CUDA graph capture, torch.compile) carry the ``gpu`` marker.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamnmt.data.packbatch import collate_packed
from streamnmt.data.packing import PackSampler
from streamnmt.models.attention import dense_masks, segment_masks
from streamnmt.models.segments import segment_ranges, visited_fraction
from tests.data.test_packing import corpus_of

ROOT = Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def packed_segments(rows: int = 3, width: tuple[int, int] = (96, 64), longest: int = 24, seed: int = 0):
    """(src_seg, tgt_seg) of one packed batch of the packer's own making (pairs of 1..longest-1 tokens)."""
    rng = np.random.default_rng(seed)
    pairs = [(list(rng.integers(4, 50, rng.integers(1, longest))), list(rng.integers(4, 50, rng.integers(1, longest))))
             for _ in range(12 * rows)]
    corpus = corpus_of(pairs)
    (plan,) = PackSampler(corpus.src_lengths, corpus.tgt_lengths, (rows, *width), shuffle=False).plan(0)[:1]
    b = collate_packed(corpus, plan).to_batch()
    return b.src_seg, b.tgt_seg


def attentions(src_seg, tgt_seg):
    """name -> (ranges, the dense boolean mask (B, Tq, Tk)) of the model's three attentions."""
    enc, dec, cross = dense_masks(src_seg, tgt_seg)
    m = segment_masks("triton", src_seg, tgt_seg, src_seg, tgt_seg)
    return {"enc": (m.enc, enc[:, 0]), "dec": (m.dec, dec[:, 0]), "cross": (m.cross, cross[:, 0])}


def test_ranges_cover_exactly_the_pairs_the_masks_allow():
    src_seg, tgt_seg = packed_segments()
    assert (tgt_seg == 0).any() and (src_seg == 0).any()  # padding on both sides: its rules are covered
    for name, (r, allowed) in attentions(src_seg, tgt_seg).items():
        _, tq, tk = allowed.shape
        q = torch.arange(tq)[None, :, None]
        k = torch.arange(tk)[None, None, :]
        in_range = (k >= r.lo.long()[:, :, None]) & (k < r.hi.long()[:, :, None])
        assert not (allowed & ~in_range).any(), name  # every allowed key lies in its query's range
        key_side = ((q >= r.qlo.long()[:, None, :]) & (q < r.qhi.long()[:, None, :])) | (
            (q >= r.elo.long()[:, None, :]) & (q < r.ehi.long()[:, None, :]))
        assert not (allowed & ~key_side).any(), name  # and every allowed query in its key's ranges
        main = (q >= r.qlo.long()[:, None, :]) & (q < r.qhi.long()[:, None, :])
        extra = (q >= r.elo.long()[:, None, :]) & (q < r.ehi.long()[:, None, :])
        assert not (allowed & main & extra).any(), name  # no allowed pair counted twice in the backward
        assert r.causal == (name == "dec") and r.cross == (name == "cross")


def _ranges_by_id(q_seg, k_seg, causal, cross):
    """Reference bounds: each segment id's first and last position by a scatter, looked up per
    position (what ``segment_ranges`` computed before its masked reductions)."""
    tq, tk = q_seg.size(1), k_seg.size(1)
    n_ids = max(tq, tk) + 1

    def first_last(seg):
        b, t = seg.shape
        ids, pos = seg.long(), torch.arange(t).expand(b, t)
        return (torch.full((b, n_ids), t).scatter_reduce(1, ids, pos, "amin"),
                torch.full((b, n_ids), -1).scatter_reduce(1, ids, pos, "amax"))

    (kf, kl), (qf, ql) = first_last(k_seg), first_last(q_seg)
    lo, hi = kf.gather(1, q_seg.long()), kl.gather(1, q_seg.long()) + 1
    qlo, qhi = qf.gather(1, k_seg.long()), ql.gather(1, k_seg.long()) + 1
    if causal:
        hi, qlo = torch.minimum(hi, torch.arange(1, tq + 1)), torch.maximum(qlo, torch.arange(tk))
    elo, ehi = torch.full_like(qlo, tq), torch.zeros_like(qhi)
    if cross:
        pad_q, real_k = q_seg == 0, k_seg != 0
        lo, hi = lo.masked_fill(pad_q, 0), hi.masked_fill(pad_q, tk)
        elo, ehi = torch.where(real_k, qf[:, :1], elo), torch.where(real_k, ql[:, :1] + 1, ehi)
    return lo, hi, qlo, qhi, elo, ehi


def test_ranges_equal_the_bounds_of_each_segment_id():
    """The masked reductions give each position exactly its id's first and last position on the other
    side (then the causal and padding rules): packed rows, ids out of order and split in two, a row
    of padding only, and ids present on one side only."""
    odd_src = torch.tensor([[2, 2, 1, 1, 2, 0, 0, 0], [0] * 8, [1, 1, 3, 3, 3, 3, 0, 0]])
    odd_tgt = torch.tensor([[1, 2, 2, 0, 0, 0], [0] * 6, [1, 2, 2, 3, 0, 0]])
    for src_seg, tgt_seg in (packed_segments(seed=1), packed_segments(rows=2, width=(64, 48), seed=2),
                             (odd_src, odd_tgt)):
        for q, k, causal, cross in ((src_seg, src_seg, False, False), (tgt_seg, tgt_seg, True, False),
                                    (tgt_seg, src_seg, False, True)):
            r = segment_ranges(q, k, causal=causal, cross=cross)
            got = [r.lo, r.hi, r.qlo, r.qhi, r.elo, r.ehi]
            for what, x, y in zip(("lo", "hi", "qlo", "qhi", "elo", "ehi"), got, _ranges_by_id(q, k, causal, cross)):
                assert x.dtype == torch.int32 and torch.equal(x.long(), y), (what, causal, cross, x, y)


def test_the_kernels_visit_a_fraction_of_the_tiles_at_a_packed_shape():
    """Rows of 256 source and 128 target positions holding pairs of 1-40 tokens: the forward visits
    under half of the tiles of 32 x 32 positions (dense masks compute all of them)."""
    src_seg, tgt_seg = packed_segments(rows=4, width=(256, 128), longest=40)
    for name, (r, _) in attentions(src_seg, tgt_seg).items():
        share = float(visited_fraction(r, 32, 32))
        assert 0.0 < share < 0.5, (name, share)


def test_ranges_of_a_row_without_pairs_are_empty_for_real_ids():
    seg = torch.zeros(1, 8, dtype=torch.long)
    r = segment_ranges(seg, seg, causal=True, cross=False)
    assert r.lo.tolist() == [[0] * 8] and r.hi.tolist() == [list(range(1, 9))]  # padding sees padding, causally


def _attention_mismatches(dtype=torch.float32, device="cpu", tol=1e-5, tiles: str = "32x32", rows: int = 3,
                          heads: int = 2) -> list[tuple]:
    """The kernels' outputs and gradients against dense-mask SDPA's: (attention, tensor, largest
    error) of each that differs by more than ``tol`` (relative to the largest value, at least 1), on a
    packed batch of ``rows`` rows of 96 source and 64 target positions (pairs split by tile edges,
    padding on both sides, a last tile of each size that is cut short) and ``heads`` heads."""
    from streamnmt.models import segattn_triton
    from streamnmt.models.segattn_triton import Tiles, segment_attention

    segattn_triton.set_tiles(Tiles.parse(tiles))

    torch.manual_seed(0)
    src_seg, tgt_seg = (s.to(device) for s in packed_segments(rows=rows))
    bad = []
    for name, (r, allowed) in attentions(src_seg, tgt_seg).items():
        b, tq, tk = allowed.shape
        q, k, v = (torch.randn(b, heads, n, 16, device=device, dtype=dtype, requires_grad=True) for n in (tq, tk, tk))
        out = segment_attention(q, k, v, r)
        grad = torch.randn_like(out)
        got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
        ref_out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        ref = [ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad)]
        for what, x, y in zip(("out", "dq", "dk", "dv"), got, ref):
            err = (x.float() - y.float()).abs().max().item()
            if not err <= tol * max(1.0, y.float().abs().max().item()):
                bad.append((name, what, err))
    return bad


def _check_packed_model_equals_sdpa() -> None:
    """A tiny packed model: the same loss and gradients with the Triton kernels as with SDPA, eager
    and compiled (one row of several pairs, padding on both sides)."""
    from streamnmt.models.transformer import make_model

    src_seg, tgt_seg = packed_segments(rows=1, width=(64, 48))
    assert (src_seg == 0).any() and (tgt_seg == 0).any() and int(tgt_seg.max()) > 1
    src = torch.where(src_seg > 0, 7 + src_seg % 40, 0)
    tgt = torch.where(tgt_seg > 0, 9 + tgt_seg % 40, 0)
    pos = [torch.arange(s.size(1)).expand_as(s) for s in (src_seg, tgt_seg)]
    grads = {}
    for kind in ("sdpa", "triton"):
        torch.manual_seed(0)
        model = make_model(60, 60, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.0, max_positions=64)
        model.set_attention(kind)
        logits = model(src, tgt, src != 0, segments=(src_seg, tgt_seg, *pos))
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
        loss.backward()
        grads[kind] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (l1, g1), (l2, g2) = grads["sdpa"], grads["triton"]
    assert torch.allclose(l1, l2, atol=1e-5), (l1, l2)
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5, rtol=1e-4), n
    # under torch.compile (one graph: the custom op is opaque, its backward registered) the same again
    torch.manual_seed(0)
    model = make_model(60, 60, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.0, max_positions=64)
    model.set_attention("triton")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    logits = compiled(src, tgt, src != 0, segments=(src_seg, tgt_seg, *pos))
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=0)
    loss.backward()
    assert torch.allclose(loss.detach(), l2, atol=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, g2[n], atol=1e-6), n


def _check_probe() -> None:
    """The set-up's build check runs forward and backward: the gradient of x used as q, k and v in one
    segment equals SDPA's."""
    from streamnmt.models.attention import triton_probe

    state = torch.get_rng_state()
    got = triton_probe(torch.device("cpu"), torch.float32, 16)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream untouched
    x = torch.randn(1, 1, 32, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    F.scaled_dot_product_attention(x, x, x).float().sum().backward()
    assert torch.allclose(got, x.grad, atol=1e-5), (got - x.grad).abs().max()


def _check_eager_needs_no_torchdynamo() -> None:
    """A tiny packed model trains a step with the Triton kernels and with SDPA, and the set-up's build
    check runs, without importing TorchDynamo (the custom op's first call would)."""
    from streamnmt.models.attention import triton_probe
    from streamnmt.models.transformer import make_model

    src_seg, tgt_seg = packed_segments(rows=1, width=(64, 48))
    src, tgt = torch.where(src_seg > 0, 7 + src_seg % 40, 0), torch.where(tgt_seg > 0, 9 + tgt_seg % 40, 0)
    pos = [torch.arange(s.size(1)).expand_as(s) for s in (src_seg, tgt_seg)]
    triton_probe(torch.device("cpu"), torch.float32, 16)
    for kind in ("sdpa", "triton"):
        model = make_model(60, 60, d_model=32, n_layers=1, n_heads=1, d_ff=64, dropout=0.0, max_positions=64)
        model.set_attention(kind)
        model(src, tgt, src != 0, segments=(src_seg, tgt_seg, *pos)).float().logsumexp(-1).mean().backward()
    assert "torch._dynamo" not in sys.modules, "an eager model imported TorchDynamo"


def _check_function_equals_custom_op(dtype=torch.float32) -> None:
    """The autograd Function (eager) and the custom op (compiled) give identical outputs and gradients."""
    from streamnmt.models.segattn_triton import segment_attention, segment_attention_op

    torch.manual_seed(0)
    src_seg, tgt_seg = packed_segments(rows=1, width=(64, 48))
    for name, (r, allowed) in attentions(src_seg, tgt_seg).items():
        b, tq, tk = allowed.shape
        q, k, v = (torch.randn(b, 1, n, 16, dtype=dtype, requires_grad=True) for n in (tq, tk, tk))
        grad = torch.randn(b, 1, tq, 16, dtype=dtype)
        results = []
        for entry in (segment_attention, segment_attention_op):
            out = entry(q, k, v, r)
            results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
        for what, x, y in zip(("out", "dq", "dk", "dv"), *results):
            assert x.shape == y.shape and x.stride() == y.stride() and torch.equal(x, y), (name, what)


def _interpreted_checks() -> list[tuple[str, object]]:
    """The checks that run under Triton's interpreter, in this order, in one fresh process (its start-up,
    Triton's import and the interpreter's set-up paid once): the first comes before anything imports
    TorchDynamo (the custom op's first call, torch.compile)."""
    def no_mismatch(**kw):
        return lambda: _assert_empty(_attention_mismatches(rows=2, **kw))

    # the other types and tiles with one head: two heads' offsets are checked at fp32 (and in the model)
    return [("eager without TorchDynamo", _check_eager_needs_no_torchdynamo),
            ("fp32", no_mismatch()),
            # fp16 too (a half type's casts of p and dS); not bf16: the interpreter computes it wrongly
            # (numpy has no bf16), which the GPU tests cover
            ("fp16", no_mismatch(dtype=torch.float16, tol=1e-2, heads=1)),
            ("tiles 64x32", no_mismatch(tiles="64x32", heads=1)),
            ("tiles 16x64", no_mismatch(tiles="16x64", heads=1)),
            ("packed model", _check_packed_model_equals_sdpa),
            ("build check", _check_probe),
            ("function == custom op fp32", _check_function_equals_custom_op),
            ("function == custom op fp16", lambda: _check_function_equals_custom_op(torch.float16))]


def _assert_empty(bad: list) -> None:
    assert not bad, bad


def _run_interpreted_checks() -> None:
    """In the child: each check in turn, one line each ("check NAME: ok" or its error on one line)."""
    import traceback

    for name, check in _interpreted_checks():
        try:
            check()
            print(f"check {name}: ok", flush=True)
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            print(f"check {name}: " + traceback.format_exc().replace("\n", " | "), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Each of _interpreted_checks() -> "ok" or its error, and "stderr" -> the child's stderr's end."""
    code = "import tests.test_segattn_triton as t; t._run_interpreted_checks()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False, env={**os.environ, "TRITON_INTERPRET": "1"})
    results = dict(line[len("check "):].split(": ", 1) for line in done.stdout.splitlines()
                   if line.startswith("check ") and ": " in line)
    return {**results, "stderr": f"exit {done.returncode}: {done.stderr[-3000:]}"}


def _assert_checks(interpreted: dict[str, str], names: list[str]) -> None:
    for name in names:
        assert interpreted.get(name) == "ok", (name, interpreted.get(name), interpreted["stderr"])


@needs_triton
def test_kernels_equal_dense_masks_under_the_interpreter(interpreted):
    """Outputs and gradients (fp32 and fp16, packed batches; tiles of 32 x 32, 64 x 32 and 16 x 64) of the
    three attentions, and a tiny packed model's loss and gradients, against dense-mask SDPA; the
    kernels run in Triton's interpreter on the CPU."""
    _assert_checks(interpreted, ["fp32", "fp16", "tiles 64x32", "tiles 16x64", "packed model", "build check"])


@needs_triton
def test_eager_runs_the_kernels_without_torchdynamo_and_both_entries_agree(interpreted):
    """Under Triton's interpreter, in a fresh process: an eager tiny model (Triton kernels and SDPA)
    and the build check import no TorchDynamo; the Function and the custom op agree exactly (fp32, fp16)."""
    _assert_checks(interpreted, ["eager without TorchDynamo", "function == custom op fp32",
                                 "function == custom op fp16"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_kernels_equal_dense_masks_on_the_gpu(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine: pytest -m gpu)")
    assert not _attention_mismatches(dtype, "cuda", tol)


@pytest.mark.gpu
def test_auto_picks_triton_on_this_gpu_where_it_runs():
    """On an NVIDIA GPU of compute capability 8.0+ with Triton installed, ``auto`` builds and runs the
    kernels once and trains packed batches with them (a machine where they do not build fails here)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine: pytest -m gpu)")
    from streamnmt.models.attention import resolve_attention

    cuda = torch.device("cuda")
    lines: list[str] = []
    nvidia = torch.version.hip is None and torch.cuda.get_device_capability(cuda) >= (8, 0)
    expected = "triton" if nvidia and importlib.util.find_spec("triton") is not None else "sdpa"
    assert resolve_attention("auto", cuda, lines.append, head_dim=64) == expected, lines
    assert resolve_attention("auto", cuda, lines.append, head_dim=64, attention_dropout=0.1) == "sdpa"


def _compiled_kernels() -> int:
    """How many kernels the four Triton functions hold compiled in this process, over all devices."""
    from streamnmt.models import segattn_triton as st

    total = 0
    for fn in (st._fwd, st._delta, st._bwd_dkdv, st._bwd_dq):
        caches = getattr(fn, "device_caches", None)  # Triton >= 3.2: device -> (kernels by key, ...)
        total += sum(len(c[0]) for c in caches.values()) if caches is not None else sum(map(len, fn.cache.values()))
    return total


@pytest.mark.gpu
def test_the_build_check_compiles_the_kernels_a_training_batch_launches():
    """After the set-up's build check (one segment of 32 positions, one head), the three attentions of
    a packed batch of other lengths and 8 heads, forward and backward, compile nothing more."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine: pytest -m gpu)")
    from streamnmt.models import segattn_triton
    from streamnmt.models.attention import triton_probe
    from streamnmt.models.segattn_triton import Tiles, segment_attention

    segattn_triton.set_tiles(Tiles())
    triton_probe(torch.device("cuda"), torch.bfloat16, 64)
    before = _compiled_kernels()
    assert before >= 3 * 3 + 1, before  # three variants of the forward and the two backward kernels; the row sums
    src_seg, tgt_seg = (s.cuda() for s in packed_segments(rows=4, width=(200, 120), longest=30))
    for name, (r, allowed) in attentions(src_seg, tgt_seg).items():
        b, tq, tk = allowed.shape
        q, k, v = (torch.randn(b, 8, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for n in (tq, tk, tk))
        segment_attention(q, k, v, r).float().sum().backward()
        assert _compiled_kernels() == before, name


@pytest.mark.gpu
def test_kernels_capture_in_a_cuda_graph_and_compile():
    """The forward and backward replay from a CUDA graph with the same results as eager calls, and a
    compiled function calling them (fullgraph) gives those results too: no host sync, opaque to Inductor."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine: pytest -m gpu)")
    from streamnmt.models.segattn_triton import segment_attention

    torch.manual_seed(0)
    src_seg, tgt_seg = (s.cuda() for s in packed_segments(rows=4, width=(256, 128), longest=40))
    r = segment_ranges(tgt_seg, src_seg, causal=False, cross=True)
    q = torch.randn(4, 8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(4, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad = torch.randn(4, 8, 128, 64, device="cuda", dtype=torch.bfloat16)

    def run(q, k, v):
        out = segment_attention(q, k, v, r)
        return [out, *torch.autograd.grad(out, (q, k, v), grad)]

    eager = run(q, k, v)
    # The captured leaves are copies made on the side stream: a leaf's gradient node keeps the stream
    # of its first backward (pytorch/pytorch#137483), and the legacy stream's cannot join a capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        run(*leaves)  # warm-up on the side stream, as graph capture asks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = run(*leaves)
    graph.replay()
    torch.cuda.current_stream().wait_stream(stream)
    for x, y in zip(captured, eager):
        assert torch.equal(x, y)
    compiled = torch.compile(lambda q, k, v: segment_attention(q, k, v, r), fullgraph=True)
    assert torch.allclose(compiled(q, k, v).float(), eager[0].float(), atol=1e-2)


def test_triton_falls_back_to_sdpa_with_one_line_where_it_cannot_run(monkeypatch):
    from streamnmt.models import attention

    lines: list[str] = []
    assert attention.resolve_attention("triton", torch.device("cpu"), lines.append, head_dim=64) == "sdpa"
    assert lines == [("model: --attention triton unavailable (the Triton kernels train on CUDA only (not on cpu)); "
                      "using sdpa")]
    if importlib.util.find_spec("triton") is not None:
        cuda = torch.device("cuda", 0)
        assert attention.triton_available(cuda, 64) is None and attention.triton_available(cuda, 16) is None
        assert "head dim 48" in attention.triton_available(cuda, 48) and "head dim 8" in attention.triton_available(cuda, 8)


def test_auto_trains_packed_batches_with_triton_where_it_runs(monkeypatch):
    """``--attention auto``: triton on a CUDA GPU of compute capability 8.0+ where the kernels run and
    the recipe has no attention dropout; sdpa on the CPU, with attention dropout, on older GPUs,
    on ROCm, at head dims over 128, and where Triton cannot run (silently: auto is no request; one
    line where Triton is installed but its kernels do not build)."""
    from streamnmt.models import attention

    lines: list[str] = []
    assert attention.resolve_attention("auto", torch.device("cpu"), lines.append, head_dim=64) == "sdpa"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: None)
    monkeypatch.setattr(attention, "_triton_builds", lambda index, head_dim: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64) == "triton"
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64, attention_dropout=0.1) == "sdpa"
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=256) == "sdpa"  # not measured
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")  # an AMD GPU through ROCm: not measured
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64) == "sdpa"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: "Triton is not installed")
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64) == "sdpa"
    assert lines == []
    # Triton installed, but its kernels do not build (no C compiler, say): one line, then sdpa
    monkeypatch.setattr(attention, "triton_available", lambda device, head_dim=None: None)
    monkeypatch.setattr(attention, "_triton_builds", lambda index, head_dim: "the Triton kernels do not build here "
                                                                          "(RuntimeError: Failed to find C compiler)")
    assert attention.resolve_attention("auto", cuda, lines.append, head_dim=64) == "sdpa"
    assert attention.resolve_attention("triton", cuda, lines.append, head_dim=64) == "sdpa"
    assert lines == ["model: --attention auto: the Triton kernels do not build here (RuntimeError: Failed to find C "
                     "compiler); using sdpa",
                     "model: --attention triton unavailable (the Triton kernels do not build here (RuntimeError: "
                     "Failed to find C compiler)); using sdpa"]


def test_tiles_parse_the_benchmarks_names():
    from streamnmt.models.segattn_triton import Tiles

    assert Tiles.parse("64x32-w8-s2") == Tiles(64, 32, 8, 2)
    assert Tiles.parse("16x64") == Tiles(16, 64, 2, 3) and Tiles() == Tiles.parse("32x32")
    with pytest.raises(ValueError):
        Tiles.parse("wide")
    with pytest.raises(ValueError, match="query tile of 20 positions; a power of two from 16"):
        Tiles.parse("20x32")
    with pytest.raises(ValueError, match="3 warps"):
        Tiles.parse("32x32-w3")
