"""Fault injection: a run's files under a slow disk, a kill -9 at each stage of a write, an error in
the BLEU pass, SIGTERM during a pass, a non-finite loss, a full disk and a damaged last.pt.

After each fault: last.pt loads, best.pt and best.safetensors hold the same weights, and the run
resumed from last.pt equals the uninterrupted one (steps.csv, evals.csv, the early-stopping record
in last.pt, best.pt), with ``--async-eval`` on and off where the two run different code: a fault
that strikes the same code in both (a last.pt write, a full disk, a non-finite loss before the
first pass beside training) runs with ``--async-eval on`` only, whose run does all the off run
does up to the fault and also has a pass beside training to wind up. Each faulted run is a forked child of the
test process (the imports are paid once), which a kill ends as ``kill -9`` would; the resumes and
the uninterrupted runs run in the test process. BLEU is a stand-in that is a function of the
decoded weights (a resume must decode the very weights the run evaluated), so that --patience and
best.pt see improvements and stalls in a few steps of a tiny model. The parametrized ids list the
cases; pytest's report gives each one's result.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamnmt import fsutil
from streamnmt.checkpoint import load_checkpoint, load_safetensors
from streamnmt.cli import build_parser, main
from streamnmt.config import build_job
from streamnmt.training import checkpointer as ckpt_mod
from streamnmt.training import evaluator as evaluator_mod
from streamnmt.training.checkpointer import Checkpointer
from streamnmt.training.runs import read_csv
from streamnmt.training.trainer import Trainer
from tests.conftest import in_child, single_thread

MODES = ("off", "on")  # --async-eval
FLAGS = ["--device", "cpu", "--model", "tiny", "--builtin-size", "200", "--batch-size", "16", "--max-len", "32",
         "--dropout", "0", "--sync-strategy", "event", "--loss-interval", "1", "--seed", "3", "--epochs", "3",
         "--eval-every", "5", "--bleu-samples", "4", "--beam-size", "1", "--patience", "3", "--best-metric", "bleu",
         "--save-every", "4", "--ema", "0"]
EVAL_COLS = ("step", "epoch", "val_loss", "bleu", "bleu_n", "best")


def fake_bleu(model, src_tok, tgt_tok, pairs, *, stop=None, **_):
    """A BLEU of the decoded weights (their sum, scrambled): the same weights, the same score."""
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    if threading.current_thread() is not threading.main_thread():
        time.sleep(0.2)  # a pass beside training lasts a few steps: a last.pt is written meanwhile
    hook = FAULT.get("bleu")
    if hook is not None:
        return hook(total, pairs, stop)
    return {"bleu": abs(total * 1e3) % 10.0, "n": len(pairs)}


FAULT: dict[str, Callable] = {}  # a child's injected behaviour of the BLEU pass


class Pool:
    """The scoring workers' stand-in (the stand-in BLEU scores nothing): counts the open ones."""

    open = 0

    def __init__(self, tgt_lang: str):
        Pool.open += 1

    def close(self) -> None:
        Pool.open -= 1


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One thread, a STREAMNMT_HOME of the module's, the stand-in BLEU; the two uninterrupted runs."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("faults")
    mp.setenv("STREAMNMT_HOME", str(root / "home"))
    mp.setattr(evaluator_mod, "bleu_on_pairs", fake_bleu)
    mp.setattr(evaluator_mod, "ScorePool", Pool)
    with single_thread():
        refs = {}
        for mode in MODES:
            t = trainer(root, "ref-" + mode, mode)
            t.train()
            refs[mode] = root / ("ref-" + mode)
        yield root, refs
    mp.undo()


def trainer(project: Path, name: str, mode: str, *extra: str) -> Trainer:
    args = vars(build_parser().parse_args(["train", *FLAGS, "--async-eval", mode, "--project", str(project),
                                           "--name", name, *extra]))
    for key in ("_run", "command"):
        args.pop(key)
    return Trainer(build_job(args), log=lambda _: None)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_after_fault(run: Path) -> None:
    """last.pt loads; best.pt and best.safetensors (where written) hold the same weights."""
    w = run / "weights"
    assert load_checkpoint(w / "last.pt")["step"] > 0
    if (w / "best.pt").exists():
        assert same(weights(w / "best.pt"), load_safetensors(w / "best.safetensors"))


