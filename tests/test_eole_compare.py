"""scripts/eole_compare.py: the corpus conversion, eole's configs and commands, and the scoring call
(the eole runs themselves need eole and a GPU; see the script's docstring)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "eole_compare.py"


def _module():
    spec = importlib.util.spec_from_file_location("eole_compare", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ec = _module()
WORDS = "open close file folder window print save delete copy move name new old all none".split()


def corpus(tmp_path: Path, n: int = 300) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for split, count in (("train", n), ("dev", 20), ("test", 20)):
        rows = [{"en": f"{WORDS[k % 15]} the {WORDS[(k * 7) % 15]}\nnumber {k}", "de": f"{k} Datei öffnen"}
                for k in range(count)]
        rows.append({"en": "skipped", "de": ""})  # an empty side: dropped as streamnmt does
        (data / f"{split}.json").write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return data


def test_dry_run_writes_text_files_configs_and_commands(tmp_path, capsys):
    data, work = corpus(tmp_path), tmp_path / "work"
    assert ec.main(["--data", str(data), "--tgt-lang", "de", "--work", str(work), "--tokenizer", "own",
                    "--vocab", "60", "--time-limit", "90", "--dry-run"]) == 0
    out = capsys.readouterr().out
    src = (work / "text" / "train.src").read_text(encoding="utf-8").splitlines()
    tgt = (work / "text" / "train.tgt").read_text(encoding="utf-8").splitlines()
    assert len(src) == len(tgt) == 300 and src[1] == "close the delete number 1" and tgt[1] == "1 Datei öffnen"
    assert len((work / "text" / "test.src").read_text().splitlines()) == 20
    cfg = yaml.safe_load((work / "train.yaml").read_text())
    model, training = cfg["model"], cfg["training"]
    assert (model["hidden_size"], model["layers"], model["heads"], model["transformer_ff"]) == (512, 6, 8, 2048)
    assert training["gpu_ranks"] == [0] and training["compute_dtype"] == "bf16"
    assert (training["decay_method"], training["warmup_steps"], training["label_smoothing"]) == ("noam", 4000, 0.1)
    assert training["batch_type"] == "tokens" and training["accum_count"] == [1]
    spm = cfg["transforms_configs"]["sentencepiece"]
    assert Path(spm["src_subword_model"]).is_file() and Path(spm["tgt_subword_model"]).is_file()
    assert cfg["data"]["corpus_1"]["path_src"] == str(work / "text" / "train.src")
    pred = yaml.safe_load((work / "predict.yaml").read_text())
    assert pred["beam_size"] == 3 and pred["src"] == str(work / "text" / "test.src")
    lines = [ln for ln in out.splitlines() if "_eole" in ln]
    assert [ln.split("_eole ")[1].split()[0] for ln in lines] == ["build_vocab", "train", "predict"]
    assert "--time-limit 90.0" in lines[1] and str(work / "train.yaml") in lines[0]
    assert "300 training pairs, 20 test" in out


def test_the_corpus_tokenizer_is_used_where_present_and_errors_are_one_line(tmp_path, capsys):
    data, work = corpus(tmp_path), tmp_path / "work"
    assert ec.main(["--data", str(data), "--tgt-lang", "de", "--work", str(work), "--tokenizer", "corpus",
                    "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer corpus" in err and "src.model" in err
    (data / "tokenizer").mkdir()
    ec.main(["--data", str(data), "--tgt-lang", "de", "--work", str(work), "--tokenizer", "own", "--vocab", "60",
             "--dry-run", "--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2"])
    for side in ("src", "tgt"):
        (data / "tokenizer" / f"{side}.model").write_bytes((work / "spm" / f"{side}.model").read_bytes())
    assert ec.main(["--data", str(data), "--tgt-lang", "de", "--work", str(work), "--dry-run"]) == 0
    cfg = yaml.safe_load((work / "train.yaml").read_text())
    assert cfg["transforms_configs"]["sentencepiece"]["tgt_subword_model"] == str(data / "tokenizer" / "tgt.model")
    assert "the corpus's" in capsys.readouterr().out
    assert ec.main(["--data", str(tmp_path / "nope"), "--work", str(work), "--dry-run"]) == 2
    assert "data directory not found" in capsys.readouterr().err


def test_scores_with_the_projects_sacrebleu_settings(tmp_path):
    hyp, ref = tmp_path / "hyp", tmp_path / "ref"
    ref.write_text("我们今天去公园散步\n他喜欢读书\n")
    hyp.write_text("我们今天去公园\n他喜欢读书\n")
    zh = ec.score(hyp, ref, "zh")
    assert "tok:zh" in zh["signature"] and 0 < zh["bleu"] < 100 and zh["sentences"] == 2
    # a key that names no language: the text decides, as the project's own score reads it
    from streamnmt.inference.scoring import score

    assert ec.score(hyp, ref, "tgt") == zh and score(hyp.read_text().splitlines(), ref.read_text().splitlines(),
                                                      "tgt")["bleu"] == zh["bleu"]
    from streamnmt.inference.scoreworker import bleu_tokenizer  # the project's choice for an unspaced target
    assert f"tok:{bleu_tokenizer('ja')}" in ec.score(hyp, ref, "ja")["signature"]
    ref.write_text("das ist gut\nwir gehen heute\n")
    hyp.write_text("das ist gut\nwir gehen\n")
    assert "tok:13a" in ec.score(hyp, ref, "de")["signature"]
    hyp.write_text("one line\n")
    try:
        ec.score(hyp, ref, "de")
    except ec.CompareError as e:
        assert "1 translations for 2" in str(e)
    else:
        raise AssertionError("a short hypothesis file must be an error")
