"""--async-eval on a CUDA device (``pytest -m gpu``): BLEU passes replayed on a thread and a stream
of their own while the training graphs replay must leave training as it is (dropout included)
and evaluate what the loop's own passes evaluate, capturing nothing beside training."""

from __future__ import annotations

import pytest
import torch

from streamnmt.cli import build_parser
from streamnmt.config import build_job
from streamnmt.inference.graph_search import shared_decoder
from streamnmt.training.evaluator import EVAL_BATCH
from streamnmt.training.runs import read_csv
from streamnmt.training.trainer import Trainer

pytestmark = pytest.mark.gpu

FLAGS = ["--device", "cuda", "--model", "tiny", "--builtin-size", "400", "--bleu-samples", "64", "--batch-size", "16",
         "--max-len", "32", "--no-pack", "--dropout", "0.1", "--epochs", "6", "--eval-every", "2"]


def _train(tmp_path, mode: str, lines: list[str]) -> tuple[Trainer, list[dict[str, str]], list[float]]:
    args = vars(build_parser().parse_args(["train", *FLAGS, "--async-eval", mode, "--project", str(tmp_path),
                                           "--name", mode]))
    for key in ("_run", "command"):
        args.pop(key, None)
    t = Trainer(build_job(args), log=lines.append)
    t.train()
    losses = [float(r["loss"]) for r in read_csv(tmp_path / mode / "steps.csv")]
    return t, read_csv(tmp_path / mode / "evals.csv"), losses


def test_passes_beside_training_change_neither_training_nor_what_is_evaluated(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    lines: list[str] = []
    off, evals_off, losses_off = _train(tmp_path, "off", [])
    on, evals_on, losses_on = _train(tmp_path, "auto", lines)
    assert any(line.startswith("eval: from now on the BLEU passes run beside training") for line in lines)
    assert len(evals_on) >= 4
    # dropout masks drawn as without the passes (a replay's generator fill would shift them)
    torch.testing.assert_close(torch.tensor(losses_on), torch.tensor(losses_off), rtol=1e-4, atol=1e-5)
    assert [r["step"] for r in evals_on] == [r["step"] for r in evals_off]
    torch.testing.assert_close(torch.tensor([float(r["val_loss"]) for r in evals_on]),
                               torch.tensor([float(r["val_loss"]) for r in evals_off]), rtol=1e-3, atol=1e-4)
    bleu_on, bleu_off = ([float(r["bleu"]) for r in e] for e in (evals_on, evals_off))
    assert max(abs(a - b) for a, b in zip(bleu_on, bleu_off)) < 2.0, (bleu_on, bleu_off)
    # the passes beside training replayed the first evaluation's captures and captured nothing more
    caps = [shared_decoder(t.evaluator.bleu_model, t.evaluator.options, EVAL_BATCH).captures for t in (off, on)]
    assert caps[0] == caps[1] > 0, caps
