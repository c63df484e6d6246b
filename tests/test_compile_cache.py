"""The persistent compile cache (CPU): its key, warm and cold, the mega-cache, ``--compile auto``'s
warm cost, and a cache that cannot be written (streamnmt.training.compile_cache)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamnmt import cli
from streamnmt.config import build_job
from streamnmt.data import batch_plan, prepare_data
from streamnmt.engine.auto import COMPILE_S_PER_SHAPE_WARM
from streamnmt.models.transformer import make_model
from streamnmt.training import compile_cache as cc
from streamnmt.training.recipe import resolve_compile, resolve_job
from streamnmt.training.step import inductor_key, make_step
from tests.conftest import single_thread

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
ENV = {"torch": "2.11.0+cu130", "triton": "3.5.0", "cuda": "13.0", "python": "3.11", "device": "cuda",
       "gpu": "NVIDIA H200", "capability": [9, 0]}
MODEL = {"src_vocab": 32000, "tgt_vocab": 32000, "d_model": 512, "n_layers": 6, "n_heads": 8, "d_ff": 2048,
         "tie_embeddings": "none", "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, "max_len": 128}


def key(**changes):
    args = {"model": MODEL, "batch_shapes": [(128, 128, 128)], "packed": True, "amp": "bf16", "attention": "sdpa",
            "world": 1, "deterministic": False, "inductor": {"triton.mix_order_reduction": False}, "env": ENV}
    return cc.compile_key(**{**args, **changes})


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Its own STREAMNMT_HOME; the cache variables restored after the test (the cache sets them)."""
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    for var in (cc.INDUCTOR_ENV, cc.TRITON_ENV):
        monkeypatch.delenv(var, raising=False)
    # A fixed blob stands for the mega-cache: nothing is compiled in these tests.
    if cc.mega_cache():
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artefacts", None))
    yield
    cc.stage(None, None)


def test_key_changes_with_what_makes_the_compiled_code_valid():
    same = cc.key_digest(key())
    assert cc.key_digest(key()) == same
    assert cc.key_digest(key(batch_shapes=[[128, 128, 128]])) == same  # tuples or lists: the same shape
    assert cc.key_digest(key(batch_shapes=[(64, 128, 128), (32, 256, 256)])) == \
        cc.key_digest(key(batch_shapes=[(32, 256, 256), (64, 128, 128)]))  # the order of the shapes does not matter
    changed = {
        "batch shape": key(batch_shapes=[(128, 128, 136)]),
        "dtype": key(amp="fp16"),
        "torch version": key(env={**ENV, "torch": "2.12.0+cu130"}),
        "GPU": key(env={**ENV, "gpu": "NVIDIA H100 80GB HBM3"}),
        "Triton": key(env={**ENV, "triton": "3.6.0"}),
        "model width": key(model={**MODEL, "d_model": 1024}),
        "vocabulary": key(model={**MODEL, "tgt_vocab": 16000}),
        "dropout site": key(model={**MODEL, "attention_dropout": 0.1}),
        "attention": key(attention="flex"),
        "inductor options": key(inductor={}),
        "DDP buckets": key(bucket_cap_mb=100.0),
        "the package's code": key(code="another version of streamnmt"),
    }
    digests = {what: cc.key_digest(k) for what, k in changed.items()}
    for what, digest in digests.items():
        assert digest != same, what
    assert len(set(digests.values())) == len(digests)


