"""The chunked output layer and loss (streamnmt.models.xent) against PyTorch's cross-entropy on whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from streamnmt.models import masks
from streamnmt.models.transformer import make_model
from streamnmt.training.step import example_batch, make_step
from streamnmt.models.xent import linear_cross_entropy


def _reference(h, w, b, y, ls):
    logits = F.linear(h, w, b).float()
    loss = F.cross_entropy(logits, y, ignore_index=masks.PAD, reduction="sum", label_smoothing=ls)
    nll = F.cross_entropy(logits, y, ignore_index=masks.PAD, reduction="sum")
    return loss, nll


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and dtype, equal within fp32 rounding (the chunked sums add in another order)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("chunk_rows", [None, 7, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_cross_entropy_on_whole_logits(ls, chunk_rows, bias):
    torch.manual_seed(0)
    n, d, v = 45, 16, 53
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    b = torch.randn(v, requires_grad=True) if bias else None
    y = torch.randint(1, v, (n,))
    y[::4] = masks.PAD  # padding rows add nothing
    params = [h, w] + ([b] if bias else [])
    ref_loss, ref_nll = _reference(h, w, b, y, ls)
    ref_grads = torch.autograd.grad(ref_loss * 0.37, params)
    loss, nll = linear_cross_entropy(h, w, b, y, label_smoothing=ls, ignore_index=masks.PAD, chunk_rows=chunk_rows)
    assert not nll.requires_grad
    grads = torch.autograd.grad(loss * 0.37, params)
    assert _close(loss, ref_loss)
    assert _close(nll, ref_nll)
    for got, want in zip(grads, ref_grads):
        assert _close(got, want)


def test_padding_rows_change_nothing():
    torch.manual_seed(1)
    h, w = torch.randn(10, 8), torch.randn(20, 8)
    y = torch.randint(1, 20, (10,))
    y[6:] = masks.PAD
    loss, nll = linear_cross_entropy(h, w, None, y, label_smoothing=0.1, ignore_index=masks.PAD, chunk_rows=3)
    loss6, nll6 = linear_cross_entropy(h[:6], w, None, y[:6], label_smoothing=0.1, ignore_index=masks.PAD)
    assert _close(loss, loss6)
    assert _close(nll, nll6)


def test_no_gradient_work_without_autograd():
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    y = torch.randint(1, 20, (6,))
    with torch.no_grad():
        loss, nll = linear_cross_entropy(h, w, None, y, label_smoothing=0.1)
    assert not loss.requires_grad and loss.grad_fn is None
    assert _close(loss, _reference(h.detach(), w.detach(), None, y, 0.1)[0])


def test_autocast_dtype_is_the_compute_dtype():
    """Under bf16 autocast the logits are made in bf16, as the generator's Linear made them."""
    torch.manual_seed(2)
    h, w, b = torch.randn(12, 16), torch.randn(30, 16), torch.randn(30)
    y = torch.randint(1, 30, (12,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD)
        want = F.cross_entropy(F.linear(h, w, b).float(), y, ignore_index=masks.PAD, reduction="sum",
                               label_smoothing=0.1)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-4)  # the same bf16 logits, read in fp32
    fp32 = linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD)[0]
    assert not torch.equal(loss, fp32)  # bf16 logits differ from fp32 ones


def test_rejects_bad_smoothing():
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), None, torch.ones(2, dtype=torch.long),
                             label_smoothing=1.0)


def _old_loss_sum(model, batch, ls):
    """The step's loss as it was: whole (B, T, V) logits, copied to fp32, PyTorch's cross-entropy."""
    logits = model(batch.src, batch.tgt_in, masks.src_mask(batch.src))
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.tgt_out.flatten(), ignore_index=masks.PAD,
                           reduction="sum", label_smoothing=ls)


@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("tie", ["none", "decoder"])
def test_step_loss_and_gradients_equal_the_whole_logits_loss(ls, tie):
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0, tie_embeddings=tie)
    batch = example_batch((4, 9, 7), model.shape, 0)
    batch.tgt_out[1, 4:] = masks.PAD  # a padded target row, and a whole PAD row
    batch.tgt_out[3, :] = masks.PAD
    step = make_step(model, torch.device("cpu"), d_model=32, label_smoothing=ls)
    params = [p for p in model.parameters()]
    want = _old_loss_sum(model, batch, ls)
    want_nll = _old_loss_sum(model, batch, 0.0)
    want_grads = torch.autograd.grad(want, params)
    got = step.loss_sum(batch)
    grads = torch.autograd.grad(got.loss, params)
    assert _close(got.loss, want)
    assert _close(got.nll, want_nll)
    assert int(got.ntokens) == int((batch.tgt_out != masks.PAD).sum())
    for g, w in zip(grads, want_grads):
        assert _close(g, w)


