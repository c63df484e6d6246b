"""streamnmt.training.prime: one step of a one-layer model of the run's shape on a thread, which
draws no random number of the run's and never fails it."""

from __future__ import annotations

import pytest
import torch

from streamnmt.models.transformer import ModelShape
from streamnmt.training import prime
from streamnmt.training.step import example_batch

SHAPE = ModelShape(40, 50, 32, 2, 4, 64, 0.3, max_positions=64)
KWARGS = dict(d_model=32, lr=1.0, warmup=10, amp="off", clip=1.0, label_smoothing=0.1)


def test_primer_shape_has_one_layer_and_no_dropout():
    s = prime.primer_shape(SHAPE)
    assert (s.n_layers, s.dropout, s.attention_p(), s.activation_p()) == (1, 0.0, 0.0, 0.0)
    assert (s.src_vocab, s.tgt_vocab, s.d_model, s.n_heads, s.d_ff) == (40, 50, 32, 4, 64)


@pytest.mark.parametrize("packed", [False, True])
def test_prime_runs_a_step_and_draws_no_random_number(packed):
    batch = example_batch((4, 12, 10), SHAPE, seed=1, packed=packed)
    before = torch.get_rng_state()
    p = prime.Primer(lambda: prime.prime(SHAPE, batch, torch.device("cpu"), attention="sdpa", step_kwargs=KWARGS))
    assert p.join() >= 0.0
    assert p.error is None
    assert torch.equal(torch.get_rng_state(), before)  # the run's seeded generator is where it was


def test_a_failing_priming_is_recorded_not_raised():
    def boom():
        raise RuntimeError("no kernel image\nsecond line")

    p = prime.Primer(boom)
    p.join()
    assert p.error == "RuntimeError: no kernel image"


def test_no_primer_on_the_cpu():
    batch = example_batch((2, 8, 8), SHAPE, seed=1)
    assert prime.start(SHAPE, batch, torch.device("cpu"), attention="sdpa", step_kwargs=KWARGS) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prime_on_the_gpu_leaves_the_generators():
    dev = torch.device("cuda")
    torch.manual_seed(5)
    cuda_before, cpu_before = torch.cuda.get_rng_state(dev), torch.get_rng_state()
    batch = example_batch((8, 16, 16), SHAPE, seed=1, packed=True)
    p = prime.start(SHAPE, batch, dev, attention="sdpa", step_kwargs={**KWARGS, "amp": "bf16"})
    assert p is not None
    p.join()
    assert p.error is None and p.took_s > 0
    assert torch.equal(torch.cuda.get_rng_state(dev), cuda_before)
    assert torch.equal(torch.get_rng_state(), cpu_before)
