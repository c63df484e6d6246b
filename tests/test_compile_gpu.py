"""``--compile on`` trains on CUDA: the compiled model's gradients reach the weights (``pytest -m gpu``).

Compiled by inductor for CUDA, the chunked loss once gave all-zero gradients (grad_norm 0.0 in
steps.csv, the loss flat) under the graph and full strategies; the loss now runs outside the compiled
region. This compares the compiled run with the same run uncompiled."""

from __future__ import annotations

import pytest
import torch

from streamnmt.training.runs import read_csv
from tests.test_reliability import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = ["--device", "cuda", "--model", "tiny", "--builtin-size", "4000", "--bleu-samples", "0", "--max-len", "32",
        "--max-tokens", "1024", "--max-steps", "60", "--epochs", "50", "--loss-interval", "5", "--seed", "7"]


@pytest.mark.parametrize("strategy", ["graph", "full"])
def test_compiled_step_has_the_gradients_of_the_eager_step(tmp_path, strategy):
    home = str(tmp_path / "home")
    runs = {}
    for compile_ in ("on", "off"):
        res = run_cli([*ARGS, "--sync-strategy", strategy, "--compile", compile_, "--project", str(tmp_path),
                       "--name", compile_], home)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[compile_] = read_csv(tmp_path / compile_ / "steps.csv")
    on, off = runs["on"], runs["off"]
    assert len(on) == len(off) == 60
    for a, b in zip(on, off):
        assert float(a["grad_norm"]) > 0.1, a  # gradients reach the weights
        assert abs(float(a["grad_norm"]) - float(b["grad_norm"])) <= 0.05 * float(b["grad_norm"]), (a, b)
    assert abs(float(on[-1]["loss"]) - float(off[-1]["loss"])) <= 0.02 * float(off[-1]["loss"])