def test_step_pushes_the_token_mean_nll_beside_the_loss():
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    batch = example_batch((4, 8, 8), model.shape, 0)
    step = make_step(model, torch.device("cpu"), d_model=32, label_smoothing=0.1)
    loss = step.forward(batch)
    sums = step.loss_sum(batch)
    assert _close(loss.detach(), sums.loss * batch.norm)
    assert _close(step.values["nll"], sums.nll * batch.norm)
    assert not torch.equal(step.values["nll"], loss.detach())  # smoothing changes the loss, not the NLL


@pytest.mark.gpu
def test_graph_captured_loss_equals_eager_at_a_32k_vocabulary():
    """Captured in a CUDA graph (no host sync, static shapes) and run in bf16 at a real vocabulary,
    with peak memory far below the whole-batch fp32 logits."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    n, d, v = 16384, 512, 32000  # a packed base-model batch
    h = torch.randn(n, d, device=dev, requires_grad=True)
    w = (torch.randn(v, d, device=dev) * d ** -0.5).requires_grad_()
    b = torch.zeros(v, device=dev, requires_grad=True)
    y = torch.randint(1, v, (n,), device=dev)
    y[::10] = masks.PAD

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, nll = linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD)
        gh, gw, gb = torch.autograd.grad(loss, [h, w, b])
        return loss, nll, gh, gw, gb

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = [t.clone() for t in run()]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run()
    graph.replay()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base  # the captured step alone, before the reference below
    for got, want in zip(static, eager):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    want_loss = F.cross_entropy(F.linear(h.bfloat16(), w.bfloat16(), b.bfloat16()).float(), y,
                                ignore_index=masks.PAD, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(eager[0], want_loss, rtol=1e-4, atol=1e-2)
    assert peak < n * v * 4 / 2, f"peak {peak / 2**20:.0f} MB"  # under half the fp32 logits alone


def test_traces_into_one_graph_for_torch_compile():
    """torch.compile traces the chunked loss and its backward whole (aot_eager, CPU). The trainer keeps the
    loss out of its compiled region all the same: see streamnmt.training.step and tests/test_compile_gpu.py."""
    torch.manual_seed(3)
    h, w, b = (torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True),
               torch.randn(30, requires_grad=True))
    y = torch.randint(0, 30, (20,))

    def f(h, w, b, y):
        return linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD, chunk_rows=7)

    want = f(h, w, b, y)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(h, w, b, y)
    for a, c in zip(torch.autograd.grad(got[0], [h, w, b]), torch.autograd.grad(want[0], [h, w, b])):
        assert _close(a, c)
    assert _close(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [100, 32003])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_fused_kernel_equals_the_torch_path(monkeypatch, dtype, v, smoothing):
    """The Triton kernel (CUDA) gives the torch path's losses and gradients: a vocabulary under one
    block and one that is not a multiple of it, ignored rows, fp32, bf16 and fp16."""
    from streamnmt.models import xent
    from streamnmt.models import xent_triton

    dev = torch.device("cuda")
    assert xent_triton.available(torch.empty(1, device=dev)), "Triton is missing on this CUDA machine"
    torch.manual_seed(0)
    n, d = 3000, 64
    h = torch.randn(n, d, device=dev, requires_grad=True)
    w = (torch.randn(v, d, device=dev) * 2 * d ** -0.5).requires_grad_()
    b = torch.randn(v, device=dev, requires_grad=True)
    y = torch.randint(1, v, (n,), device=dev)
    y[::7] = masks.PAD

    def run():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss, nll = linear_cross_entropy(h, w, b, y, label_smoothing=smoothing, ignore_index=masks.PAD,
                                             chunk_rows=1024)
        return (loss, nll, *torch.autograd.grad(loss, [h, w, b]))

    fused = run()
    assert xent._FUSED["failed"] is None
    monkeypatch.setattr(xent_triton, "available", lambda t: False)
    ref = run()
    for a, r, name in zip(fused, ref, ("loss", "nll", "dh", "dw", "db")):
        if dtype == torch.float32:
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        else:  # both round each gradient element to bf16/fp16: relative error of the whole tensor
            err = ((a.float() - r.float()).norm() / r.float().norm()).item()
            assert err < 1e-2, f"{name}: relative error {err:.2e}"
    monkeypatch.undo()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        loss = linear_cross_entropy(h, w, b, y, label_smoothing=smoothing, ignore_index=masks.PAD)[0]
    torch.testing.assert_close(loss, fused[0], rtol=1e-5, atol=1e-3)  # the same loss without a gradient


def test_a_kernel_that_cannot_be_built_falls_back_to_the_torch_path_once(monkeypatch, capsys):
    """Where the Triton kernel fails (a build error, say), the chunk is computed by the torch path,
    one line says so, and later calls do not try the kernel again."""
    from streamnmt.models import xent
    from streamnmt.models import xent_triton

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("no compiler for this GPU\nsecond line")

    monkeypatch.setattr(xent_triton, "available", lambda t: True)
    monkeypatch.setattr(xent_triton, "xent_rows", broken)
    monkeypatch.setitem(xent._FUSED, "failed", None)
    torch.manual_seed(0)
    h, w, b = torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True), torch.randn(30)
    y = torch.randint(1, 30, (20,))
    for _ in range(2):
        loss, nll = linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD, chunk_rows=8)
        assert _close(loss, _reference(h, w, b, y, 0.1)[0])
    assert len(calls) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["loss: the fused cross-entropy kernel is unavailable (RuntimeError: no compiler for this GPU); "
                   "using the torch path"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_rows_saturate_the_nll_as_the_torch_path(dtype):
    """A row whose target logit is far below the others: the kernel's NLL saturates at -log of
    fp32's smallest normal, as the torch path's clamped probability, and its loss and gradient
    match the torch path's, row by row, in each compute dtype."""
    from streamnmt.models import xent
    from streamnmt.models import xent_triton

    dev = torch.device("cuda")
    torch.manual_seed(0)
    c, v = 64, 1000
    z = (torch.randn(c, v, device=dev) * 3).to(dtype)
    y = torch.randint(4, v, (c,), device=dev)
    y[5] = masks.PAD
    far = torch.arange(0, c, 4, device=dev)
    z[far, y[far]] = -200.0  # p(target) = exp(-200 - lse) underflows fp32: NLL saturates
    loss, nll = xent_triton.xent_rows(kz := z.clone(), y, 0.1, masks.PAD, True)
    ref_loss, ref_nll, ref_g = xent._torch_rows(z.clone(), y, 0.1, masks.PAD, True)
    torch.testing.assert_close(nll[far], torch.full_like(nll[far], xent_triton.NLL_MAX))
    assert nll[5] == 0 and loss[5] == 0
    torch.testing.assert_close(nll, ref_nll, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    if dtype == torch.float32:
        torch.testing.assert_close(kz, ref_g, rtol=1e-5, atol=1e-6)
    else:  # each gradient element rounded to 8 or 11 bits by both: relative error of the whole tensor
        assert ((kz.float() - ref_g.float()).norm() / ref_g.float().norm()).item() < 1e-2


def test_out_of_memory_in_the_kernel_is_raised_not_taken_for_a_build_failure(monkeypatch):
    """Memory running out inside the kernel's call is raised as it is: the kernel stays on (the
    torch path would need more memory, not less)."""
    from streamnmt.models import xent
    from streamnmt.models import xent_triton

    def oom(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(xent_triton, "available", lambda t: True)
    monkeypatch.setattr(xent_triton, "xent_rows", oom)
    monkeypatch.setitem(xent._FUSED, "failed", None)
    h, w, y = torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True), torch.randint(1, 30, (20,))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        linear_cross_entropy(h, w, None, y, ignore_index=masks.PAD, chunk_rows=8)
    assert xent._FUSED["failed"] is None


def test_after_a_failed_kernel_the_torch_path_runs_in_its_own_chunk_size(monkeypatch):
    """The kernel's chunks are larger than the torch path can hold (no fp32 softmax): when the
    kernel fails, the chunk is made again at the torch path's size, and so are the rest."""
    from streamnmt.models import xent
    from streamnmt.models import xent_triton

    def broken(*args):
        raise RuntimeError("no compiler for this GPU")

    sizes = []
    torch_rows = xent._torch_rows

    def recording(z, *args):
        sizes.append(z.shape[0])
        return torch_rows(z, *args)

    monkeypatch.setattr(xent_triton, "available", lambda t: True)
    monkeypatch.setattr(xent_triton, "xent_rows", broken)
    monkeypatch.setattr(xent, "_torch_rows", recording)
    monkeypatch.setattr(xent, "CHUNK_ELEMENTS", 30 * 3)  # 3 rows of a 30-piece vocabulary
    monkeypatch.setitem(xent._FUSED, "failed", None)
    torch.manual_seed(0)
    h, w, b = torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True), torch.randn(30)
    y = torch.randint(1, 30, (20,))
    loss, _ = linear_cross_entropy(h, w, b, y, label_smoothing=0.1, ignore_index=masks.PAD, chunk_rows=8)
    assert _close(loss, _reference(h, w, b, y, 0.1)[0])
    assert sizes == [3, 3, 3, 3, 3, 3, 2]  # every row once, at most 3 at a time
