"""A model you can take away: checkpoints carry their tokenizers, resume takes new limits, --dtype.

CPU, tiny model, a corpus directory of its own (the tokenizers are trained into it), so that the
corpus and its tokenizers can be deleted after training.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from streamnmt.inference.average import average_checkpoints
from streamnmt.checkpoint import embedded_tokenizer, load_checkpoint, save_checkpoint
from streamnmt.cli import build_parser, main
from streamnmt.config import RESUME_SETTINGS, build_job
from streamnmt.inference.decoding import decode_dtype, decoding_copy
from streamnmt.errors import ConfigError, InputError
from streamnmt.models.transformer import make_model
from streamnmt.training.runs import read_csv
from streamnmt.training.trainer import Trainer
from streamnmt.inference.translate import EvalConfig, TranslateConfig, load_for_inference

pytestmark = pytest.mark.usefixtures("one_thread")

EN = "the a cat dog sees likes big small red house tree runs eats fish bird green old new".split()
ZH = "猫狗看喜欢大小红房子树跑吃鱼鸟绿老新的一个"
TINY = ["--device", "cpu", "--model", "tiny", "--bleu-samples", "0", "--batch-size", "16", "--max-len", "32",
        "--dropout", "0", "--sync-strategy", "event", "--loss-interval", "1", "--src-vocab", "40",
        "--tgt-vocab", "40", "--eval-dtype", "fp32"]
INPUT = "the cat sees a dog\nbig red house\nold bird eats fish\n"


@pytest.fixture(autouse=True)
def home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "home"
    monkeypatch.setenv("STREAMNMT_HOME", str(home))
    return home


def write_corpus(directory: Path, n: int = 240) -> Path:
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(n):
        k = int(torch.randint(3, 8, (1,), generator=g))
        en = " ".join(EN[i] for i in torch.randint(len(EN), (k,), generator=g).tolist())
        zh = "".join(ZH[i] for i in torch.randint(len(ZH), (k + 1,), generator=g).tolist())
        pairs.append({"en": en, "ch": zh + "。"})
    directory.mkdir(parents=True)
    for split, chunk in (("train", pairs[:200]), ("dev", pairs[200:220]), ("test", pairs[220:])):
        (directory / f"{split}.json").write_text(json.dumps(chunk, ensure_ascii=False), encoding="utf-8")
    return directory


def make_trainer(root: Path, corpus: Path, *flags: str, log=None) -> Trainer:
    args = vars(build_parser().parse_args(["train", *TINY, "--data", str(corpus), "--project", str(root), *flags]))
    for key in ("_run", "command"):
        args.pop(key)
    return Trainer(build_job(args), log=log or (lambda _: None))


def step_losses(run: Path) -> list[tuple[str, str]]:
    return [(r["step"], r["loss"]) for r in read_csv(run / "steps.csv")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("portable")
    corpus = write_corpus(root / "corpus")
    make_trainer(root, corpus, "--name", "run", "--epochs", "1", "--max-steps", "8", "--ema", "0.9",
                 "--best-metric", "val_loss").train()
    return {"root": root, "corpus": corpus, "run": root / "run"}


def outputs(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


def test_checkpoint_alone_translates_and_evaluates_without_corpus(trained, tmp_path, capsys):
    run, corpus = trained["run"], trained["corpus"]
    src = tmp_path / "in.txt"
    src.write_text(INPUT, encoding="utf-8")
    refs = tmp_path / "refs"
    refs.mkdir()
    shutil.copy(corpus / "test.json", refs / "test.json")  # eval needs references, not the corpus
    common = ["--device", "cpu", "--beam-size", "2", "--input", str(src)]
    before = {name: outputs(capsys, ["translate", "--weights", str(run / "weights" / name), *common])
              for name in ("best.pt", "last.pt", "ema.pt")}
    score = outputs(capsys, ["eval", "--weights", str(run / "weights" / "best.pt"), "--device", "cpu",
                             "--data", str(refs)])
    # the checkpoints alone, elsewhere; the corpus, its tokenizers and the run directory gone
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in before:
        shutil.copy(run / "weights" / name, moved / name)
    avg = average_checkpoints([moved / "best.pt", moved / "last.pt"])
    save_checkpoint(moved / "avg.pt", avg)
    tmp_corpus, tmp_run = tmp_path / "corpus.bak", tmp_path / "run.bak"
    shutil.move(corpus, tmp_corpus)
    shutil.move(run, tmp_run)
    try:
        assert not (corpus / "tokenizer").exists()
        for name, text in before.items():
            assert outputs(capsys, ["translate", "--weights", str(moved / name), *common]) == text
            assert len(text.splitlines()) == 3 and any(text.splitlines())
        assert outputs(capsys, ["eval", "--weights", str(moved / "best.pt"), "--device", "cpu",
                                "--data", str(refs)]) .splitlines()[1] == score.splitlines()[1]  # BLEU line
        assert outputs(capsys, ["translate", "--weights", str(moved / "avg.pt"), *common]).count("\n") == 3
        if importlib.util.find_spec("ctranslate2") is not None:  # export writes the embedded models beside it
            assert main(["export", "--weights", str(moved / "best.pt"), "--out", str(tmp_path / "ct2")]) == 0
            assert (tmp_path / "ct2" / "target.model").read_bytes() == \
                load_checkpoint(moved / "best.pt")["tokenizers"]["tgt"]["model"].numpy().tobytes()
        _, src_tok, tgt_tok, _ = load_for_inference(moved / "best.pt", "cpu")
        assert src_tok.sha256 == load_checkpoint(moved / "best.pt")["tokenizers"]["src"]["sha256"]
        # an explicit --tokenizer-* still wins: the embedded model is not used for that side
        other = tmp_path / "other.model"
        other.write_bytes(tgt_tok.model_bytes())
        _, _, tok, _ = load_for_inference(moved / "best.pt", "cpu", tokenizer_tgt=str(other))
        assert tok.path == other
    finally:
        shutil.move(tmp_corpus, corpus)
        shutil.move(tmp_run, run)


def test_damaged_embedded_tokenizer_is_named(trained, tmp_path):
    ckpt = load_checkpoint(trained["run"] / "weights" / "best.pt")
    blob = ckpt["tokenizers"]["src"]["model"].clone()
    blob[10] ^= 0xFF
    ckpt["tokenizers"]["src"]["model"] = blob
    bad = tmp_path / "bad.pt"
    save_checkpoint(bad, ckpt)
    assert main(["translate", "--weights", str(bad), "--device", "cpu", "--input", "/dev/null"]) == 1
    with pytest.raises(InputError, match="embedded src tokenizer is damaged"):
        embedded_tokenizer(ckpt, "src", bad)


def test_resume_with_larger_max_steps_continues_exactly(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    ref = make_trainer(tmp_path, corpus, "--name", "ref", "--epochs", "3", "--max-steps", "24", "--seed", "3")
    ref.train()
    short = make_trainer(tmp_path, corpus, "--name", "short", "--epochs", "1", "--max-steps", "10", "--seed", "3")
    assert short.train()["steps"] == 10
    # the corpus's tokenizers go: the run continues with the models its checkpoint carries
    shutil.rmtree(corpus / "tokenizer")
    capsys.readouterr()
    last = tmp_path / "short" / "weights" / "last.pt"
    assert main(["train", "--resume", str(last), "--max-steps", "24", "--epochs", "3", "--patience", "0"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("resume: ")]
    assert said == ["resume: --epochs 1 -> 3, --max-steps 10 -> 24"]  # --patience did not change: not said
    assert step_losses(tmp_path / "short") == step_losses(tmp_path / "ref")
    assert len(step_losses(tmp_path / "ref")) == 24
    a = torch.load(tmp_path / "ref" / "weights" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert a["step"] == b["step"] == 24
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert (tmp_path / "short" / "tokenizer" / "src.model").is_file()


@pytest.mark.parametrize("flag", ["--batch-size 8", "--lr 2", "--seed 4", "--d-model 32", "--data x",
                                  "--warmup 10", "--beam-size 2", "--ema 0.5", "--eval-dtype bf16",
                                  "--accum-steps 2", "--name other"])
def test_resume_refuses_other_settings_naming_the_flag(tmp_path, capsys, flag):
    assert main(["train", "--resume", str(tmp_path / "x.pt"), "--epochs", "3", *flag.split()]) == 2
    err = capsys.readouterr().err
    assert flag.split()[0] in err and "drop" in err and "--epochs," not in err.split("drop")[1]


@pytest.mark.parametrize("setting", RESUME_SETTINGS)
def test_resume_accepts_new_limits(tmp_path, capsys, setting):
    value = {"time_limit": "1h", "verbose": None, "tensorboard": None}.get(setting, "3")
    flag = "--" + setting.replace("_", "-")
    argv = [flag] if value is None else [flag, value]
    assert main(["train", "--resume", str(tmp_path / "missing.pt"), *argv]) == 1  # accepted; no such file
    assert "checkpoint not found" in capsys.readouterr().err


def test_from_checkpoint_refuses_other_changes_by_name(trained):
    with pytest.raises(ConfigError, match="--lr"):
        Trainer.from_checkpoint(str(trained["run"] / "weights" / "last.pt"), changes={"lr": 1.0})


def test_resume_of_a_run_from_before_the_dropout_settings_keeps_its_dropout(trained, tmp_path):
    """A checkpoint whose config and model shape lack attention/activation dropout dropped
    ``--dropout`` there: resuming it builds that model, not the new defaults (0)."""
    ckpt = load_checkpoint(trained["run"] / "weights" / "last.pt", "--resume")
    assert ckpt["config"]["model"]["attention_dropout"] == 0.0  # the new default, recorded
    ckpt["config"]["model"] = {k: v for k, v in ckpt["config"]["model"].items()
                               if k not in ("attention_dropout", "activation_dropout")} | {"dropout": 0.2}
    ckpt["model_shape"] = {k: v for k, v in ckpt["model_shape"].items()
                           if k not in ("attention_dropout", "activation_dropout")} | {"dropout": 0.2}
    old = tmp_path / "old" / "weights" / "last.pt"  # in a run directory, as --resume wants it
    save_checkpoint(old, {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    (tmp_path / "old" / "config.yaml").write_bytes((trained["run"] / "config.yaml").read_bytes())
    trainer = Trainer.from_checkpoint(str(old), log=lambda _: None)
    assert (trainer.run.shape.attention_p(), trainer.run.shape.activation_p(), trainer.run.shape.dropout) == (0.2, 0.2, 0.2)
    assert trainer.model.decoder[0].cross_attn.dropout == 0.2 and trainer.model.encoder[0].ff.drop.p == 0.2
    model, *_ = load_for_inference(old, "cpu")  # and it still loads for translation
    assert model.shape.attention_dropout is None and model.shape.attention_p() == 0.2


# -- --dtype -------------------------------------------------------------------------------------

def test_dtype_validation_names_the_flag(trained, capsys):
    weights = str(trained["run"] / "weights" / "best.pt")
    assert main(["translate", "--weights", weights, "--device", "cpu", "--dtype", "fp8"]) == 2
    assert "--dtype" in capsys.readouterr().err
    assert main(["translate", "--weights", weights, "--device", "cpu", "--dtype", "fp16", "--input", "/dev/null"]) == 2
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--eval-dtype"):
        decode_dtype("fp16", torch.device("cpu"), "eval_dtype")
    with pytest.raises(ConfigError, match="--dtype"):
        TranslateConfig(weights="x", dtype="half")
    assert decode_dtype("auto", torch.device("cpu")) == torch.float32
    assert decode_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert EvalConfig(weights="x").dtype == "auto"


def test_bf16_translate_on_cpu_runs_and_says_its_dtype(trained, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text(INPUT, encoding="utf-8")
    assert main(["translate", "--weights", str(trained["run"] / "weights" / "best.pt"), "--device", "cpu",
                 "--dtype", "bf16", "--input", str(src)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 3 and "on cpu, bf16" in captured.err


def test_decoding_copy_follows_the_weights_in_place():
    torch.manual_seed(0)
    model = make_model(40, 40, d_model=32, n_layers=1, n_heads=4, d_ff=64, tie_embeddings="decoder")
    assert decoding_copy(model, torch.float32) is model
    copy = decoding_copy(model, torch.bfloat16)
    ptrs = [p.data_ptr() for p in copy.parameters()]
    assert copy.generator.weight is copy.tgt_embed.weight  # still tied
    with torch.no_grad():
        model.generator.bias.add_(1.0)
    again = decoding_copy(model, torch.bfloat16, copy)
    assert again is copy and [p.data_ptr() for p in again.parameters()] == ptrs
    assert torch.equal(again.generator.bias, model.generator.bias.bfloat16())


def test_weights_fine_tunes_with_the_tokenizers_it_carries(trained, tmp_path, home):
    corpus = write_corpus(tmp_path / "corpus2")  # a fresh corpus: no tokenizers of its own
    best = trained["run"] / "weights" / "best.pt"
    lines: list[str] = []
    t = make_trainer(tmp_path, corpus, "--name", "ft", "--weights", str(best), "--max-steps", "2", "--epochs", "1",
                     log=lines.append)
    t.train()
    assert not (corpus / "tokenizer").exists()  # nothing trained: the checkpoint's models were used
    assert any(line.startswith(f"weights: tokenizers from {best}") for line in lines)
    a = load_checkpoint(best)["tokenizers"]
    b = load_checkpoint(tmp_path / "ft" / "weights" / "last.pt")["tokenizers"]
    assert [a[s]["sha256"] for s in ("src", "tgt")] == [b[s]["sha256"] for s in ("src", "tgt")]
    assert {f"{a[s]['sha256'][:16]}.model" for s in ("src", "tgt")} <= {p.name for p in (home / "tokenizers").iterdir()}


def test_the_resume_line_says_no_limit_and_a_time_limit_kept(tmp_path):
    # a run resumed for "longer" kept its --time-limit silently (and stopped at the old slot's length);
    # an unlimited --epochs read 1000000
    from streamnmt.training.build import resume_job
    corpus = write_corpus(tmp_path / "corpus")
    run = make_trainer(tmp_path, corpus, "--name", "t", "--max-steps", "3", "--time-limit", "1h")
    run.train()
    said: list[str] = []
    resume_job(str(tmp_path / "t" / "weights" / "last.pt"), log=said.append, changes={"max_steps": 0})
    assert said == ["resume: --max-steps 3 -> no limit, --time-limit 1h as the run had (give --time-limit for "
                    "another, or none)"]


def test_weights_without_a_model_flag_build_the_checkpoints_model(trained, tmp_path):
    # a fine-tune of a tiny model on the CPU was built at the CPU's default preset (small) and refused
    # the weights ("holds another model"); --model still chooses
    best = trained["run"] / "weights" / "best.pt"
    flags = [f for f in TINY if f not in ("--model", "tiny")]
    args = vars(build_parser().parse_args(["train", *flags, "--data", str(trained["corpus"]), "--project",
                                           str(tmp_path), "--name", "ft", "--weights", str(best), "--max-steps", "1"]))
    for key in ("_run", "command"):
        args.pop(key)
    lines: list[str] = []
    Trainer(build_job(args), log=lines.append).train()
    assert any(line.startswith(f"weights: the model of {best}: tiny (2+2 x 64") for line in lines)
    assert load_checkpoint(tmp_path / "ft" / "weights" / "last.pt")["model_shape"]["d_model"] == 64
    args["model"] = "small"
    with pytest.raises(InputError, match="holds another model"):
        Trainer(build_job({**args, "name": "ft2"}), log=lambda _: None)
    # sizes off a preset: the preset its run trained, with them (its recipe follows, not base's)
    make_trainer(tmp_path, trained["corpus"], "--name", "wide", "--d-ff", "96", "--max-steps", "1").train()
    args.update(model="auto", name="ft3", weights=str(tmp_path / "wide" / "weights" / "last.pt"))
    lines.clear()
    Trainer(build_job(args), log=lines.append).train()
    assert any(": tiny with its sizes (2+2 x 64, 4 heads, d_ff 96;" in line for line in lines), lines[:5]
    assert load_checkpoint(tmp_path / "ft3" / "weights" / "last.pt")["config"]["model"]["model"] == "tiny"


def test_a_relative_data_folder_is_recorded_as_a_whole_path(tmp_path, monkeypatch):
    # eval and --resume started from another folder (a scheduler's job) did not find a relative --data
    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    make_trainer(tmp_path, Path("corpus"), "--name", "rel", "--max-steps", "1").train()
    whole = str(tmp_path / "corpus")
    assert load_checkpoint(tmp_path / "rel" / "weights" / "last.pt")["config"]["data"]["data"] == whole
    assert f"data: {whole}" in (tmp_path / "rel" / "config.yaml").read_text()
