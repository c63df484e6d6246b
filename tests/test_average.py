"""``streamnmt average``: the mean of the weights, tied tensors kept shared, loads everywhere (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamnmt.inference.average import average_checkpoints
from streamnmt.checkpoint import save_checkpoint
from streamnmt.cli import main
from streamnmt.errors import InputError
from streamnmt.models.transformer import make_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "200", "--bleu-samples", "0", "--batch-size", "16",
        "--max-len", "32", "--dropout", "0", "--sync-strategy", "event"]


def _ckpt(path: Path, seed: int, tie: str = "none", tgt_sha: str = "t") -> dict:
    torch.manual_seed(seed)
    model = make_model(40, 40, d_model=16, n_layers=1, n_heads=2, d_ff=32, tie_embeddings=tie)
    tokenizers = {"src": {"sha256": "s", "vocab_size": 40}, "tgt": {"sha256": tgt_sha, "vocab_size": 40}}
    state = {"model": model.state_dict(), "model_shape": vars(model.shape), "tokenizers": tokenizers,
             "config": {}, "step": seed}
    save_checkpoint(path, state)
    return state


def test_average_is_the_elementwise_mean(tmp_path):
    states = [_ckpt(tmp_path / f"{i}.pt", i) for i in range(3)]
    avg = average_checkpoints([tmp_path / f"{i}.pt" for i in range(3)])
    assert list(avg["model"]) == list(states[0]["model"])
    for k, v in avg["model"].items():
        expect = torch.stack([s["model"][k] for s in states]).mean(0)
        torch.testing.assert_close(v, expect, rtol=0, atol=1e-6)
        assert v.dtype == states[0]["model"][k].dtype
    assert not torch.equal(avg["model"]["generator.weight"], states[0]["model"]["generator.weight"])
    assert avg["step"] == 2 and "optimizer" not in avg


def test_average_keeps_tied_tensors_shared(tmp_path):
    for i in range(2):
        _ckpt(tmp_path / f"{i}.pt", i, tie="all")
    avg = average_checkpoints([tmp_path / "0.pt", tmp_path / "1.pt"])["model"]
    assert avg["generator.weight"] is avg["tgt_embed.weight"] is avg["src_embed.weight"]


def test_average_refuses_other_models(tmp_path):
    _ckpt(tmp_path / "a.pt", 0)
    _ckpt(tmp_path / "b.pt", 1, tie="decoder")
    with pytest.raises(InputError, match="another model"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])


def test_average_accepts_checkpoints_that_differ_only_in_dropout(tmp_path):
    old = _ckpt(tmp_path / "old.pt", 0)  # the model_shape of a checkpoint from before the dropout settings
    old["model_shape"] = {k: v for k, v in old["model_shape"].items()
                          if k not in ("attention_dropout", "activation_dropout")}
    save_checkpoint(tmp_path / "old.pt", old)
    new = _ckpt(tmp_path / "new.pt", 1)
    new["model_shape"] = {**new["model_shape"], "attention_dropout": 0.0, "activation_dropout": 0.0}
    save_checkpoint(tmp_path / "new.pt", new)
    avg = average_checkpoints([tmp_path / "old.pt", tmp_path / "new.pt"])
    torch.testing.assert_close(avg["model"]["generator.bias"],
                               (old["model"]["generator.bias"] + new["model"]["generator.bias"]) / 2)


def test_average_cli_errors(tmp_path, capsys):
    assert main(["average", "--out", str(tmp_path / "x.pt")]) == 2
    assert "--inputs" in capsys.readouterr().err
    _ckpt(tmp_path / "a.pt", 0)
    _ckpt(tmp_path / "b.pt", 1)
    assert main(["average", "--inputs", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"),
                 "--out", str(tmp_path / "a.pt")]) == 1
    assert "one of the inputs" in capsys.readouterr().err
    assert main(["average", "--inputs", str(tmp_path / "a.pt"), str(tmp_path / "nope.pt"),
                 "--out", str(tmp_path / "o.pt")]) == 1
    assert "nope.pt" in capsys.readouterr().err and not (tmp_path / "o.pt").exists()


def test_average_last_step_checkpoints_then_translate_eval_and_finetune(tmp_path, monkeypatch, capsys):
    """The recipe in two commands: --save-every/--keep-last, then average; the result loads everywhere."""
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    assert main(["train", *TINY, "--max-steps", "12", "--save-every", "4", "--keep-last", "3",
                 "--project", str(tmp_path), "--name", "r"]) == 0
    steps = sorted((tmp_path / "r" / "weights").glob("step_*.pt"))
    assert [p.name for p in steps] == ["step_000004.pt", "step_000008.pt", "step_000012.pt"]
    out = tmp_path / "avg.pt"
    assert main(["average", "--inputs", *map(str, steps), "--out", str(out)]) == 0
    avg = torch.load(out, weights_only=True)["model"]
    each = [torch.load(p, weights_only=True)["model"] for p in steps]
    for k in avg:
        torch.testing.assert_close(avg[k], torch.stack([e[k] for e in each]).mean(0), rtol=0, atol=1e-6)
    # translate
    src = tmp_path / "in.en"
    src.write_text("I bought two apples.\nTom is ten years old.\n", encoding="utf-8")
    hyp = tmp_path / "out.zh"
    assert main(["translate", "--weights", str(out), "--input", str(src), "--output", str(hyp), "--device", "cpu",
                 "--beam-size", "1"]) == 0
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 2
    # eval
    capsys.readouterr()
    assert main(["eval", "--weights", str(out), "--device", "cpu", "--limit", "5", "--beam-size", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out
    # fine-tune from it (--weights); --resume refuses it with a pointer to --weights
    assert main(["train", *TINY, "--max-steps", "2", "--weights", str(out), "--project", str(tmp_path),
                 "--name", "ft"]) == 0
    assert main(["train", "--resume", str(out)]) == 1
    assert "--weights" in capsys.readouterr().err


def test_average_refuses_checkpoints_of_other_tokenizers(tmp_path):
    _ckpt(tmp_path / "a.pt", 0)
    _ckpt(tmp_path / "b.pt", 1, tgt_sha="other")  # the same shapes: another corpus at the same sizes
    with pytest.raises(InputError, match=r"b\.pt was trained with another tgt tokenizer than .*a\.pt"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])


def test_average_needs_two_distinct_inputs_and_a_file_to_write(tmp_path, capsys, monkeypatch):
    _ckpt(tmp_path / "a.pt", 0)
    _ckpt(tmp_path / "b.pt", 1)
    assert main(["average", "--inputs", str(tmp_path / "a.pt"), "--out", str(tmp_path / "o.pt")]) == 2
    assert "two or more" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["average", "--inputs", "a.pt", "./a.pt", "--out", "o.pt"]) == 2
    assert "twice" in capsys.readouterr().err
    (tmp_path / "outdir").mkdir()
    assert main(["average", "--inputs", "a.pt", "b.pt", "--out", "outdir"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--out: outdir is a folder" in err and ".tmp" not in err
    assert not (tmp_path / "o.pt").exists() and list((tmp_path / "outdir").iterdir()) == []
