"""``--compile background`` (CPU): a child process compiles the step while the run trains uncompiled;
the step switches to compiled between epochs once the child is done, a failed child leaves it
uncompiled with one line, and a run that ends first takes the child along
(streamnmt.training.compile_child). TorchDynamo traces with the ``eager`` backend here (the test
hook ``STREAMNMT_TEST_COMPILE_BACKEND``): the switch, not Inductor's code, is under test; the GPU
test in tests/test_compile_gpu.py compiles for real in graph mode."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from streamnmt import testhooks
from streamnmt.config import build_job
from streamnmt.engine.config import EngineConfig
from streamnmt.training import compile_cache as cc
from streamnmt.training.recipe import resolve_compile, resolve_job
from streamnmt.training.runs import read_csv
from streamnmt.training.step import LossModel
from tests.test_recipe import home, make_trainer  # noqa: F401  (home: each test's STREAMNMT_HOME)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_cache(home, tmp_path, monkeypatch):  # noqa: F811  (after the shared home fixture)
    """A compile cache of this test's own (a warm one would compile in the run's process instead),
    and the cache variables the run sets restored after it."""
    monkeypatch.setenv("STREAMNMT_HOME", str(tmp_path / "home"))
    for var in (cc.INDUCTOR_ENV, cc.TRITON_ENV):
        monkeypatch.delenv(var, raising=False)
    yield
    cc.stage(None, None)
    torch._dynamo.reset()


def _finite_steps(run_dir) -> list[float]:
    rows = read_csv(run_dir / "steps.csv")
    assert rows and all(math.isfinite(float(r["loss"])) for r in rows)
    return [float(r["loss"]) for r in rows]


def test_the_step_switches_to_compiled_once_the_child_is_done(tmp_path, monkeypatch):
    monkeypatch.setenv(testhooks.COMPILE_BACKEND, "eager")
    lines: list[str] = []
    t = make_trainer(tmp_path, "--compile", "background", "--epochs", "3", "--name", "bg", lines=lines)
    assert t.job.engine.compile == "background" and "engine: compile in the background" in lines
    assert isinstance(t.train_step.model, LossModel)  # training starts uncompiled
    child = t.run.background_compile
    assert child is not None and child.proc.wait(timeout=240) == 0  # done before the first epoch starts
    t.train()
    switched = [ln for ln in lines if ln.startswith("engine: compiled step from step 1 on")]
    assert len(switched) == 1, lines
    assert isinstance(t.train_step.model, torch._dynamo.eval_frame.OptimizedModule)
    assert t.train_step.model._orig_mod is t.train_step._uncompiled  # the same weights, compiled
    assert len(_finite_steps(tmp_path / "bg")) == t.global_step  # every step trained and logged
    # the child saved the key's manifest: the next run of this step finds the cache warm
    assert list((tmp_path / "home" / "compile" / "keys").glob("*/" + cc.MANIFEST))
    assert t.run.background_compile is None


def test_a_failed_child_leaves_the_step_uncompiled_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(testhooks.COMPILE_CHILD_FAILS, "1")
    lines: list[str] = []
    t = make_trainer(tmp_path, "--compile", "background", "--epochs", "2", "--name", "fail", lines=lines)
    assert t.run.background_compile.proc.wait(timeout=120) == 1
    t.train()
    failed = [ln for ln in lines if "compile in the background failed" in ln]
    assert len(failed) == 1 and "injected by STREAMNMT_TEST_COMPILE_CHILD_FAILS" in failed[0]
    assert failed[0].endswith("training goes on uncompiled")
    assert isinstance(t.train_step.model, LossModel)
    assert len(_finite_steps(tmp_path / "fail")) == t.global_step


def test_a_run_that_ends_before_the_child_stops_it(tmp_path):
    # Inductor's real compile of the step takes far longer than this one-epoch run
    t = make_trainer(tmp_path, "--compile", "background", "--epochs", "1", "--name", "short")
    child = t.run.background_compile
    t.train()
    assert child.proc.poll() is not None  # ended by the run's end, not left running
    assert isinstance(t.train_step.model, LossModel)
    assert not child.spec.exists()


def test_background_compiles_in_the_process_where_the_cache_is_warm_or_ranks_are_several(tmp_path):
    assert EngineConfig(compile="background").compile == "background"
    job = resolve_job(build_job({"device": "cpu", "model": "tiny", "builtin_size": 200, "max_len": 16,
                                 "bleu_samples": 0, "compile": "background"}), CPU, 1, lambda s: None)
    from streamnmt.data import prepare_data
    bundle = prepare_data(job.data, log=lambda s: None)
    lines: list[str] = []
    assert resolve_compile(job, bundle.train, CPU, 2, lines.append).engine.compile == "on"
    assert "several processes" in lines[-1]
    cold = resolve_compile(job, bundle.train, CPU, 1, lines.append)
    assert cold.engine.compile == "background" and lines[-1] == "engine: compile in the background"
    cc.take_staged().save(None)  # as the child leaves it
    warm = resolve_compile(dataclasses.replace(job), bundle.train, CPU, 1, lines.append)
    assert warm.engine.compile == "on" and "the compile cache is warm" in lines[-1]


def test_a_child_done_too_near_the_runs_end_is_not_switched_to():
    from types import SimpleNamespace

    from streamnmt.training import compile_child

    class Budget:
        def __init__(self, limit_s, elapsed_s):
            self.limit_s, self._elapsed = limit_s, elapsed_s

        def elapsed(self):
            return self._elapsed

    assert compile_child.worth_switching(None, 1) is None  # the end unknown: always
    assert compile_child.worth_switching(200.0, 1) is None  # 200 s left save ~39 s
    assert compile_child.worth_switching(40.0, 1) == pytest.approx(40.0)  # ~8 s < 2 x 7 s
    assert compile_child.worth_switching(200.0, 4) == pytest.approx(200.0)  # four shapes
    # the time left: to the time limit, or to the step count's end at the step time so far, the sooner
    job = SimpleNamespace(run=SimpleNamespace(max_steps=1000, epochs=10**9),
                          engine=SimpleNamespace(accum_steps=1))
    counted = SimpleNamespace(budget=Budget(None, 0.0), job=job, train_loader=[0] * 50)
    assert compile_child.time_left(counted, 900, 0.5) == pytest.approx(50.0)
    assert compile_child.time_left(counted, 900, None) is None  # no step time yet
    counted.budget = Budget(600.0, 580.0)
    assert compile_child.time_left(counted, 900, 0.5) == pytest.approx(20.0)
    lines: list[str] = []
    done = SimpleNamespace(poll=lambda: compile_child.Done(True, 50.0))
    step = SimpleNamespace(use_compiled=lambda shapes: pytest.fail("switched too late"))
    run = SimpleNamespace(background_compile=done, budget=Budget(600.0, 570.0), log=lines.append,
                          train_loader=SimpleNamespace(shapes=lambda: [(8, 16, 16)]), train_step=step)
    assert compile_child.take_over_when_done(run, 100) == 0.0
    assert run.background_compile is None and len(lines) == 1 and "too late" in lines[0]


def _fake_run(child, lines, step=None, pending=None):
    from types import SimpleNamespace

    return SimpleNamespace(background_compile=child, budget=None, log=lines.append,
                           evaluator=SimpleNamespace(pending=pending),
                           train_loader=SimpleNamespace(shapes=lambda: [(8, 16, 16)]), train_step=step,
                           strategy=SimpleNamespace(report={}, prepare=lambda step, ex, again: None),
                           examples=lambda: [])


def test_no_switch_while_a_bleu_pass_runs_beside_training():
    from types import SimpleNamespace

    from streamnmt.training import compile_child

    done = SimpleNamespace(poll=lambda: compile_child.Done(True, 30.0))
    step = SimpleNamespace(use_compiled=lambda shapes: pytest.fail("switched beside a BLEU pass"))
    lines: list[str] = []
    run = _fake_run(done, lines, step, pending=(None, None, SimpleNamespace(done=False)))
    assert compile_child.take_over_when_done(run, 10) == 0.0
    assert run.background_compile is done and not lines  # kept for a later epoch end


def test_a_switch_that_raises_leaves_the_step_uncompiled():
    from types import SimpleNamespace

    from streamnmt.training import compile_child

    undone: list[bool] = []

    def boom(shapes):
        raise ValueError("no compiler here")

    step = SimpleNamespace(use_compiled=boom, use_uncompiled=lambda: undone.append(True))
    lines: list[str] = []
    run = _fake_run(SimpleNamespace(poll=lambda: compile_child.Done(True, 30.0)), lines, step)
    compile_child.take_over_when_done(run, 10)
    assert undone == [True] and len(lines) == 1
    assert "ValueError: no compiler here" in lines[0] and lines[0].endswith("training goes on uncompiled")


def test_the_childs_seconds_are_its_own_not_the_polls(tmp_path):
    import subprocess
    import sys
    import time

    from streamnmt.training import compile_child

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    out, spec = tmp_path / "out.log", tmp_path / "spec.json"
    child = compile_child.BackgroundCompile(proc, out, spec)
    child.t0_wall = time.time() - 100.0  # started 100 s ago; the child finished 40 s after its start
    out.write_text(f"compiled 1 batch shape(s)\n{compile_child.FINISHED} {child.t0_wall + 40.0:.3f}\n")
    done = child.poll()
    assert done.ok and done.seconds == pytest.approx(40.0, abs=0.01)
    assert not out.exists()


def test_the_switch_line_says_where_the_childs_cache_did_not_serve(monkeypatch):
    from types import SimpleNamespace

    from streamnmt.training import compile_child

    misses = iter([5, 7])  # before and after the switch: two graphs compiled cold here
    monkeypatch.setattr(compile_child, "_cache_misses", lambda: next(misses))
    step = SimpleNamespace(use_compiled=lambda shapes: None)
    lines: list[str] = []
    run = _fake_run(SimpleNamespace(poll=lambda: compile_child.Done(True, 30.0)), lines, step)
    run.strategy.report["recapture_s"] = 1.0
    compile_child.take_over_when_done(run, 10)
    assert len(lines) == 1 and lines[0].startswith("engine: compiled step from step 11 on")
    assert "captured in" in lines[0] and lines[0].endswith("; 2 graph(s) missed the cache and compiled here cold)")
