"""``streamnmt export --format ctranslate2``: CTranslate2 translates as ``streamnmt translate`` does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from streamnmt import cli
from streamnmt.data import DataConfig, read_pairs
from streamnmt.inference.decoding import SearchOptions
from streamnmt.inference.scoring import encode_sources, translate_texts
from streamnmt.inference.export import export_ctranslate2
from streamnmt.models.transformer import Transformer
from streamnmt.inference.translate import load_for_inference

ctranslate2 = pytest.importorskip("ctranslate2")
pytestmark = pytest.mark.usefixtures("one_thread")

BUILTIN = "2000"
N_SENTENCES = 50


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A tiny model trained for 150 steps on the built-in corpus: enough for varied greedy outputs."""
    root = tmp_path_factory.mktemp("export")
    mp = pytest.MonkeyPatch()
    mp.setenv("STREAMNMT_HOME", str(tmp_path_factory.getbasetemp() / "home"))  # the session's corpora, tokenizers
    try:
        rc = cli.main(["train", "--device", "cpu", "--model", "tiny", "--builtin-size", BUILTIN, "--bleu-samples", "0",
                       "--batch-size", "32", "--max-steps", "150", "--epochs", "50", "--lr", "2", "--seed", "0",
                       "--sync-strategy", "event", "--workers", "0", "--project", str(root / "runs"), "--name", "exp"])
        assert rc == 0
        pairs = read_pairs(DataConfig(builtin_size=int(BUILTIN)), "test")[:N_SENTENCES]
    finally:
        mp.undo()
    return {"root": root, "ckpt": root / "runs" / "exp" / "weights" / "best.pt", "sources": [e for e, _ in pairs]}


def output_limits(src_tok, texts: list[str]) -> list[int]:
    """streamnmt's per-sentence output limit (decode.SearchOptions: 1.5 * source tokens + 10)."""
    opts = SearchOptions()
    sources, _ = encode_sources(src_tok, texts, 1024)
    return [int(opts.max_len_a * len(s) + opts.max_len_b) for s in sources]


def ct2_greedy(model_dir: Path, texts: list[str]) -> list[str]:
    """Translate with ctranslate2.Translator as a server would (greedy), each sentence with
    streamnmt's output limit so that outputs that never emit EOS stop at the same length."""
    import sentencepiece as spm

    sp_src = spm.SentencePieceProcessor(model_file=str(model_dir / "source.model"))
    sp_tgt = spm.SentencePieceProcessor(model_file=str(model_dir / "target.model"))
    translator = ctranslate2.Translator(str(model_dir), device="cpu", inter_threads=1, intra_threads=2)
    tokens = [sp_src.encode(t, out_type=str) for t in texts]
    limits = [int(1.5 * (len(t) + 1) + 10) for t in tokens]  # + 1: the EOS CTranslate2 appends
    out = [""] * len(texts)
    for limit in sorted(set(limits)):
        idx = [i for i, n in enumerate(limits) if n == limit]
        results = translator.translate_batch([tokens[i] for i in idx], beam_size=1, max_decoding_length=limit)
        for i, r in zip(idx, results):
            out[i] = sp_tgt.decode(r.hypotheses[0])
    return out


def test_ctranslate2_output_equals_streamnmt_translate(trained, tmp_path):
    out_dir = tmp_path / "ct2"
    assert cli.main(["export", "--weights", str(trained["ckpt"]), "--format", "ctranslate2", "--out", str(out_dir)]) == 0
    assert {"model.bin", "config.json", "source_vocabulary.json", "target_vocabulary.json", "source.model",
            "target.model"} <= {p.name for p in out_dir.iterdir()}
    src = tmp_path / "in.en"
    src.write_text("\n".join(trained["sources"]) + "\n", encoding="utf-8")
    hyp = tmp_path / "out.zh"
    assert cli.main(["translate", "--weights", str(trained["ckpt"]), "--beam-size", "1", "--device", "cpu",
                     "--input", str(src), "--output", str(hyp)]) == 0
    ours = hyp.read_text(encoding="utf-8").split("\n")[:-1]
    theirs = ct2_greedy(out_dir, trained["sources"])
    assert len(ours) == N_SENTENCES and len(set(ours)) > 10  # a trained model: varied output
    assert theirs == ours


def test_vocabulary_lists_pieces_by_id(trained, tmp_path):
    model, src_tok, tgt_tok, _ = load_for_inference(trained["ckpt"], "cpu")
    export_ctranslate2(model, src_tok, tgt_tok, tmp_path / "ct2")
    for side, tok in (("source", src_tok), ("target", tgt_tok)):
        vocab = json.loads((tmp_path / "ct2" / f"{side}_vocabulary.json").read_text(encoding="utf-8"))
        assert vocab == [tok.piece(i) for i in range(tok.vocab_size)]
    config = json.loads((tmp_path / "ct2" / "config.json").read_text(encoding="utf-8"))
    assert config["add_source_eos"] is True and config["decoder_start_token"] == tgt_tok.piece(2)


def test_tied_generator_exports(trained, tmp_path):
    model, src_tok, tgt_tok, _ = load_for_inference(trained["ckpt"], "cpu")
    tied = Transformer(model.shape)
    tied.load_state_dict(model.state_dict())
    tied.generator.weight = tied.tgt_embed.weight  # one tensor for both
    tied.eval()
    export_ctranslate2(tied, src_tok, tgt_tok, tmp_path / "ct2")
    texts = trained["sources"][:8]
    ours, _ = translate_texts(tied, src_tok, tgt_tok, texts, SearchOptions(beam_size=1), device="cpu")
    assert ct2_greedy(tmp_path / "ct2", texts) == ours


def test_errors_are_one_line_and_leave_files_alone(trained, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "ct2"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("old", encoding="utf-8")
    # an existing --out without --force
    assert cli.main(["export", "--weights", str(trained["ckpt"]), "--out", str(out_dir)]) == 2
    assert "--force" in capsys.readouterr().err
    # not a checkpoint
    bad = tmp_path / "bad.pt"
    bad.write_text("no", encoding="utf-8")
    assert cli.main(["export", "--weights", str(bad), "--out", str(out_dir), "--force"]) == 1
    assert "bad.pt" in capsys.readouterr().err
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    # ctranslate2 not installed
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    assert cli.main(["export", "--weights", str(trained["ckpt"]), "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'streamnmt[deploy]'" in err[0]
    assert not (tmp_path / "new").exists()
    # --force replaces the directory
    monkeypatch.setitem(sys.modules, "ctranslate2", ctranslate2)
    assert cli.main(["export", "--weights", str(trained["ckpt"]), "--out", str(out_dir), "--force"]) == 0
    assert not (out_dir / "keep.txt").exists() and (out_dir / "model.bin").is_file()


def test_onnx_is_not_a_format(capsys):
    assert cli.main(["export", "--weights", "w.pt", "--out", "d", "--format", "onnx"]) == 2
    assert "--format" in capsys.readouterr().err
