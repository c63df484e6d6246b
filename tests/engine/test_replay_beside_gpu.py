"""Can a CUDA graph that draws no random numbers replay on a second stream while a training graph
with dropout replays on the first, without changing the training graph's numbers?

What an evaluation beside training (the BLEU pass's decoding graphs replayed between training
steps, issue #29) would rely on. A graph's replay runs its generators' prologue on the replaying
stream: in some PyTorch versions it fills the default CUDA generator's seed and offset tensors
even for a graph that drew nothing, and those tensors are the ones a dropout graph's kernels read
when they run. Here the dropout graph starts with a long matmul chain, so a fill issued by the
other graph's replay lands while it runs and before its dropout reads the offset: the test fails
where the hazard exists (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _capture(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def test_a_replay_without_random_numbers_beside_a_dropout_graph_changes_nothing():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device=dev)
    w = torch.randn(2048, 2048, device=dev) / 2048 ** 0.5
    out = torch.empty_like(a)
    src = torch.randn(256, 1024, device=dev)
    dec = torch.randn(1024, 1024, device=dev) / 1024 ** 0.5
    dec_out = torch.empty_like(src)

    def train_like():  # ~20 matmuls before the dropout reads the generator's offset
        h = a
        for _ in range(20):
            h = torch.tanh(h @ w)
        out.copy_(torch.nn.functional.dropout(h, p=0.5, training=True))

    def decode_like():  # no random numbers
        h = src
        for _ in range(4):
            h = torch.relu(h @ dec)
        dec_out.copy_(h)

    s_train, s_side = torch.cuda.Stream(), torch.cuda.Stream()
    g_train = _capture(train_like, s_train)
    g_side = _capture(decode_like, s_side)
    start = torch.cuda.get_rng_state(dev)

    def run(beside: bool) -> list[torch.Tensor]:
        torch.cuda.set_rng_state(start, dev)
        got = []
        for _ in range(8):
            with torch.cuda.stream(s_train):
                g_train.replay()
            if beside:
                with torch.cuda.stream(s_side):
                    g_side.replay()
            with torch.cuda.stream(s_train):
                got.append(out.clone())
        torch.cuda.synchronize()
        return got

    alone, beside = run(False), run(True)
    assert all(not torch.equal(alone[0], x) for x in alone[1:])  # each replay draws a new mask
    changed = [i for i, (x, y) in enumerate(zip(alone, beside)) if not torch.equal(x, y)]
    assert not changed, f"training replays {changed} drew other dropout masks beside the other graph's replays"
