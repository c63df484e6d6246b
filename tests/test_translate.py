"""translate / eval commands, the inference checkpoint loader, BLEU, and their one-line errors."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from streamnmt import cli

from streamnmt.models import masks
from streamnmt.checkpoint import save_checkpoint
from streamnmt.configbase import from_dict
from streamnmt.inference.decoding import SearchOptions
from streamnmt.errors import ConfigError, InputError
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.inference.translate import (EvalConfig, TranslateConfig, bleu_on_pairs, load_for_inference, read_lines,
                                 encode_sources, run_eval, run_translate, score, translate_texts)

EN_WORDS = "the a cat dog sees likes big small red house tree runs eats fish bird green old new".split()
ZH_CHARS = "猫狗看喜欢大小红房子树跑吃鱼鸟绿老新的一个"


pytestmark = pytest.mark.usefixtures("one_thread")


def _corpus(n: int, seed: int) -> list[tuple[str, str]]:
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(n):
        k = int(torch.randint(3, 9, (1,), generator=g))
        en = " ".join(EN_WORDS[i] for i in torch.randint(len(EN_WORDS), (k,), generator=g).tolist())
        zh = "".join(ZH_CHARS[i] for i in torch.randint(len(ZH_CHARS), (k + 1,), generator=g).tolist())
        pairs.append((en, zh + "。"))
    return pairs


def _train_spm(path: Path, sentences: list[str], vocab: int) -> Path:
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(path), vocab_size=vocab,
                                   pad_id=0, unk_id=1, bos_id=2, eos_id=3, hard_vocab_limit=False,
                                   character_coverage=1.0, minloglevel=2)
    return path.with_suffix(".model")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Tokenizers, a data dir in the {"en", "ch"} JSON layout, and a tiny checkpoint naming both."""
    root = tmp_path_factory.mktemp("translate")
    pairs = _corpus(300, seed=0)
    src_spm = _train_spm(root / "src", [e for e, _ in pairs], 48)
    tgt_spm = _train_spm(root / "tgt", [z for _, z in pairs], 40)
    other_spm = _train_spm(root / "other", [e for e, _ in pairs], 36)
    data = root / "data"
    data.mkdir()
    for split, chunk in (("train", pairs[:200]), ("dev", pairs[200:240]), ("test", pairs[240:])):
        (data / f"{split}.json").write_text(json.dumps([{"en": e, "ch": z} for e, z in chunk], ensure_ascii=False),
                                            encoding="utf-8")
    sp_src, sp_tgt = spm.SentencePieceProcessor(model_file=str(src_spm)), spm.SentencePieceProcessor(model_file=str(tgt_spm))
    torch.manual_seed(0)
    shape = ModelShape(sp_src.get_piece_size(), sp_tgt.get_piece_size(), d_model=32, n_layers=2, n_heads=4,
                       d_ff=64, dropout=0.1, max_positions=64)
    model = Transformer(shape)
    with torch.no_grad():
        model.generator.bias[masks.EOS] = 1.0  # random weights: let outputs end before their limit
    tokenizers = {side: {"path": str(p.resolve()), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                         "vocab_size": sp.get_piece_size()}
                  for side, p, sp in (("src", src_spm, sp_src), ("tgt", tgt_spm, sp_tgt))}
    state = {"model": model.state_dict(), "model_shape": vars(shape).copy(), "tokenizers": tokenizers,
             "config": {"data": {"data": str(data), "src_lang": "en", "tgt_lang": "ch"}}, "epoch": 1}
    ckpt = root / "best.pt"
    save_checkpoint(ckpt, state)
    return {"root": root, "ckpt": ckpt, "state": state, "data": data, "pairs": pairs, "src_spm": src_spm,
            "tgt_spm": tgt_spm, "other_spm": other_spm}


def _translate(env, **kw) -> int:
    return run_translate(TranslateConfig(weights=str(env["ckpt"]), device="cpu", **kw))


INPUT = "the cat sees a dog\n\nbig red house\n   \nold bird eats fish"  # no final newline


# -- translate -------------------------------------------------------------------------------