def test_the_key_holds_the_packages_code_and_the_jobs_buckets(tmp_path, monkeypatch):
    """The default key digests streamnmt's own source files: an edit to one keys another cache."""
    import streamnmt

    pkg = tmp_path / "pkg"
    (pkg / "training").mkdir(parents=True)
    (pkg / "training" / "x.py").write_text("a = 1\n")
    monkeypatch.setattr(cc, "__file__", str(pkg / "training" / "compile_cache.py"))
    cc.package_digest.cache_clear()
    try:
        before = cc.package_digest()
        (pkg / "training" / "x.py").write_text("a = 2\n")
        cc.package_digest.cache_clear()
        assert cc.package_digest() != before
    finally:
        monkeypatch.undo()
        cc.package_digest.cache_clear()
    assert key()["code"] == cc.package_digest() and len(cc.package_digest()) == 64
    assert any(Path(streamnmt.__file__).parent.rglob("*.py"))
    job = build_job({"device": "cpu", "model": "tiny", "bucket_cap_mb": 50.0})
    monkeypatch.setattr(cc, "tokenizer_vocab", lambda data: (100, 100))
    assert cc.job_key(job, [(8, 16, 16)], CPU, 2, {})["bucket_cap_mb"] == 50.0


@pytest.mark.skipif(not cc.mega_cache(), reason="torch without save/load_cache_artifacts")
def test_a_stale_mega_cache_is_refreshed(tmp_path, monkeypatch):
    """A loaded artifacts.bin whose compile still missed torch's caches is written afresh; one
    that served is left as it is."""
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: None)
    cold = cc.CompileCache(key()).stage(None)
    cold.save(None)
    for misses, expect in ((0, b"artefacts"), (3, b"fresh artefacts")):
        monkeypatch.setenv(cc.INDUCTOR_ENV, str(tmp_path / f"fresh{misses}"))  # the directories lack them
        monkeypatch.setattr(cc, "_cache_misses", lambda: misses)
        monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"fresh artefacts", None))
        warm = cc.CompileCache(key()).stage(None)
        assert warm.warm and warm.loaded
        warm.save(None)
        assert (cold.dir / cc.ARTIFACTS).read_bytes() == expect, misses


def test_the_environment_names_the_software_and_the_device(monkeypatch):
    env = cc.environment(CPU)
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    gpu = cc.environment(CUDA)
    assert gpu["gpu"] == "NVIDIA H200" and gpu["capability"] == [9, 0]


def test_saved_key_is_warm_and_a_changed_shape_or_torch_version_misses(tmp_path):
    logs: list[str] = []
    first = cc.CompileCache(key(), t0=0.0)
    assert not first.warm and first.state() == "cold"
    first.stage(logs.append)
    root = tmp_path / "home" / "compile"
    assert os.environ[cc.INDUCTOR_ENV] == str(root / "inductor") and os.environ[cc.TRITON_ENV] == str(root / "triton")
    first.save(logs.append)
    manifest = json.loads((first.dir / cc.MANIFEST).read_text())
    assert manifest["key"] == json.loads(json.dumps(key()))
    assert manifest["dirs"][cc.INDUCTOR_ENV] == str(root / "inductor")
    assert cc.CompileCache(key()).warm
    assert not cc.CompileCache(key(batch_shapes=[(128, 136, 136)])).warm
    assert not cc.CompileCache(key(env={**ENV, "torch": "2.12.0+cu130"})).warm
    assert not cc.CompileCache(key(env={**ENV, "gpu": "NVIDIA H100 80GB HBM3"})).warm
    assert not cc.CompileCache(None).warm  # no key, no promise
    assert logs == []


@pytest.mark.skipif(not cc.mega_cache(), reason="torch without save/load_cache_artifacts")
def test_mega_cache_is_loaded_where_the_directories_lack_the_artefacts(tmp_path, monkeypatch):
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: loaded.append(blob))
    cold = cc.CompileCache(key()).stage(None)
    cold.save(None)
    assert (cold.dir / cc.ARTIFACTS).read_bytes() == b"artefacts"
    warm = cc.CompileCache(key()).stage(None)  # the same directories hold the artefacts: nothing to load
    assert warm.warm and not warm.loaded and loaded == []
    monkeypatch.setenv(cc.INDUCTOR_ENV, str(tmp_path / "fresh"))  # the user's, somewhere new
    moved = cc.CompileCache(key())
    assert moved.warm and moved.dirs()[cc.INDUCTOR_ENV] == str(tmp_path / "fresh")
    moved.stage(None)
    assert moved.loaded and loaded == [b"artefacts"] and os.environ[cc.INDUCTOR_ENV] == str(tmp_path / "fresh")
    # without the file, the directories the manifest names are not these: cold
    (cold.dir / cc.ARTIFACTS).unlink()
    assert not cc.CompileCache(key()).warm


