"""A corpus's tokenizers trained in a child process started at the command's start: the same
models, sizes and lines as trained in-process (the built-in corpus: its files too, and a child of
another size set aside), the same error for bad input, and no child where prepare_data would write
and train nothing or under torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from streamnmt.config import build_job
from streamnmt.data import config as data_config
from streamnmt.data import synthetic, tokenizer_child, tokenizer_training
from streamnmt.data.config import SMALL_CORPUS_PIECES_PER_CHARACTER, SMALL_CORPUS_VOCAB, DataConfig, builtin_dir, source_vocab
from streamnmt.data.prepare import prepare_data
from streamnmt.data.tokenizer import vocab_cap
from streamnmt.errors import InputError

from .conftest import write_corpus


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list:
    """What each prepare_data got from tokenizer_child.take (None: no child's models)."""
    got: list = []
    real = tokenizer_child.take

    def spy(cfg, log):
        got.append(real(cfg, log))
        return got[-1]

    monkeypatch.setattr(tokenizer_child, "take", spy)
    yield got
    tokenizer_child.stop()


class FakeChild:
    def __init__(self, code: int = 0, last: str = ""):
        self.code, self.last, self.stopped = code, last, False

    def wait(self, timeout: float) -> int:
        return self.code

    def stop(self) -> None:
        self.stopped = True

    def last_line(self) -> str:
        return self.last


def _poison_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that imports torch or numpy fails, and its files are not taken."""
    poison = tmp_path / "poison"
    poison.mkdir()
    for name in ("torch", "numpy"):
        (poison / f"{name}.py").write_text(f"raise ImportError('the tokenizers child imported {name}')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(poison), os.environ.get("PYTHONPATH")])))


def _files(directory: Path) -> dict[str, bytes]:
    """The built-in corpus's files and its models, by name (the tokenized cache left out)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and "cache" not in p.relative_to(directory).parts}


def _unstamped(files: dict[str, bytes]) -> dict[str, object]:
    """The files with each model's record read, its training split's modification times left out (two
    folders written at different times): what was trained, for what, from which bytes."""
    out: dict[str, object] = dict(files)
    for name, data in files.items():
        if name.endswith(".model.json"):
            record = json.loads(data)
            record["train"] = [entry[:2] for entry in record["train"]]
            out[name] = record
    return out


def _same(lines: list[str], directory: Path) -> list[str]:
    """Lines without their seconds and corpus folder, sorted (the two sides' threads log in either order)."""
    return sorted(re.sub(r"\d+\.\d+s", "Ns", line.replace(str(directory), "DIR")) for line in lines)


@pytest.mark.parametrize("shared", [False, True], ids=["two", "shared"])
def test_a_child_writes_the_models_sizes_and_lines_prepare_would(tmp_path, monkeypatch, taken, shared):
    # the models' bytes depend on SentencePiece's thread count: the child must take this process's
    monkeypatch.setattr(tokenizer_training, "cpu_threads", lambda: 8)
    poison = tmp_path / "poison"  # a child that imports torch fails, and its models are not taken
    poison.mkdir()
    (poison / "torch.py").write_text("raise ImportError('the tokenizers child imported torch')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(poison), os.environ.get("PYTHONPATH")])))
    for name in ("a", "b"):
        targets = [t for _, t in write_corpus(tmp_path / name, n_train=300)["train"]]
    job = build_job({"data": str(tmp_path / "a"), "max_len": 24, "shared_vocab": shared})
    assert tokenizer_child.start_for(job)

    by_child: list[str] = []
    a = prepare_data(job.data, log=by_child.append)
    here: list[str] = []
    b = prepare_data(dataclasses.replace(job.data, data=str(tmp_path / "b")), log=here.append)

    assert taken[0] is not None and taken[1] is None  # a: the child's models; b: trained here
    models = ["shared.model"] if shared else ["src.model", "tgt.model"]
    for model in models:
        assert (tmp_path / "a" / "tokenizer" / model).read_bytes() == (tmp_path / "b" / "tokenizer" / model).read_bytes()
    assert sorted(taken[0].trained) == sorted(str(tmp_path / "a" / "tokenizer" / m) for m in models)
    source = source_vocab(SMALL_CORPUS_VOCAB, vocab_cap(targets, SMALL_CORPUS_VOCAB, True, SMALL_CORPUS_PIECES_PER_CHARACTER))
    auto = {"shared": SMALL_CORPUS_VOCAB} if shared else {"source": source, "target": SMALL_CORPUS_VOCAB}
    assert a.auto_vocab == b.auto_vocab == auto and a.train_pairs == b.train_pairs == 300
    assert _same(by_child, tmp_path / "a") == _same(here, tmp_path / "b")
    assert any(line.startswith("data: trained ") for line in by_child)
    assert not list((tmp_path / "a" / "tokenizer").glob(".*"))  # no temporary file left beside the models


def test_a_bad_record_stops_the_run_with_the_same_line_as_without_a_child(tmp_path, taken):
    write_corpus(tmp_path / "c", n_train=300)
    train = tmp_path / "c" / "train.json"
    records = json.loads(train.read_text(encoding="utf-8"))
    records[200] = {"en": "a record without its target"}
    train.write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    job = build_job({"data": str(tmp_path / "c"), "max_len": 24})
    with pytest.raises(InputError) as without:
        prepare_data(job.data, log=lambda _: None)

    children: list = []
    assert tokenizer_child.start_for(job, lambda argv: children.append(tokenizer_child._launch(argv)) or children[-1])
    lines: list[str] = []
    with pytest.raises(InputError) as with_child:
        prepare_data(job.data, log=lines.append)
    assert children[0].process.returncode == tokenizer_child.BAD_INPUT and taken == [None, None]
    assert str(with_child.value) == str(without.value) and "train.json: record 200" in str(without.value)
    assert lines == []  # bad input is the error's line alone
    assert not (tmp_path / "c" / "tokenizer").exists() or not any((tmp_path / "c" / "tokenizer").iterdir())


def test_no_child_for_tokenizers_given_or_found_weights_or_torchrun(tmp_path, monkeypatch):
    started: list[list[str]] = []

    def launch(argv):
        started.append(argv)
        return FakeChild()

    write_corpus(tmp_path / "c", n_train=120)
    data, tok = str(tmp_path / "c"), tmp_path / "c" / "tokenizer"

    def starts(**flags) -> bool:
        return tokenizer_child.start_for(build_job({"max_len": 24, **flags}), launch)

    try:
        assert not starts(data=data, weights=str(tmp_path / "w.pt"))  # its checkpoint's tokenizers may serve
        assert not starts(data=data, tokenizer_src=str(tmp_path / "e.model"), tokenizer_tgt=str(tmp_path / "z.model"))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert not starts(data=data) and started == []
        monkeypatch.setenv("WORLD_SIZE", "1")
        assert starts(data=data, src_vocab=300)
        request = json.loads(started[-1][-1])
        assert request["data"] == dataclasses.asdict(build_job({"max_len": 24, "data": data, "src_vocab": 300}).data)
        tok.mkdir()
        (tok / "src.model").write_bytes(b"")
        assert starts(data=data)  # the target's model is still to train
        (tok / "tgt.model").write_bytes(b"")
        assert not starts(data=data)
        assert starts(data=data, shared_vocab=True)
        (tok / "shared.model").write_bytes(b"")
        assert not starts(data=data, shared_vocab=True) and len(started) == 3
    finally:
        tokenizer_child.stop()


def test_a_failed_or_foreign_child_is_set_aside_and_prepare_trains_here(tmp_path):
    targets = [t for _, t in write_corpus(tmp_path / "c", n_train=120)["train"]]
    source = source_vocab(SMALL_CORPUS_VOCAB, vocab_cap(targets, SMALL_CORPUS_VOCAB, True, SMALL_CORPUS_PIECES_PER_CHARACTER))
    cfg = DataConfig(data=str(tmp_path / "c"), max_len=24)
    crashed = FakeChild(code=1, last="MemoryError")
    tokenizer_child.start(cfg, 1, lambda argv: crashed)
    lines: list[str] = []
    bundle = prepare_data(cfg, log=lines.append)
    assert crashed.stopped and bundle.auto_vocab == {"source": source, "target": SMALL_CORPUS_VOCAB}
    assert "child process failed (exit 1: MemoryError" in lines[0] and lines[0].endswith("training them here")
    assert any(line.startswith("data: trained source tokenizer and target tokenizer") for line in lines)

    other = FakeChild()  # started for other data settings: its models are not this run's
    tokenizer_child.start(dataclasses.replace(cfg, src_vocab=64), 1, lambda argv: other)
    assert tokenizer_child.take(cfg, print) is None and other.stopped


def test_the_child_writes_the_builtin_corpus_and_models_prepare_would(tmp_path, monkeypatch, taken):
    monkeypatch.setattr(tokenizer_training, "cpu_threads", lambda: 8)
    _poison_torch(tmp_path, monkeypatch)
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "a"))
    job = build_job({"builtin_size": 200, "max_len": 24, "model": "tiny", "device": "cpu"})
    assert tokenizer_child.start_for(job)
    by_child: list[str] = []
    a = prepare_data(job.data, log=by_child.append)
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "b"))
    here: list[str] = []
    b = prepare_data(job.data, log=here.append)

    assert taken[0] is not None and taken[1] is None  # a: the child's corpus and models; b: written here
    files = _files(a.data_dir)
    assert sorted(files) == sorted(["dev.json", "test.json", "train.json", synthetic.MANIFEST_NAME,
                                    "tokenizer/tgt.model", "tokenizer/src.model",
                                    "tokenizer/tgt.model.json", "tokenizer/src.model.json"])
    assert _unstamped(files) == _unstamped(_files(b.data_dir)) and a.data_dir == tmp_path / "a" / "builtin-200"
    assert a.auto_vocab == b.auto_vocab and a.stats == b.stats and a.stats["train"]["read"] == 200
    assert _same(by_child, a.data_dir) == _same(here, b.data_dir)
    assert any(line.startswith("data: trained source tokenizer and target tokenizer") for line in by_child)


