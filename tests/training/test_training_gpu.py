"""Evaluation and checkpoints of a training run on a CUDA device (``pytest -m gpu``): the captured
validation loss, the dev BLEU pass through the graph decoder, background saves from the GPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from streamnmt.checkpoint import load_checkpoint
from streamnmt.cli import build_parser
from streamnmt.config import build_job
from streamnmt.inference.decoding import SearchOptions, decoding_copy
from streamnmt.inference.graph_search import shared_decoder
from streamnmt.inference.scoring import bleu_on_pairs
from streamnmt.training.checkpointer import Checkpointer
from streamnmt.training.evaluator import EVAL_BATCH
from streamnmt.training.trainer import Trainer

pytestmark = pytest.mark.gpu

TINY = ["--device", "cuda", "--model", "tiny", "--builtin-size", "400", "--bleu-samples", "64", "--batch-size", "16",
        "--max-len", "32", "--dropout", "0", "--epochs", "2"]


@pytest.fixture()
def trained(tmp_path, monkeypatch) -> Trainer:
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    args = vars(build_parser().parse_args(["train", *TINY, "--project", str(tmp_path)]))
    for key in ("_run", "command"):
        args.pop(key, None)
    t = Trainer(build_job(args), log=lambda _: None)
    t.train()
    return t


def test_validation_replays_graphs_and_equals_the_eager_loss(trained):
    ev = trained.evaluator
    assert ev._captured is not None and ev._captured.graphs and ev._captured.failed is None
    shapes = len(ev._captured.graphs)
    captured = ev.validate()
    ev_captured, ev._captured = ev._captured, None
    eager = ev.validate()
    ev._captured = ev_captured
    assert math.isfinite(captured) and captured == pytest.approx(eager, rel=1e-5)
    assert len(ev._captured.graphs) == shapes  # replayed, not captured again


def test_dev_bleu_decodes_through_graphs_captured_once(trained):
    """The run's decoding graphs are replayed, not captured again, and give the run's BLEU exactly;
    graph and eager decoding agree in fp32. (In bf16 they need not: padded widths, masked keys and
    rows kept after their sentence ended round differently, which flips beam near-ties of a
    barely trained model.)"""
    ev = trained.evaluator
    assert ev.options.graph and ev.bleu_model is not None
    decoder = shared_decoder(ev.bleu_model, ev.options, EVAL_BATCH)
    captures = decoder.captures
    assert captures > 0  # the run's evaluations captured the buckets
    bleu, _, _ = ev.bleu()
    assert decoder.captures == captures  # the next evaluation replays them
    again, _, _ = ev.bleu()
    assert again == bleu and decoder.captures == captures  # graph against graph: exactly
    fp32 = decoding_copy(trained.model, torch.float32, None, separate=True)
    graph, eager = (bleu_on_pairs(fp32, trained.run.data.src_tok, trained.run.data.tgt_tok, ev._pairs, device="cuda",
                                  beam_size=ev.options.beam_size, batch_size=EVAL_BATCH, tgt_lang="ch",
                                  options=SearchOptions(beam_size=ev.options.beam_size, graph=g))
                    for g in (True, False))
    assert graph["bleu"] == pytest.approx(eager["bleu"], abs=1e-9)  # the same search, replayed


def test_a_background_save_from_the_gpu_writes_the_state_of_its_call(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    state = {"model": {"w": w, "tied": w}, "step": 1}
    c = Checkpointer(torch.device("cuda"), background=True)
    stall = c.save(tmp_path / "a.pt", state)
    w.mul_(-1.0)  # the next training step, queued at once on the device
    c.close()
    Checkpointer(torch.device("cuda"), background=False).save(tmp_path / "b.pt", {**state, "model": {
        "w": -w, "tied": -w}})
    a, b = load_checkpoint(tmp_path / "a.pt"), load_checkpoint(tmp_path / "b.pt")
    assert torch.equal(a["model"]["w"], b["model"]["w"]) and a["model"]["w"][5].item() == 5.0
    assert a["model"]["w"].data_ptr() == a["model"]["tied"].data_ptr()
    assert stall < 5.0
    assert Path(tmp_path / "a.pt").stat().st_size < 1.5 * (4 << 20) + 10000  # the tied tensor once