def test_warm_cache_compiles_a_two_minute_run_and_a_cold_one_does_not(tmp_path, monkeypatch):
    """resolve_compile keys the run's step, finds the cache warm after a save, and then --compile
    auto compiles a ~2-minute run (warm cost), which it leaves eager while the cache is cold."""
    monkeypatch.setattr(cc, "environment", lambda device: ENV)  # a GPU's environment on this CPU
    data = {"device": "cpu", "model": "tiny", "builtin_size": 300, "max_len": 16, "max_tokens": 256, "pack": True,
            "epochs": 10000, "bleu_samples": 0}
    job = resolve_job(build_job(data), CPU, 1, lambda s: None)
    bundle = prepare_data(job.data, log=lambda s: None)
    _, shapes = batch_plan(bundle.train, job.data)
    assert len(shapes) == 1  # packed: one shape
    steps = int(120 / 0.006)  # two minutes of the graph-mode floor (6 ms a step)
    job = dataclasses.replace(job, engine=dataclasses.replace(job.engine, sync_strategy="graph", compile="auto"),
                              run=dataclasses.replace(job.run, max_steps=steps))
    lines: list[str] = []
    cold = resolve_compile(job, bundle.train, CUDA, 1, lines.append)
    assert cold.engine.compile == "off" and "compile cache cold" in lines[-1] and "engine: compile off" in lines[-1]
    facts = cc.job_key(job, shapes, CUDA, 1, inductor_key())
    assert facts is not None and facts["model"]["src_vocab"] == bundle.src_tok.vocab_size
    assert cc.job_key(job, shapes, CUDA, 1, inductor_key()) == facts  # the same run, the same key
    cc.CompileCache(facts).stage(None).save(None)  # as a first compiled run leaves it
    warm = resolve_compile(job, bundle.train, CUDA, 1, lines.append)
    assert warm.engine.compile == "on" and "compile cache warm" in lines[-1] and "engine: compile on" in lines[-1]
    assert f"~{COMPILE_S_PER_SHAPE_WARM:.0f} s of compiling" in lines[-1]
    # a run given no end (the plateau default's unlimited epochs) is said as such, not as a duration
    from streamnmt.config import EPOCHS_UNLIMITED
    open_ended = dataclasses.replace(job, run=dataclasses.replace(job.run, max_steps=0, epochs=EPOCHS_UNLIMITED))
    assert resolve_compile(open_ended, bundle.train, CUDA, 1, lines.append).engine.compile == "on"
    assert "until its plateau" in lines[-1] and " min (" not in lines[-1]
    # the staged cache is the one make_step takes (the tiny model of the same sizes and vocabularies)
    model = make_model(bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size, d_model=job.model.d_model,
                       n_layers=job.model.n_layers, n_heads=job.model.n_heads, d_ff=job.model.d_ff,
                       dropout=job.model.dropout, attention_dropout=job.model.attention_dropout,
                       activation_dropout=job.model.activation_dropout)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    step = make_step(model, CPU, d_model=job.model.d_model, compile=True)
    assert step.compile_cache is not None and step.compile_cache.warm
    assert step.compile_cache.digest == cc.key_digest(facts)


