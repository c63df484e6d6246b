"""streamnmt.training.optim.Adam: torch.optim.Adam's numbers and state dict, without the import of
TorchDynamo that torch.optim's wrappers make (an eager run never imports it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from streamnmt.training.optim import Adam


def _model_and_grads(seed: int) -> tuple[torch.nn.Module, list[list[torch.Tensor]]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(4)]
    return model, grads


def _train(cls, fused: bool) -> tuple[list[torch.Tensor], dict]:
    model, grads = _model_and_grads(0)
    lr = torch.tensor(0.01)
    opt = cls(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9, fused=fused)
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize("fused", [True, False])
def test_adam_equals_torch_adam(fused):
    ours, ours_state = _train(Adam, fused)
    ref, ref_state = _train(torch.optim.Adam, fused)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert ours_state["param_groups"] == ref_state["param_groups"]
    for k, s in ref_state["state"].items():
        assert all(torch.equal(s[n], ours_state["state"][k][n]) for n in s)
    assert not all(torch.equal(a, b) for a, b in zip(ours, _model_and_grads(0)[0].parameters()))  # it moved


def test_state_dicts_load_both_ways():
    _, ref_state = _train(torch.optim.Adam, fused=False)
    model, _ = _model_and_grads(0)
    ours = Adam(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.98), eps=1e-9)
    ours.load_state_dict(ref_state)
    back = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.98), eps=1e-9)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], ref_state["state"][0]["exp_avg"])


RUN = textwrap.dedent("""
    import sys, torch
    import streamnmt.training.step as step
    if sys.argv[1] == "torch":
        step.Adam = torch.optim.Adam  # the optimizer this module replaces
    from streamnmt.cli import main
    rc = main(["train", "--device", "cpu", "--model", "tiny", "--builtin-size", "200", "--max-steps", "6",
               "--save-every", "3", "--bleu-samples", "8", "--workers", "0", "--project", sys.argv[2], "--name", "r"])
    print("rc", rc, "dynamo", "torch._dynamo" in sys.modules)
""")


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory):
    """A STREAMNMT_HOME of this module's: the first run prepares the corpus and tokenizers (that
    path imports no TorchDynamo either), the second reads them from its cache."""
    return tmp_path_factory.mktemp("optim-home")


@pytest.mark.parametrize("optimizer, imported", [("ours", False), ("torch", True)])
def test_an_eager_run_imports_no_torchdynamo(tmp_path, fresh_home, optimizer, imported):
    """A whole uncompiled run (set-up, steps, evaluation, checkpoints) leaves TorchDynamo unimported;
    with torch.optim.Adam in its place the same run imports it (what this test would catch)."""
    env = {**os.environ, "STREAMNMT_HOME": str(fresh_home)}
    out = subprocess.run([sys.executable, "-c", RUN, optimizer, str(tmp_path)], check=False, capture_output=True,
                         text=True, env=env, timeout=240)
    assert f"rc 0 dynamo {imported}" in out.stdout, out.stdout[-1500:] + out.stderr[-1500:]


def test_only_torchs_own_wrappers_are_taken_off():
    """The dynamo-importing wrappers are peeled (nothing wrapped is left on this torch); a wrapper
    of another kind, such as one a later torch might add, is kept."""
    import functools

    from streamnmt.training import optim

    for fn in (optim._ADD_PARAM_GROUP, optim._ZERO_GRAD, optim._STATE_DICT, optim._LOAD_STATE_DICT, optim._ADAM_STEP):
        assert not hasattr(fn, "__wrapped__"), fn

    def inner(self):
        return "inner"

    @functools.wraps(inner)
    def other(self):
        return "kept"

    assert optim._peel(other, optim._DISABLE + optim._STEP) is other
    assert optim._peel(torch._disable_dynamo(inner), optim._DISABLE) is inner


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
def test_adam_equals_torch_adam_fused_capturable_inside_a_cuda_graph():
    """The trainer's optimizer on CUDA: fused, capturable, the learning rate a device tensor, its step
    captured in a CUDA graph and replayed; the same weights and moments as torch.optim.Adam's."""
    def run(cls):
        model, grads = _model_and_grads(0)
        model = model.cuda()
        params = list(model.parameters())
        opt = cls(params, lr=torch.tensor(0.01, device="cuda"), betas=(0.9, 0.98), eps=1e-9, fused=True,
                  capturable=True)
        for p in params:
            p.grad = torch.zeros_like(p)
        static = [torch.zeros_like(p) for p in params]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            opt.step()  # warm-up: the state tensors exist before the capture
        torch.cuda.current_stream().wait_stream(stream)  # (zero gradients: a step of zero, as for both)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for p, g in zip(params, static):
                p.grad.copy_(g)
            opt.step()
        for step_grads in grads:
            for g, new in zip(static, step_grads):
                g.copy_(new)
            graph.replay()
        torch.cuda.synchronize()
        return [p.detach().cpu() for p in params], opt.state_dict()

    ours, ours_state = run(Adam)
    ref, ref_state = run(torch.optim.Adam)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    for k, s in ref_state["state"].items():
        assert all(torch.equal(s[n].cpu(), ours_state["state"][k][n].cpu()) for n in s)
    assert not all(torch.equal(a, b.cpu()) for a, b in zip(ours, _model_and_grads(0)[0].parameters()))
