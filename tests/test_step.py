"""The training step's schedule and non-finite guard (CPU)."""

from __future__ import annotations

import pytest
import torch

from streamnmt.models.transformer import make_model
from streamnmt.training.step import NoamSchedule, example_batch, inductor_options, make_step, noam_lr


def test_noam_schedule_values():
    d, w = 512, 4000
    assert noam_lr(1, d, w, 1.0) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert noam_lr(4000, d, w, 1.0) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)
    assert noam_lr(16000, d, w, 2.0) == pytest.approx(2 * 512 ** -0.5 * 16000 ** -0.5)
    assert noam_lr(2000, d, w, 1.0) < noam_lr(4000, d, w, 1.0) > noam_lr(8000, d, w, 1.0)


def test_device_schedule_matches_host():
    s = NoamSchedule(64, 10, 1.5, torch.device("cpu"))
    for step in range(1, 30):
        s.advance()
        assert s.lr_t.item() == pytest.approx(noam_lr(step, 64, 10, 1.5), rel=1e-6)


def test_non_finite_step_is_discarded_on_the_device(monkeypatch):
    monkeypatch.setenv("STREAMNMT_INJECT_INF_STEP", "2")
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10)
    batch = example_batch((4, 8, 8), model.shape, 0)
    loss = step.forward(batch)  # call 1: a normal step
    step.backward(loss)
    step.optimizer_step()
    before = [p.detach().clone() for p in model.parameters()]
    loss = step.forward(batch)  # call 2: made infinite by the test hook
    assert not torch.isfinite(loss)
    step.backward(loss)
    step.optimizer_step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    loss = step.forward(batch)  # call 3: trains again
    step.backward(loss)
    step.optimizer_step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_step_stats_hold_grad_norm_and_skipped_flag(monkeypatch):
    """``stats`` = [gradient norm, skipped] of the latest step: the clipped norm of a normal step; an
    infinite gradient under a finite loss (test hook) is skipped on the device, weights untouched."""
    monkeypatch.setenv("STREAMNMT_INJECT_INF_GRAD_FROM", "2")
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10, clip=0.0)
    batch = example_batch((4, 8, 8), model.shape, 0)
    step.backward(step.forward(batch))
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    step.optimizer_step()
    assert step.stats[0].item() == pytest.approx(want.item(), rel=1e-5) and step.stats[1].item() == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    loss = step.forward(batch)
    assert torch.isfinite(loss)
    step.backward(loss)
    step.optimizer_step()
    assert not torch.isfinite(step.stats[0]) and step.stats[1].item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_amp_auto_prefers_native_bf16_and_guards_old_torch(monkeypatch):
    from streamnmt.training.recipe import native_bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert native_bf16() is False  # emulated only: fp16 with the scaler
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # torch without the keyword
    assert native_bf16() is True


def test_compiled_step_turns_off_inductors_mix_order_reduction(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", raising=False)
    has = hasattr(inductor_config.triton, "mix_order_reduction")
    assert inductor_options() == ({"triton.mix_order_reduction": False} if has else {})
    seen = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: seen.append(kw) or m)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    make_step(model, torch.device("cpu"), d_model=32, compile=True)
    assert seen == [{"dynamic": False, "options": inductor_options() or None}]
    monkeypatch.setenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", "1")  # the user's own choice is kept
    assert inductor_options() == {}


def test_compile_options_are_accepted_by_torch_compile():
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64)
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10, compile=True)
    batch = example_batch((2, 6, 6), model.shape, 0)
    loss = step.forward(batch)  # compiles with inductor_options(): an unknown option would raise here
    step.backward(loss)
    assert torch.isfinite(loss)


def test_torchdynamo_is_imported_in_the_background_only_where_needed():
    """A compiled or DistributedDataParallel run imports TorchDynamo on a thread while its data is
    prepared; an eager run on one process has nothing to import (streamnmt.training.optim.Adam).
    In a fresh interpreter: nothing starts for an eager run, the thread imports TorchDynamo for a
    DDP run, and once it is imported there is nothing left to start."""
    import os
    import subprocess
    import sys

    code = ("import sys; from streamnmt.training.step import import_in_background as f; "
            "assert f(False) is None and 'torch._dynamo' not in sys.modules; t = f(False, ddp=True); t.join(); "
            "assert 'torch._dynamo' in sys.modules and 'torch._inductor.compile_fx' not in sys.modules; "
            "assert f(False, ddp=True) is None; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_ddp_gets_the_bucket_size(monkeypatch):
    """--bucket-cap-mb reaches DistributedDataParallel (the wrapper faked: no process group)."""
    import types

    import torch.nn.parallel

    built = {}

    def fake_ddp(module, **kwargs):
        built.update(kwargs)
        module.process_group = types.SimpleNamespace(size=lambda: 2)
        return module

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", fake_ddp)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    step = make_step(model, torch.device("cpu"), d_model=32, ddp=True, bucket_cap_mb=7.5)
    step.parallel()
    assert built["bucket_cap_mb"] == 7.5 and built["gradient_as_bucket_view"] and step.world == 2


@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_clipping_inside_adam_equals_clip_grad_norm(clip):
    """The clipping handed to the fused Adam (``grad_scale``) updates as ``clip_grad_norm_`` and then
    Adam do: a clip that binds every step (1e-3) and one that never does (1e3)."""
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    ref = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, dropout=0.0)
    ref.load_state_dict(model.state_dict())
    ref_start = [p.detach().clone() for p in ref.parameters()]
    step = make_step(model, torch.device("cpu"), d_model=32, warmup=10, lr=2.0, clip=clip)
    ref_step = make_step(ref, torch.device("cpu"), d_model=32, warmup=10, lr=2.0, clip=clip)
    params = [p for p in ref_step.model.parameters()]
    norms = []
    for i in range(4):
        batch = example_batch((4, 8, 8), model.shape, i)
        step.backward(step.forward(batch))
        step.optimizer_step()
        ref_step.backward(ref_step.forward(batch))
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip, foreach=True))
        ref_step.schedule.advance()
        ref_step.optimizer.step()  # torch's fused Adam, no grad_scale: gradients clipped in place above
        ref_step.optimizer.zero_grad()
        assert step.stats[0].item() == pytest.approx(norms[-1].item(), rel=1e-5)
    assert (min(norms) > clip) if clip < 1 else (max(norms) < clip)  # the case the parameter names
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref_start))
    assert moved > 0.05  # the updates are large against the tolerance below
    for a, b in zip(model.parameters(), ref.parameters()):
        # Adam divides by sqrt(v): a gradient element near 0 turns rounding into a visible difference
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