def test_make_step_keys_the_artefacts_by_the_model_it_is_given(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    small = {**MODEL, "src_vocab": 100, "tgt_vocab": 120, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
             "max_len": 16}
    model = make_model(100, 130, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.1)  # target: 130, not 120
    cc.stage(cc.CompileCache(key(model=small)), None)
    step = make_step(model, CPU, d_model=32, compile=True)
    assert step.compile_cache.facts["model"]["tgt_vocab"] == 130
    assert step.compile_cache.facts["model"]["src_vocab"] == 100
    cc.stage(cc.CompileCache(key(model={**small, "d_model": 64})), None)  # staged for another model: not its key
    assert make_step(model, CPU, d_model=32, compile=True).compile_cache.facts is None
    assert make_step(model, CPU, d_model=32, compile=True).compile_cache.state() == "unkeyed"  # resumed, bench
    assert make_step(model, CPU, d_model=32).compile_cache is None


RUN = ["train", "--device", "cpu", "--model", "tiny", "--epochs", "1", "--max-steps", "2", "--bleu-samples", "0",
       "--workers", "0", "--batch-size", "16", "--max-len", "16", "--compile", "on",
       "--warmup", "2"]  # inside the two steps: no warm-up warning among the lines the test reads


def test_second_run_starts_warm(tmp_path, capsys, monkeypatch):
    """Two runs of the same model and data: the first says cold and saves, the second says warm."""
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)  # the cache's flow, not Inductor, is under test
    out = []
    for name in ("a", "b"):
        with single_thread():
            assert cli.main([*RUN, "--builtin-size", "300", "--project", str(tmp_path), "--name", name]) == 0
        out.append(capsys.readouterr().out)
    assert "engine: compile cache cold (" in out[0] and "engine: compile cache warm (" in out[1]
    assert "warning" not in out[0] + out[1]
    keys = list((tmp_path / "home" / "compile" / "keys").glob(f"*/{cc.MANIFEST}"))
    assert len(keys) == 1


def test_unwritable_home_warns_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    from streamnmt.data import synthetic

    data = tmp_path / "data"
    synthetic.write_builtin(data, 300, seed=0)  # the data outside STREAMNMT_HOME, which cannot be written
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where STREAMNMT_HOME's parent should be")
    monkeypatch.setenv("STREAMNMT_HOME", str(blocker / "home"))
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)
    with single_thread():
        code = cli.main([*RUN, "--data", str(data), "--project", str(tmp_path), "--name", "run"])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if "warning: compile cache" in line]
    assert code == 0 and len(warnings) == 1, out
    assert "the run goes on without it" in warnings[0] and "engine: compile cache off (not writable)" in out
    assert (tmp_path / "run" / "steps.csv").read_text().count("\n") == 3  # header and two steps
    assert os.environ.get(cc.INDUCTOR_ENV, "").find(str(blocker)) < 0  # not pointed into the unwritable home


def test_deciding_compile_auto_does_not_import_inductor(tmp_path):
    """Keying the cache reads what Inductor's options depend on, not Inductor (seconds of start-up
    on a GPU machine); a run that stays eager never imports TorchDynamo or Inductor."""
    code = """
import sys, dataclasses, torch
from streamnmt.config import build_job
from streamnmt.data import batch_plan, prepare_data
from streamnmt.training import compile_cache as cc
from streamnmt.training.recipe import resolve_compile, resolve_job
cc.environment = lambda device: {"torch": "2.11", "gpu": "H200", "device": "cuda"}
job = resolve_job(build_job({"device": "cpu", "model": "tiny", "builtin_size": 300, "max_len": 16, "max_tokens": 256,
                             "pack": True, "epochs": 10000, "bleu_samples": 0}), torch.device("cpu"), 1, print)
bundle = prepare_data(job.data, log=lambda s: None)
for minutes in (1, 2, 60):  # off even warm; off cold (keyed); on cold (keyed, inductor imported only to compile)
    j = dataclasses.replace(job, engine=dataclasses.replace(job.engine, sync_strategy="graph", compile="auto"),
                            run=dataclasses.replace(job.run, max_steps=int(minutes * 60 / 0.006)))
    resolve_compile(j, bundle.train, torch.device("cuda"), 1, print)
    cc.stage(None, None)
print("IMPORTED", sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules))
"""
    env = dict(os.environ, STREAMNMT_HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("engine: compile")]
    assert len(lines) == 3 and "off even with a warm compile cache" in lines[0] and "cache cold" in lines[1]
    assert "IMPORTED []" in res.stdout

