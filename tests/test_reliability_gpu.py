"""Resume exactness on a CUDA device, deterministic mode (``pytest -m gpu``)."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.test_reliability import losses, run_cli

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["full", "graph"])
def test_resume_exact_on_gpu(tmp_path, strategy):
    """Killed after step 35 (--save-every 10): resumes exactly from the newest save that finished.
    That is step 30, or step 20 where step 30's background write was still in flight when the
    kill came (graph mode runs the five steps after it faster than the write: 1d988d6, H100)."""
    home = str(tmp_path / "home")
    common = ["--device", "cuda", "--model", "tiny", "--builtin-size", "2000", "--bleu-samples", "0",
              "--batch-size", "16", "--max-tokens", "0", "--max-len", "32", "--deterministic", "--amp", "off", "--max-steps", "60",
              "--seed", "5", "--save-every", "10", "--sync-strategy", strategy, "--project", str(tmp_path)]
    ref = run_cli([*common, "--name", "ref"], home)
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = run_cli([*common, "--name", "killed"], home, env={"STREAMNMT_TEST_KILL_AT_STEP": "35"})
    assert killed.returncode == -signal.SIGKILL
    last = tmp_path / "killed" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] in (20, 30)
    resumed = run_cli(["--resume", str(last)], home)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")
