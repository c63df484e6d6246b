"""Checkpoints keep each process's own device RNG state: a rank that sees one GPU saves and
restores that GPU's generator only, and reads the per-device list of earlier checkpoints (CPU:
the CUDA calls are stood in for)."""

from __future__ import annotations

import pytest
import torch

from streamnmt import checkpoint


class FakeCuda:
    """The CUDA generator calls of a process that sees ``n`` devices, ``current`` selected."""

    def __init__(self, monkeypatch, n: int, current: int):
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(n)}
        self.current, self.set_calls = current, []
        for name, fn in {"is_available": lambda: True, "current_device": lambda: self.current,
                         "get_rng_state": self.get, "set_rng_state": self.set,
                         "get_rng_state_all": self.refuse, "set_rng_state_all": self.refuse}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def get(self, device="cuda"):
        return self.states[self.current].clone()

    def set(self, state, device="cuda"):
        self.set_calls.append(int(state[0]))

    def refuse(self, *args):
        raise AssertionError("every visible device's RNG state was touched")


def test_rng_state_is_this_devices_only(monkeypatch):
    cuda = FakeCuda(monkeypatch, n=8, current=5)  # e.g. rank 5 of a process seeing all 8 GPUs
    state = checkpoint.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([5], dtype=torch.uint8))
    FakeCuda(monkeypatch, n=1, current=0)  # resumed where each rank sees one GPU (its own as cuda:0)
    restored = FakeCuda(monkeypatch, n=1, current=0)
    checkpoint.set_rng_state(state)
    assert restored.set_calls == [5] and cuda.set_calls == []


@pytest.mark.parametrize("current,want", [(3, 3), (0, 0)])
def test_earlier_all_devices_format_restores_the_current_one(monkeypatch, current, want):
    state = checkpoint.rng_state()
    state["cuda"] = [torch.tensor([i], dtype=torch.uint8) for i in range(4)]  # list of every device
    cuda = FakeCuda(monkeypatch, n=4 if current else 1, current=current)
    checkpoint.set_rng_state(state)
    assert cuda.set_calls == [want]