def resume_and_compare(run: Path, ref: Path) -> None:
    last = run / "weights" / "last.pt"
    Trainer.from_checkpoint(str(last), log=lambda _: None).train()
    w, rw = run / "weights", ref / "weights"
    assert [(r["step"], r["epoch"], r["loss"]) for r in read_csv(run / "steps.csv")] == \
           [(r["step"], r["epoch"], r["loss"]) for r in read_csv(ref / "steps.csv")]
    assert [{c: r[c] for c in EVAL_COLS} for r in read_csv(run / "evals.csv")] == \
           [{c: r[c] for c in EVAL_COLS} for r in read_csv(ref / "evals.csv")]
    got, want = load_checkpoint(w / "last.pt"), load_checkpoint(rw / "last.pt")
    def record(ckpt):  # the early-stopping state (the time rule's seconds aside: not replayed)
        return ckpt["step"], {k: v for k, v in ckpt["stopping"].items() if k != "cadence"}, ckpt["last_eval_step"]
    assert record(got) == record(want)
    assert same(got["model"], want["model"])
    best, ref_best = load_checkpoint(w / "best.pt"), load_checkpoint(rw / "best.pt")
    assert (best["step"], best["best"]) == (ref_best["step"], ref_best["best"]) and same(best["model"], ref_best["model"])
    assert same(best["model"], load_safetensors(w / "best.safetensors"))
    assert not list(w.glob(".*.tmp"))


def test_the_uninterrupted_runs_stop_early_and_agree(env):
    """The reference: --patience stops it, best.pt was replaced during the run, and a run whose
    passes ran beside training evaluated and stopped as the one that waited for them, but for the
    one evaluation a pass beside training decides later."""
    _, refs = env
    rows = {m: [r for r in read_csv(refs[m] / "evals.csv") if not r["kind"]] for m in MODES}  # not the average
    assert sum(r["best"] == "1" for r in rows["off"]) >= 2 and rows["off"][-1]["best"] == "0"
    assert Pool.open == 0  # each run closed its scoring workers
    assert load_checkpoint(refs["off"] / "weights" / "last.pt")["stopping"]["bad"] >= 3  # stopped by --patience
    cols = [{c: r[c] for c in EVAL_COLS} for r in rows["off"]]
    assert [{c: r[c] for c in EVAL_COLS} for r in rows["on"]][:len(cols)] == cols
    # beside training, the pass that asks the stop decides while the loop trains on: on a fast machine
    # the loop reaches its next evaluation first (which may score a new best, so last.pt's count of
    # evaluations without one restarts); never a second one
    on = load_checkpoint(refs["on"] / "weights" / "last.pt")["stopping"]
    assert len(rows["on"]) in (len(cols), len(cols) + 1)
    assert on["bad"] >= 3 or len(rows["on"]) == len(cols) + 1


# -- kills: a write's stages --------------------------------------------------------------------

def _kill_in_write(stage: str, target: str, nth: int) -> None:
    """Patch the write path of this (child) process: SIGKILL at ``stage`` of the ``nth`` write of
    ``target`` (last.pt or best.pt)."""
    seen = {"n": 0}

    def mine(name: str) -> bool:
        return name == target or name.startswith(f".{target}.")

    if stage == "staging":  # the loop's copy done, the writer not started
        real_stage = Checkpointer._stage

        def stage_then_kill(self, kind, state):
            staged = real_stage(self, kind, state)
            if (kind == "last") == (target == "last.pt"):
                seen["n"] += 1
                if seen["n"] == nth:
                    kill_self()
            return staged
        Checkpointer._stage = stage_then_kill
    elif stage == "temp-file":  # half of the temporary file written
        real_save = torch.save

        def half_then_kill(obj, f, *a, **k):
            if isinstance(f, (str, Path)) and mine(Path(f).name):
                seen["n"] += 1
                if seen["n"] == nth:
                    Path(f).write_bytes(b"PK\x03\x04 half of a checkpoint")
                    kill_self()
            return real_save(obj, f, *a, **k)
        torch.save = half_then_kill
    elif stage in ("rename", "renamed"):  # the temporary file whole; before / after its rename
        real_replace = os.replace

        def replace_kill(src, dst, *a, **k):
            hit = mine(Path(dst).name)
            if hit:
                seen["n"] += 1
            if hit and seen["n"] == nth and stage == "rename":
                kill_self()
            real_replace(src, dst, *a, **k)
            if hit and seen["n"] == nth:
                kill_self()
        fsutil.os.replace = replace_kill
    elif stage == "safetensors":  # best.pt in place, best.safetensors not yet
        def kill_before(path, *a, **k):
            seen["n"] += 1
            if seen["n"] == nth:
                kill_self()
            real_st(path, *a, **k)
        real_st = ckpt_mod.save_safetensors
        ckpt_mod.save_safetensors = kill_before


