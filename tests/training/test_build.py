"""build_run: the set-up's late decisions reach every part that records the job."""

from __future__ import annotations

import pytest
import yaml

from streamnmt.checkpoint import load_checkpoint
from streamnmt.training import build, recipe
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_triton_kernels_that_fail_their_build_check_train_with_sdpa_and_the_checkpoints_say_so(tmp_path,
                                                                                             monkeypatch):
    """The Triton build check settles just before graph capture, after the run's parts were made: a
    fallback to sdpa is said in one line, and the model, the loop, config.yaml and last.pt all say
    sdpa (a resume must not ask for the kernels that did not build)."""
    for module in (recipe, build):  # a GPU that runs them, as the recipe and the model's set-up see it
        monkeypatch.setattr(module, "resolve_attention", lambda *args, **kwargs: "triton")
    monkeypatch.setattr(build, "settle_triton", lambda log: "the Triton kernels do not build here (no ptxas)")
    lines: list[str] = []
    t = make_trainer(tmp_path, "--name", "t", "--attention", "triton", "--epochs", "1", "--max-steps", "2",
                     "--best-metric", "val_loss", lines=lines)
    assert "model: --attention triton: the Triton kernels do not build here (no ptxas); using sdpa" in lines
    assert t.model.attention == "sdpa" and t.job.model.attention == "sdpa"
    t.train()
    run = tmp_path / "t"
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["attention"] == "sdpa"
    assert load_checkpoint(run / "weights" / "last.pt")["config"]["model"]["attention"] == "sdpa"