def test_translate_file_keeps_lines_and_order(env, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(INPUT, encoding="utf-8")
    out = tmp_path / "sub" / "out.txt"
    assert _translate(env, input=str(src), output=str(out)) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 6  # five lines, each ended by a newline
    assert lines[1] == "" and lines[3] == ""
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    expect, _ = translate_texts(model, src_tok, tgt_tok, ["the cat sees a dog", "big red house", "old bird eats fish"],
                                SearchOptions(), device="cpu")
    assert [lines[0], lines[2], lines[4]] == expect
    assert any(expect)


def test_translate_stdin_stdout(env, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n" + INPUT + "\n\n").encode())))
    assert _translate(env, beam_size=1) == 0
    captured = capsys.readouterr()
    lines = captured.out.split("\n")
    assert len(lines) == 8 and lines[-1] == ""
    assert [i for i, line in enumerate(lines[:-1]) if line == ""] == [0, 2, 4, 6]
    assert "translated 7 lines (3 non-empty)" in captured.err


def test_translate_answers_each_line_of_a_pipe_before_the_input_ends(env):
    # fairseq-interactive's and Marian's habit: a program (or a person) writes a line and waits for
    # its translation; the whole input was read before the first line was translated
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    sentences = ["the cat sees a dog", "big red house"]
    expect, _ = translate_texts(model, src_tok, tgt_tok, sentences, SearchOptions(beam_size=1), device="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "streamnmt", "translate", "--weights", str(env["ckpt"]),
                             "--device", "cpu", "--beam-size", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for sentence, want in zip(sentences, expect):
            proc.stdin.write((sentence + "\n").encode())
            proc.stdin.flush()
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout=120)
            assert got == [(want + "\n").encode()], f"no translation of {sentence!r} while the input stayed open"
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        assert "translated 2 lines" in proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()


def test_translate_truncates_long_lines_with_warning(env, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a cat\n" + " ".join(["the big red house"] * 10) + "\n", encoding="utf-8")
    assert _translate(env, input=str(src), output=str(tmp_path / "out.txt"), max_input_len=6) == 0
    err = capsys.readouterr().err
    assert f"{src}:2: input longer than 6 tokens" in err and "truncated" in err
    assert f"{src}:1:" not in err


def test_read_lines_crlf_and_bom(tmp_path):
    p = tmp_path / "in.txt"
    p.write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n\r\n")
    assert read_lines(str(p)) == (str(p), ["one", "two", ""])
    p.write_bytes(b"\xef\xbb\xbfab\n\xff")
    with pytest.raises(InputError, match=r"in.txt:2: not UTF-8 .*byte offset 6"):  # offsets count the BOM
        read_lines(str(p))


def test_encoder_input_is_tokens_then_eos_like_training_batches(env):
    _, src_tok, _, _ = load_for_inference(env["ckpt"], "cpu")
    texts = ["the cat", " ".join(["big red house"] * 8)]
    sources, cut = encode_sources(src_tok, texts, 6)
    assert sources[0] == src_tok.encode("the cat") + [masks.EOS]
    assert sources[1] == src_tok.encode(texts[1])[:5] + [masks.EOS]
    assert cut == [1]


def test_cli_translate_and_errors(env, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text(INPUT, encoding="utf-8")
    assert cli.main(["translate", "--weights", str(env["ckpt"]), "--input", str(src), "--output", str(out),
                     "--device", "cpu", "--no-cached", "--beam-size", "2"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 5
    assert cli.main(["translate", "--weights", str(tmp_path / "nope.pt"), "--device", "cpu"]) == 1
    assert cli.main(["translate", "--weights", str(env["ckpt"]), "--beam-size", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "nope.pt" in err[1] and "--beam-size" in err[2]


def test_translate_writes_through_a_link_and_into_a_pipe(env, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(INPUT, encoding="utf-8")
    real, link = tmp_path / "real.txt", tmp_path / "link.txt"
    real.write_text("old\n", encoding="utf-8")
    link.symlink_to(real)
    assert _translate(env, input=str(src), output=str(link), beam_size=1) == 0
    assert link.is_symlink() and len(real.read_text(encoding="utf-8").splitlines()) == 5
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()  # blocks in open() until the writer opens the pipe
    assert _translate(env, input=str(src), output=str(fifo), beam_size=1) == 0
    reader.join(30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # the pipe was written into, not replaced by a file
    assert got and got[0].decode("utf-8") == real.read_text(encoding="utf-8")


def test_output_to_dev_stderr_writes_to_the_redirected_file_without_replacing_it(tmp_path):
    log = tmp_path / "err.log"
    log.write_text("first\n", encoding="utf-8")
    code = ("import sys\n"
            "from streamnmt.fsutil import write_output\n"
            "print('printed before', file=sys.stderr)\n"
            "write_output('/dev/stderr', 'translation\\n'.encode())\n"
            "print('printed after', file=sys.stderr)\n")
    with open(log, "ab") as err:  # the shell's 2>> err.log
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert log.read_text(encoding="utf-8") == "first\nprinted before\ntranslation\nprinted after\n"


def test_translate_writes_utf8_to_a_stdout_of_another_encoding(env, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(INPUT.encode())))
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="latin-1"))
    assert _translate(env, beam_size=1) == 0
    text = raw.getvalue().decode("utf-8")
    assert any(ord(c) > 255 for c in text)  # Chinese, which latin-1 cannot hold
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    expect, _ = translate_texts(model, src_tok, tgt_tok, ["the cat sees a dog"], SearchOptions(beam_size=1),
                                device="cpu")
    assert text.split("\n")[0] == expect[0]


def test_nbest_lists_rank_the_beams_finished_hypotheses(env):
    from streamnmt.inference.search import beam_search_scored, nbest_search, pad_batch

    model, src_tok, _, _ = load_for_inference(env["ckpt"], "cpu")
    src = pad_batch([src_tok.encode(e) + [masks.EOS] for e, _ in env["pairs"][:6]], "cpu")
    opts = SearchOptions(beam_size=4)
    best, best_scores = beam_search_scored(model, src, opts)
    lists = nbest_search(model, src, opts, 3)
    assert len(lists) == 6
    for hyps, ids, sc in zip(lists, best, best_scores):
        assert 1 <= len(hyps) <= 3 and hyps[0] == (ids, pytest.approx(sc))
        scores = [s for _, s in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h) for h, _ in hyps}) == len(hyps)  # distinct hypotheses
    assert any(len(hyps) == 3 for hyps in lists)
    with pytest.raises(ValueError, match="beam_size"):
        nbest_search(model, src, opts, 5)


def test_translate_nbest_writes_moses_lines_for_every_input_line(env, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text(INPUT, encoding="utf-8")  # five lines, two of them empty
    assert _translate(env, input=str(src), output=str(out), beam_size=3, nbest=2) == 0
    rows = [line.split(" ||| ") for line in out.read_text(encoding="utf-8").splitlines()]
    assert all(len(r) == 4 and r[2] == f"F0= {r[3]}" for r in rows)
    numbers = [int(r[0]) for r in rows]
    assert sorted(set(numbers)) == [0, 1, 2, 3, 4] and numbers == sorted(numbers)
    assert [r[1] for r in rows if int(r[0]) in (1, 3)] == ["", ""]
    plain = tmp_path / "plain.txt"
    assert _translate(env, input=str(src), output=str(plain), beam_size=3) == 0
    firsts = {}
    for r in rows:
        firsts.setdefault(int(r[0]), r[1])
    assert [firsts[i] for i in range(5)] == plain.read_text(encoding="utf-8").split("\n")[:5]
    with pytest.raises(ConfigError, match="--nbest"):
        TranslateConfig(weights="w.pt", beam_size=2, nbest=3)


# -- eval and BLEU ---------------------------------------------------------------------------

def test_eval_prints_bleu_and_chrf(env, capsys):
    assert run_eval(EvalConfig(weights=str(env["ckpt"]), device="cpu", split="dev")) == 0
    out = capsys.readouterr().out
    assert "dev: 40 sentences, beam 3" in out and "sentences/s" in out
    assert "BLEU = " in out and "chrF = " in out and "tok:zh" in out
    assert run_eval(EvalConfig(weights=str(env["ckpt"]), device="cpu", data=str(env["data"]), limit=5,
                               beam_size=1)) == 0
    assert "test: 5 sentences, beam 1" in capsys.readouterr().out


def test_eval_writes_its_translations_in_the_splits_order(env, tmp_path, capsys):
    out = tmp_path / "hyp.zh"
    assert cli.main(["eval", "--weights", str(env["ckpt"]), "--device", "cpu", "--split", "dev", "--beam-size", "1",
                     "--output", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 41  # 40 dev sentences, each ended by a newline
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    dev = [e for e, _ in env["pairs"][200:240]]
    expect, _ = translate_texts(model, src_tok, tgt_tok, dev, SearchOptions(beam_size=1), device="cpu")
    assert lines[:-1] == expect
    # a pair with an empty side is not scored: its line stays, empty, so the file aligns with the split
    data = _eval_corpus(tmp_path / "gaps", [{"en": e, "ch": z} for e, z in env["pairs"][200:204]]
                        + [{"en": "the cat", "ch": ""}] + [{"en": e, "ch": z} for e, z in env["pairs"][204:206]])
    assert cli.main(["eval", "--weights", str(env["ckpt"]), "--device", "cpu", "--data", str(data), "--beam-size",
                     "1", "--output", str(out)]) == 0
    lines = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert len(lines) == 7 and lines[4] == "" and lines[:4] == expect[:4] and lines[5:] == expect[4:6]


def _eval_corpus(root: Path, records: list[dict]) -> Path:
    root.mkdir()
    for split in ("train", "dev", "test"):
        (root / f"{split}.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    return root


def test_eval_reads_a_corpus_of_other_keys_with_the_language_flags(env, tmp_path, capsys):
    data = _eval_corpus(tmp_path / "zhkey", [{"english": e, "zh": z} for e, z in env["pairs"][:12]])
    with pytest.raises(InputError, match="'en'"):
        run_eval(EvalConfig(weights=str(env["ckpt"]), device="cpu", data=str(data), beam_size=1))
    assert cli.main(["eval", "--weights", str(env["ckpt"]), "--device", "cpu", "--data", str(data),
                     "--src-lang", "english", "--tgt-lang", "zh", "--beam-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "test: 12 sentences" in out and "tok:zh" in out


def test_eval_warns_of_empty_sides_and_truncated_sources(env, tmp_path, capsys):
    records = [{"en": e, "ch": z} for e, z in env["pairs"][:10]]
    records[3]["ch"] = ""
    records[7]["en"] = "   "
    records[5]["en"] = " ".join(["the big red house"] * 30)  # over the model's 64 positions
    data = _eval_corpus(tmp_path / "gaps", records)
    assert run_eval(EvalConfig(weights=str(env["ckpt"]), device="cpu", data=str(data), beam_size=1)) == 0
    captured = capsys.readouterr()
    assert "test: 8 sentences" in captured.out
    assert "test: 2 of 10 pairs have an empty side and are not scored" in captured.err
    assert "test: 1 sources longer than the model's 64 positions" in captured.err
    assert "(records 6 of the split)" in captured.err  # the file's 6th record, the 5th pair scored


def test_eval_names_the_flag_where_the_checkpoints_corpus_moved(env, tmp_path):
    ckpt = tmp_path / "moved.pt"
    save_checkpoint(ckpt, {**env["state"], "config": {"data": {"data": str(tmp_path / "gone"), "src_lang": "en",
                                                                "tgt_lang": "ch"}}})
    with pytest.raises(InputError, match=r"was trained on .*gone, which is not there now; .*--data DIR"):
        run_eval(EvalConfig(weights=str(ckpt), device="cpu"))
    assert run_eval(EvalConfig(weights=str(ckpt), device="cpu", data=str(env["data"]), limit=2, beam_size=1)) == 0


def test_bleu_on_pairs_scores_against_references_and_restores_mode(env):
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    sources = [e for e, _ in env["pairs"][:30]]
    hyps, _ = translate_texts(model, src_tok, tgt_tok, sources, SearchOptions(), device="cpu")
    own = [(s, h) for s, h in zip(sources, hyps) if len(h) >= 4]
    assert len(own) >= 5
    model.train()
    res = bleu_on_pairs(model, src_tok, tgt_tok, own, device="cpu", beam_size=3, tgt_lang="ch")
    assert model.training
    assert res["bleu"] == pytest.approx(100.0) and res["chrf"] == pytest.approx(100.0)
    assert res["n"] == len(own) and res["seconds"] > 0
    shifted = [(s, h) for (s, _), (_, h) in zip(own, own[1:] + own[:1])]  # references out of order
    model.eval()
    res = bleu_on_pairs(model, src_tok, tgt_tok, shifted, device="cpu", limit=4)
    assert res["bleu"] < 100 and res["n"] == 4 and not model.training


def test_a_stopped_bleu_pass_scores_the_batches_it_decoded(env):
    """stop() is asked between batches: the first batch always decodes, the scores are those of the
    sentences decoded (the longest first), and their count is returned."""
    model, src_tok, tgt_tok, _ = load_for_inference(env["ckpt"], "cpu")
    pairs = env["pairs"][:20]
    asked: list[int] = []
    res = bleu_on_pairs(model, src_tok, tgt_tok, pairs, device="cpu", beam_size=1, batch_size=8, tgt_lang="ch",
                        stop=lambda: asked.append(1) or len(asked) >= 2)
    assert res["n"] == 16 and len(asked) == 2
    longest = sorted(range(len(pairs)), key=lambda i: -len(encode_sources(src_tok, [pairs[i][0]],
                                                                           model.shape.max_positions)[0][0]))[:16]
    alone = bleu_on_pairs(model, src_tok, tgt_tok, [pairs[i] for i in longest], device="cpu", beam_size=1,
                          batch_size=8, tgt_lang="ch")
    assert alone["n"] == 16 and res["bleu"] == pytest.approx(alone["bleu"])
    assert bleu_on_pairs(model, src_tok, tgt_tok, pairs, device="cpu", beam_size=1, batch_size=8, tgt_lang="ch",
                         stop=lambda: False)["n"] == 20


def test_score_uses_zh_tokenizer_for_chinese():
    import sacrebleu

    hyp, ref = ["我们是学生"], ["我们是学生们"]  # one "word" each to 13a
    assert score(hyp, ref, "ch")["bleu"] > 0 and sacrebleu.BLEU(tokenize="13a").corpus_score(hyp, [ref]).score == 0
    assert score(hyp, ref, "tgt") == score(hyp, ref, "ch")  # a key that says no language: the text does
    assert score([], [], "ch")["bleu"] == 0.0


def test_unspaced_targets_are_scored_by_words_or_characters_not_whole_sentences():
    from streamnmt.inference.scoreworker import bleu_tokenizer

    assert bleu_tokenizer("ch") == bleu_tokenizer("zh_CN") == "zh"
    assert bleu_tokenizer("de") == bleu_tokenizer("pt-BR") == "13a"
    assert bleu_tokenizer("th") == "char" and bleu_tokenizer("ja_JP") in ("ja-mecab", "char")
    assert bleu_tokenizer("ko") in ("ko-mecab", "13a")  # Korean spaces its words: never by characters
    hyp, ref = ["ファイルを開けません"], ["ファイルを開けませんでした"]  # one "word" each to 13a
    assert score(hyp, ref, "ja")["bleu"] > 0 and score(hyp, ref, "tgt") == score(hyp, ref, "ja")
    assert "tok:" + bleu_tokenizer("ja") in score(hyp, ref, "ja")["signature"]


def test_a_pool_started_for_a_key_scores_the_language_its_references_are():
    """A run's pool is started with its key before the references are read; references that the key
    does not name (Chinese under ``tgt``) get the pool's workers restarted for Chinese, once."""
    from streamnmt.inference.scoring import ScorePool, Scorer

    pool = ScorePool("tgt", workers=1)
    started = [pool.workers[0]]
    hyp, ref = ["我们是学生"], ["我们是学生们"]
    for _ in range(2):  # two passes: the first restarts the worker, the second keeps it
        scorer = Scorer(ref, "tgt", pool=pool)
        assert scorer.tgt_lang == pool.tgt_lang == "zh" and len(pool.workers) == 1
        scorer.add([0], hyp)
        assert scorer.result()["bleu"] == score(hyp, ref, "zh")["bleu"] > 0
        started.append(pool.workers[0])
    assert started[1] is not started[0] and not started[0].alive and started[2] is started[1]
    pool.close()


def _language_keys() -> list[str]:
    from streamnmt.data.tokenizer import CJK
    from streamnmt.inference.scoreworker import ALIASES, MORPHOLOGICAL, UNSPACED

    return sorted(CJK | set(ALIASES) | set(UNSPACED) | set(MORPHOLOGICAL) | {"de", "en"})


@pytest.mark.parametrize("key", _language_keys())
def test_the_tokenizers_and_bleu_read_every_language_key_alike(key):
    """The tokenizers' keys (streamnmt.data.tokenizer.CJK) and BLEU's (scoreworker.ALIASES) are two tables
    (the scoring worker imports nothing of the package): a key the tokenizers train as Chinese or
    Japanese (``jp``, ``cn``, ``zho_Hans``) must not be scored by 13a, which counts a sentence without
    spaces as one word, and a key BLEU scores as one of the three must train as it."""
    from streamnmt.data.tokenizer import is_cjk, is_unspaced
    from streamnmt.inference.scoreworker import bleu_tokenizer, language

    lang = language(key)
    assert is_cjk(key) == (lang in ("zh", "ja", "ko")) and is_unspaced(key) == (lang in ("zh", "ja"))
    assert bleu_tokenizer(key) == bleu_tokenizer(lang) == bleu_tokenizer(f"{key}_Xxxx")  # a region or script
    assert is_cjk(f"{key}-Xxxx") == is_cjk(key) and is_unspaced(f"{key.upper()}_Xxxx") == is_unspaced(key)
    if is_unspaced(key):
        assert bleu_tokenizer(key) in ("zh", "ja-mecab", "char")


def _scorer_case(n: int = 50):
    import random

    rng = random.Random(0)
    words = ["我们", "是", "学生", "老师", "the", "cat", "sat", "on", "mat", "今天", "天气", "很", "好"]
    refs = [" ".join(rng.choices(words, k=rng.randint(2, 12))) for _ in range(n)]
    hyps = [" ".join(rng.choices(words, k=rng.randint(1, 12))) if i % 7 else r for i, r in enumerate(refs)]
    order = list(range(n))
    rng.shuffle(order)
    return refs, hyps, [order[k:k + 16] for k in range(0, n, 16)]


@pytest.mark.parametrize("lang", ["ch", "en"])
def test_scorer_batch_by_batch_equals_the_corpus_score(lang):
    """The scores from segment statistics extracted batch by batch, in any order, in the worker
    processes, are those of one corpus_score call (BLEU, chrF and the signature)."""
    from streamnmt.inference.scoring import Scorer

    refs, hyps, batches = _scorer_case()
    want = score(hyps, refs, lang)
    scorer = Scorer(refs, lang, workers=2)
    assert scorer.incremental  # sacrebleu has the segment-statistics methods
    for idx in batches:
        scorer.add(idx, [hyps[i] for i in idx])
    got = scorer.result()
    assert sorted(scorer._stats) == list(range(len(batches)))  # every batch was scored by a worker
    assert all(w.proc.returncode == 0 for w in scorer._workers) and len(scorer._workers) == 2
    assert got["bleu"] == pytest.approx(want["bleu"], abs=1e-9) and 0 < want["bleu"] < 100
    assert got["chrf"] == pytest.approx(want["chrf"], abs=1e-9) and got["signature"] == want["signature"]
    short = Scorer(refs, lang)
    short.add([0], [hyps[0]])
    with pytest.raises(ValueError, match="no translation added for sentence 1"):
        short.result()
    assert all(w.proc.poll() is not None for w in short._workers)  # stopped even so


def test_scorer_scores_in_process_what_a_dead_worker_left():
    """A worker killed mid-way (or none at all): the missing batches are scored at the end, same numbers."""
    from streamnmt.inference.scoring import Scorer

    refs, hyps, batches = _scorer_case()
    want = score(hyps, refs, "ch")
    for workers in (1, 0):
        scorer = Scorer(refs, "ch", workers=workers)
        for k, idx in enumerate(batches):
            if k == 1 and workers:
                scorer._workers[0].proc.kill()
                scorer._workers[0].proc.wait()
            scorer.add(idx, [hyps[i] for i in idx])
        got = scorer.result()
        assert len(scorer._stats) < len(batches)  # some (all, without workers) were scored here
        assert got["bleu"] == pytest.approx(want["bleu"], abs=1e-9)
        assert got["chrf"] == pytest.approx(want["chrf"], abs=1e-9)


def test_a_score_pool_serves_many_passes_with_the_same_numbers():
    """A training run's evaluations share one pool of workers: each pass scores as one corpus_score
    call would, the workers stay up between passes, and a dead worker's batches are scored here."""
    import signal

    from streamnmt.inference.scoring import ScorePool, Scorer

    refs, hyps, batches = _scorer_case()
    want = score(hyps, refs, "ch")
    pool = ScorePool("ch", workers=2)
    try:
        procs = [w.proc for w in pool.workers]
        for k in range(3):
            scorer = Scorer(refs, "ch", pool=pool)
            for j, idx in enumerate(batches):
                if k == 2 and j == 0:  # it takes batches but answers none ...
                    os.kill(pool.workers[0].proc.pid, signal.SIGSTOP)
                if k == 2 and j == 2:  # ... and dies mid-pass: the batches it was given are lost with it
                    pool.workers[0].proc.kill()
                    pool.workers[0].proc.wait()
                scorer.add(idx, [hyps[i] for i in idx])
            got = scorer.result()
            assert got["bleu"] == pytest.approx(want["bleu"], abs=1e-9)
            assert got["chrf"] == pytest.approx(want["chrf"], abs=1e-9) and got["signature"] == want["signature"]
            if k < 2:
                assert len(scorer._stats) == len(batches)  # every batch scored by the pool's workers
                assert all(p.poll() is None for p in procs)  # and they are still up for the next pass
        assert 0 < len(scorer._stats) < len(batches)  # the dead worker's share was scored in-process
        assert not pool.results  # nothing left behind for a later pass
        assert len(pool.workers) == 1  # the dead one is dropped: later batches go to the live one
    finally:
        pool.close()
    assert all(p.poll() is not None for p in procs)


def test_a_hung_score_worker_neither_blocks_decoding_nor_the_next_pass(monkeypatch):
    """A worker that stops answering (SIGSTOP) with its pipe full: adding batches never blocks, the
    pass waits for it WORKER_TIMEOUT_S at most, scores its batches in-process, and the worker is
    killed and dropped, so that the next pass does not wait for it again."""
    import signal
    import time

    from streamnmt.inference import scoring
    from streamnmt.inference.scoring import ScorePool, Scorer

    monkeypatch.setattr(scoring, "WORKER_TIMEOUT_S", 3.0)
    refs = [f"句子 {i} " + "字" * 200 for i in range(512)]  # ~300 kB of text: more than a pipe holds
    hyps = [r[:-3] for r in refs]
    batches = [list(range(k, k + 64)) for k in range(0, len(refs), 64)]
    want = score(hyps, refs, "ch")
    pool = ScorePool("ch", workers=2)
    try:
        hung = pool.workers[0].proc
        os.kill(hung.pid, signal.SIGSTOP)
        for _ in range(2):
            scorer = Scorer(refs, "ch", pool=pool)
            began = time.monotonic()
            for idx in batches:
                scorer.add(idx, [hyps[i] for i in idx])
            assert time.monotonic() - began < 5.0  # queued, never written on this thread
            got = scorer.result()
            assert got["bleu"] == pytest.approx(want["bleu"], abs=1e-9)
            assert got["chrf"] == pytest.approx(want["chrf"], abs=1e-9)
        assert hung.poll() is not None and len(pool.workers) == 1
    finally:
        pool.close()


# -- bad input -------------------------------------------------------------------------------

def test_weights_missing(tmp_path):
    with pytest.raises(InputError, match="nope.pt"):
        load_for_inference(tmp_path / "nope.pt", "cpu")


def test_not_a_checkpoint(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("hello", encoding="utf-8")
    with pytest.raises(InputError, match=r"not a .*streamnmt checkpoint") as e:
        load_for_inference(text, "cpu")
    assert str(text) in str(e.value)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(InputError, match=r"not a streamnmt checkpoint") as e:
        load_for_inference(other, "cpu")
    assert str(other) in str(e.value)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_safetensors_file_points_to_the_checkpoint_beside_it(tmp_path):
    st = tmp_path / "best.safetensors"
    st.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(InputError, match=r"weights alone .*pass the streamnmt checkpoint beside it: .*best\.pt"):
        load_for_inference(st, "cpu")


def test_pickle_payload_is_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": "streamnmt-checkpoint", "version": 1, "model": _Payload(marker)}, evil)
    torch.load(evil, weights_only=False)  # the payload works when unpickled ...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(InputError, match="evil.pt"):
        load_for_inference(evil, "cpu")
    assert not marker.exists()  # ... and the loader never unpickled it


def test_tokenizer_missing_names_path_and_flag(env, tmp_path):
    state = json.loads(json.dumps(env["state"]["tokenizers"]))
    state["src"]["path"] = str(tmp_path / "gone.model")
    ckpt = tmp_path / "moved.pt"
    save_checkpoint(ckpt, {**env["state"], "tokenizers": state})
    with pytest.raises(InputError, match="gone.model") as e:
        load_for_inference(ckpt, "cpu")
    assert "--tokenizer-src" in str(e.value)
    model, src_tok, _, _ = load_for_inference(ckpt, "cpu", tokenizer_src=str(env["src_spm"]))
    assert src_tok.vocab_size == model.shape.src_vocab


def test_tokenizer_of_other_content_warns(env, tmp_path, capsys):
    tokenizers = json.loads(json.dumps(env["state"]["tokenizers"]))
    tokenizers["tgt"]["sha256"] = "0" * 64
    ckpt = tmp_path / "retrained.pt"
    save_checkpoint(ckpt, {**env["state"], "tokenizers": tokenizers})
    load_for_inference(ckpt, "cpu")
    err = capsys.readouterr().err
    assert "tgt.model: not the tgt tokenizer the model was trained with" in err and "src.model" not in err


def test_tokenizer_of_other_vocab_size(env):
    with pytest.raises(InputError, match="other.model") as e:
        load_for_inference(env["ckpt"], "cpu", tokenizer_src=str(env["other_spm"]))
    n_other = spm.SentencePieceProcessor(model_file=str(env["other_spm"])).get_piece_size()
    assert f"{n_other} pieces" in str(e.value) and f"has {env['state']['model_shape']['src_vocab']}" in str(e.value)
    assert "--tokenizer-src" in str(e.value)


def test_input_not_utf8(env, tmp_path, monkeypatch):
    src = tmp_path / "latin1.txt"
    src.write_bytes(b"good line\ncaf\xe9\n")
    with pytest.raises(InputError, match=r"latin1.txt:2: not UTF-8 .*byte offset 13"):
        _translate(env, input=str(src))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\n")))
    with pytest.raises(InputError, match=r"<stdin>:1: not UTF-8 .*byte offset 0"):
        _translate(env)


def test_input_missing(env, tmp_path):
    with pytest.raises(InputError, match="absent.txt"):
        _translate(env, input=str(tmp_path / "absent.txt"))


@pytest.mark.parametrize("values,flag", [
    ({}, "--weights"),
    ({"weights": "w.pt", "beam_size": "0"}, "--beam-size"),
    ({"weights": "w.pt", "device": "tpu"}, "--device"),
    ({"weights": "w.pt", "max_input_len": "1"}, "--max-input-len"),
    ({"weights": "w.pt", "len_penalty": "-1"}, "--len-penalty"),
])
def test_translate_config_errors_name_the_flag(values, flag):
    with pytest.raises(ConfigError, match=flag):
        from_dict(TranslateConfig, values)


def test_eval_refuses_one_key_for_both_sides(env):
    with pytest.raises(InputError, match=r"^--tgt-lang .*must differ from --src-lang \(en\)"):
        run_eval(EvalConfig(weights=str(env["ckpt"]), device="cpu", data=str(env["data"]), tgt_lang="en"))


def test_eval_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--split"):
        EvalConfig(weights="w.pt", split="train")
    assert EvalConfig(weights="w.pt", split="valid").split == "dev"  # fairseq's name of the dev split
    with pytest.raises(ConfigError, match="--limit"):
        EvalConfig(weights="w.pt", limit=-1)


def test_beam_larger_than_half_the_vocabulary(env):
    with pytest.raises(ConfigError, match="--beam-size"):
        _translate(env, beam_size=1000, input=os.devnull)


def test_train_and_translate_do_not_import_each_other():
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in ('streamnmt.training.trainer', 'streamnmt.inference.translate') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    pairs = (("streamnmt.inference.translate", "streamnmt.training.trainer"),
             ("streamnmt.training.trainer", "streamnmt.inference.translate"))
    # one fresh process per module, both at once (each start is mostly torch's import)
    procs = [subprocess.Popen([sys.executable, "-c", code, module], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for module, _ in pairs]
    for (module, other), proc in zip(pairs, procs):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == repr([module]), (module, other, out)


def test_graph_decoding_is_the_default_and_no_graph_turns_it_off():
    args = vars(cli.build_parser().parse_args(["translate", "--weights", "w.pt", "--no-graph"]))
    assert args["graph"] is False
    assert from_dict(TranslateConfig, {"weights": "w.pt"}).search_options().graph is True
    assert from_dict(EvalConfig, {"weights": "w.pt", "graph": False}).search_options().graph is False
    assert from_dict(TranslateConfig, {"weights": "w.pt", "cached": False}).search_options().graph is False