# the fourth last.pt write (step 14's: last.pt then holds step 12, written while --async-eval's
# pass of step 10 ran), the second best.pt write (an older best.pt and best.safetensors exist).
# A last.pt write is the checkpointer's whatever --async-eval says, and its run, with --async-eval
# on, also holds a pass beside training in last.pt: on only. best.pt is written from the loop's
# weights by an evaluation on the loop (off) and from a pass's weights when the loop collects it
# (on): both.
KILLS = [("staging", "last.pt", 4, "on"), ("temp-file", "last.pt", 4, "on"), ("rename", "last.pt", 4, "on"),
         *((stage, "best.pt", 2, mode) for stage in ("renamed", "safetensors") for mode in MODES)]


@pytest.mark.parametrize("stage,target,nth,mode", KILLS, ids=[f"kill9-{s}-{t}-async-{m}" for s, t, _, m in KILLS])
def test_a_kill_at_a_stage_of_a_write(env, mode, stage, target, nth):
    root, refs = env
    name = f"kill-{stage}-{target}-{mode}"

    def run() -> int:
        _kill_in_write(stage, target, nth)
        trainer(root, name, mode).train()
        return 0

    assert in_child(run) == -signal.SIGKILL
    run_dir = root / name
    last = load_checkpoint(run_dir / "weights" / "last.pt")  # the last whole one
    if target == "last.pt":
        assert last["step"] == 12 and (last.get("pending_eval") or {}).get("step") in ((10, None) if mode == "on" else (None,))
    resume_and_compare(run_dir, refs[mode])  # the resume repairs best.safetensors where it must


# -- errors and signals -------------------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="tells a file's fsync by its /proc/self/fd link")
def test_a_slow_disk_and_a_non_finite_loss_leave_the_checkpoint_the_error_names(env):
    """--on-nan stop while a last.pt write is in flight on a slow disk: the run waits for the write,
    and its one error line names that file and its step. --async-eval on only: the first evaluation
    (step 5) runs on the loop in both modes, so neither has had a pass beside training by the fault at
    step 7; the resume then runs passes beside training."""
    root, refs = env
    mode = "on"
    name = f"nan-{mode}"
    err = root / f"{name}.err"

    def run() -> int:
        real_fsync = fsutil.os.fsync

        def slow(fd):  # a .pt file's fsync takes seconds
            if ".last.pt." in os.readlink(f"/proc/self/fd/{fd}"):
                time.sleep(1.5)
            real_fsync(fd)
        fsutil.os.fsync = slow
        os.environ["STREAMNMT_INJECT_INF_STEP"] = "7"  # the write of step 4 still in flight
        sys.stderr = open(err, "w")
        return main(["train", *FLAGS, "--async-eval", mode, "--on-nan", "stop", "--project", str(root),
                     "--name", name])

    assert in_child(run) == 1
    lines = [ln for ln in err.read_text().splitlines() if ln.startswith("streamnmt: error:")]
    last = root / name / "weights" / "last.pt"
    assert len(lines) == 1 and "step 7" in lines[0], err.read_text()[-2000:]
    assert f"the last good checkpoint is {last} (step 4)" in lines[0]
    check_after_fault(root / name)
    resume_and_compare(root / name, refs[mode])


@pytest.fixture(params=MODES, ids=lambda m: f"async-{m}")
def mode_on_and_off(request):
    return request.param


def test_an_error_in_the_bleu_pass_closes_the_run_and_resumes_exactly(env, mode_on_and_off):
    root, refs = env
    mode = mode_on_and_off
    name = f"bleu-error-{mode}"

    def run() -> int:
        calls = {"n": 0}

        def failing(total, pairs, stop):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("the BLEU pass failed")
            return {"bleu": abs(total * 1e3) % 10.0, "n": len(pairs)}
        FAULT["bleu"] = failing
        t = trainer(root, name, mode)
        try:
            t.train()
        except RuntimeError as e:
            assert "the BLEU pass failed" in str(e)
            assert t.evaluator.pool is None and Pool.open == 0  # the scoring workers closed
            assert t.evaluator.pending is None and not t.checkpointer.busy
            assert not [th for th in threading.enumerate() if th.name.startswith("streamnmt-")]
            return 7
        return 0

    assert in_child(run) == 7
    check_after_fault(root / name)
    resume_and_compare(root / name, refs[mode])