def test_a_child_of_a_wrongly_guessed_size_is_set_aside_and_prepare_writes_here(tmp_path, monkeypatch, taken):
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "a"))
    monkeypatch.setattr(data_config, "builtin_size_for", lambda preset: 300)  # the guess: 300 pairs
    job = build_job({"max_len": 24, "model": "tiny", "device": "cpu"})
    argvs: list[list[str]] = []
    assert tokenizer_child.start_for(job, lambda argv: argvs.append(argv) or tokenizer_child._launch(argv))
    assert json.loads(argvs[0][-1])["directory"] == str(tmp_path / "a" / "builtin-300")  # started for the guess
    run = dataclasses.replace(job.data, builtin_size=200)  # the size the recipe chose
    lines: list[str] = []
    a = prepare_data(run, log=lines.append)
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "b"))
    b = prepare_data(run, log=lambda _: None)

    assert taken == [None, None] and a.data_dir == tmp_path / "a" / "builtin-200"
    assert _unstamped(_files(a.data_dir)) == _unstamped(_files(b.data_dir)) and a.stats["train"]["read"] == 200
    assert not any("child process" in line for line in lines)  # no failure said: a child of other settings


def test_no_child_for_the_builtin_corpus_written_with_its_models(tmp_path, monkeypatch):
    started: list[list[str]] = []

    def launch(argv):
        started.append(argv)
        return FakeChild()

    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path))
    flags = {"builtin_size": 150, "max_len": 24, "model": "tiny"}
    directory = builtin_dir(DataConfig(builtin_size=150))
    tok = directory / "tokenizer"

    def starts(**more) -> bool:
        return tokenizer_child.start_for(build_job({**flags, **more}), launch)

    try:
        assert starts()  # nothing written yet
        assert json.loads(started[-1][-1])["directory"] == str(directory)
        synthetic.write_builtin(directory, 150)
        assert starts()  # the models are still to train
        tok.mkdir()
        (tok / "src.model").write_bytes(b"")
        (tok / "tgt.model").write_bytes(b"")
        assert not starts() and len(started) == 2
        assert not starts(weights=str(tmp_path / "w.pt"))
        (directory / "dev.json").write_text("[]\n", encoding="utf-8")  # damaged: prepare_data writes it again
        assert starts() and len(started) == 3
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert not starts() and len(started) == 3
    finally:
        tokenizer_child.stop()