def test_sigterm_during_a_bleu_pass_saves_a_checkpoint_that_resumes_exactly(env, mode_on_and_off):
    """The signal cuts the pass short; last.pt records the evaluation undecided, with its weights,
    and the resumed run decides it where the uninterrupted run did."""
    assert _sigterm_in_pass(env, mode_on_and_off, 3)["on_loop"] is (mode_on_and_off == "off")


def test_sigterm_during_the_first_pass_on_the_loop_resumes_exactly_with_async_eval(env):
    """--async-eval's first pass runs on the loop: cut by a signal, the resumed run decides it at
    once (at the step the uninterrupted run decided it), not at its next evaluation."""
    assert _sigterm_in_pass(env, "on", 1)["on_loop"] is True


def _sigterm_in_pass(env, mode: str, nth: int) -> dict:
    """The run's last.pt pending evaluation after the signal (the resume compared inside)."""
    root, refs = env
    name = f"sigterm-{mode}-{nth}"

    def run() -> int:
        calls = {"n": 0}

        def signalled(total, pairs, stop):
            calls["n"] += 1
            if calls["n"] == nth:
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.monotonic() + 10
                while not stop() and time.monotonic() < deadline:
                    time.sleep(0.01)
                return {"bleu": 99.0, "n": 1}  # cut: a score no full pass would give
            return {"bleu": abs(total * 1e3) % 10.0, "n": len(pairs)}
        FAULT["bleu"] = signalled
        result = trainer(root, name, mode).train()
        return 5 if result["stopped"] else 0

    assert in_child(run) == 5
    check_after_fault(root / name)
    last = load_checkpoint(root / name / "weights" / "last.pt")
    assert last["pending_eval"] is not None and last["pending_eval"]["step"] == last["last_eval_step"]
    # the first pass (--async-eval's too) ran on the loop: the resumed run decides it at once
    assert last["pending_eval"]["on_loop"] is (nth == 1 or mode == "off")
    resume_and_compare(root / name, refs[mode])
    return last["pending_eval"]


def test_a_full_disk_leaves_the_last_whole_checkpoint(env):
    """ENOSPC in the third last.pt write (step 12's). --async-eval on only: the write and its error
    are the checkpointer's in both modes, and the run on winds up step 10's pass beside training too."""
    root, refs = env
    mode = "on"
    name = f"enospc-{mode}"
    err = root / f"{name}.err"

    def run() -> int:
        real_save = torch.save
        seen = {"n": 0}

        def full(obj, f, *a, **k):
            if isinstance(f, (str, Path)) and Path(f).name.startswith(".last.pt."):
                seen["n"] += 1
                if seen["n"] == 3:
                    Path(f).write_bytes(b"PK\x03\x04 as far as the disk went")
                    raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return real_save(obj, f, *a, **k)
        torch.save = full
        sys.stderr = open(err, "w")
        return main(["train", *FLAGS, "--async-eval", mode, "--project", str(root), "--name", name])

    assert in_child(run) == 1
    lines = [ln for ln in err.read_text().splitlines() if ln.startswith("streamnmt: error:")]
    assert len(lines) == 1 and "No space left on device" in lines[0], err.read_text()[-2000:]
    assert not list((root / name / "weights").glob(".*.tmp"))
    assert load_checkpoint(root / name / "weights" / "last.pt")["step"] == 8  # the write before the full disk
    check_after_fault(root / name)
    resume_and_compare(root / name, refs[mode])


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "empty"])
def test_a_damaged_last_pt_is_refused_in_one_line(env, damage, capsys):
    root, refs = env
    path = root / damage / "weights" / "last.pt"  # in a run directory: refused for its bytes, not its place
    path.parent.mkdir(parents=True)
    (root / damage / "config.yaml").write_bytes((refs["off"] / "config.yaml").read_bytes())
    good = (refs["off"] / "weights" / "last.pt").read_bytes()
    path.write_bytes({"truncated": good[:len(good) // 2], "corrupt": b"\x00garbage" * 64, "empty": b""}[damage])
    assert main(["train", "--resume", str(path)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("streamnmt: error: --resume:") and str(path) in err[0], err
    assert "not a valid streamnmt checkpoint" in err[0], err