@pytest.mark.parametrize(("flags", "env", "gpus", "pairs"), [
    ({"builtin_size": 500}, {}, 1, 500),  # given: taken as it is
    ({"model": "iwslt", "device": "cpu"}, {}, 0, 40000),  # a GPU preset: the larger corpus wherever it runs
    ({"model": "small"}, {}, 1, 16000),
    ({"device": "cpu"}, {}, 1, 16000),
    ({"device": "cuda:1"}, {}, 0, 40000),
    ({}, {}, 1, 40000),  # auto on a machine with a GPU: base
    ({}, {}, 0, 16000),
    ({}, {"CUDA_VISIBLE_DEVICES": ""}, 1, 16000),
    ({}, {"CUDA_VISIBLE_DEVICES": "-1"}, 1, 16000),
    ({}, {"CUDA_VISIBLE_DEVICES": "1"}, 1, 40000),
], ids=["given", "gpu-preset", "cpu-preset", "cpu", "cuda", "auto-gpu", "auto-no-gpu", "hidden", "minus-one", "visible"])
def test_the_builtin_size_guessed_before_torch_is_the_recipes(tmp_path, monkeypatch, flags, env, gpus, pairs):
    gpu_dir = tmp_path / "gpus"
    gpu_dir.mkdir()
    for i in range(gpus):
        (gpu_dir / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(tokenizer_child, "NVIDIA_GPUS", gpu_dir)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = build_job({k: v for k, v in flags.items() if k != "device"})
    job.run.device = flags.get("device")  # build_job checks CUDA is there: not on this machine
    assert tokenizer_child.builtin_guess(job) == pairs
