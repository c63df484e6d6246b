"""Exact resume after SIGKILL, SIGTERM, the NaN policies, and safe checkpoint loading (CPU)."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from streamnmt.checkpoint import load_safetensors
from streamnmt.cli import main
from streamnmt.training.runs import read_csv
from tests.conftest import Forked, in_child

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest.single_thread)

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "500", "--bleu-samples", "0",
        "--batch-size", "16", "--max-len", "32", "--epochs", "3",
        "--ema", "0"]  # best.pt holds the trained weights: the checkpoints' mechanics, not the average


@pytest.fixture()
def home(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "home")


def run_cli(args: list[str], home: str, env: dict | None = None):
    """``python -m streamnmt train ARGS`` to its end, a fresh process."""
    full_env = dict(os.environ, STREAMNMT_HOME=home, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    cmd = [sys.executable, "-m", "streamnmt", "train", *args]
    # In its own process group, so that nothing it started outlives the test.
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def losses(run: Path) -> list[tuple[str, str, str]]:
    return [(r["step"], r["epoch"], r["loss"]) for r in read_csv(run / "steps.csv")]


def train_here(args: list[str], home: str, monkeypatch, capsys) -> tuple[int, str]:
    """``streamnmt train ARGS`` in the test process (its imports paid once): the exit code and what it
    printed. For the runs that are not killed and need no fresh process: references, injected faults."""
    monkeypatch.setenv("STREAMNMT_HOME", home)
    capsys.readouterr()
    code = main(["train", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def killed_in_child(args: list[str], home: str, step: int, log: Path) -> tuple[int, str]:
    """``streamnmt train ARGS`` in a forked child of the test process (its imports paid once) that the
    trainer ends with SIGKILL after step ``step`` (STREAMNMT_TEST_KILL_AT_STEP): the child's exit code
    and what it printed (to ``log``)."""
    def run() -> int:
        os.environ.update(STREAMNMT_HOME=home, STREAMNMT_TEST_KILL_AT_STEP=str(step))
        sys.stdout = sys.stderr = open(log, "w")  # noqa: SIM115 - the child's to its end
        return main(["train", *args])

    code = in_child(run)
    return code, log.read_text() if log.is_file() else ""


@pytest.mark.parametrize("corpus", ["2000", "500"])
def test_resume_after_sigkill_is_exact(tmp_path, home, corpus, monkeypatch, capsys):
    """Killed after step 35 of 40: resumes from the last checkpoint, step 30 (mid-epoch) or, when an
    epoch ends between 30 and 35 and the epoch-end save rule saved there, that epoch's end; the
    smaller corpus crosses an epoch boundary. The killed run and its resume are processes of their
    own (the killed one forked from the test process, the resume started fresh); the uninterrupted
    reference runs in the test process."""
    common = [*TINY, "--max-steps", "40", "--seed", "5", "--save-every", "10", "--project", str(tmp_path),
              "--builtin-size", corpus]
    code, out = train_here([*common, "--name", "ref"], home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    ref_losses = losses(tmp_path / "ref")
    per_epoch = sum(1 for _, e, _ in ref_losses if e == "1")
    resumed_from = {30, per_epoch} if 30 < per_epoch < 35 else {30}
    code, out = killed_in_child([*common, "--name", "killed"], home, 35, tmp_path / "killed.log")
    assert code == -signal.SIGKILL, out[-2000:]
    last = tmp_path / "killed" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] in resumed_from
    resumed = run_cli(["--resume", str(last)], home)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len(ref_losses) == 40
    if corpus == "500":
        assert per_epoch < 35 and len({e for _, e, _ in ref_losses}) == 2  # crosses an epoch boundary
    else:
        assert {e for _, e, _ in ref_losses} == {"1"}  # the resume starts mid-epoch
    assert losses(tmp_path / "killed") == ref_losses
    # results.csv: the epoch the resume started inside counts the steps before it too
    means = [float(r[k]) for r in read_csv(tmp_path / "ref" / "results.csv") for k in ("train_loss", "train_nll")]
    got = [float(r[k]) for r in read_csv(tmp_path / "killed" / "results.csv") for k in ("train_loss", "train_nll")]
    assert got == pytest.approx(means, rel=1e-9)
    a = torch.load(tmp_path / "ref" / "weights" / "last.pt", weights_only=True)["model"]
    b = torch.load(last, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_other_flags(tmp_path, home, capsys, monkeypatch):
    monkeypatch.setenv("STREAMNMT_HOME", home)
    assert main(["train", "--resume", str(tmp_path / "x.pt"), "--batch-size", "3"]) == 2
    assert "--batch-size" in capsys.readouterr().err


def test_sigterm_saves_and_exits_0(tmp_path, home):
    """``streamnmt train`` in a forked child of the test process (its imports paid once), stopped by
    SIGTERM after step 6."""
    args = [*TINY, "--epochs", "50", "--seed", "1", "--project", str(tmp_path), "--name", "t", "--loss-interval", "1"]
    proc = Forked(lambda: main(["train", *args]), dict(os.environ, STREAMNMT_HOME=home))
    steps = tmp_path / "t" / "steps.csv"
    deadline = time.time() + 300
    while time.time() < deadline and (not steps.is_file() or len(steps.read_text().splitlines()) < 6):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by signal" in out + err
    ckpt = torch.load(tmp_path / "t" / "weights" / "last.pt", weights_only=True)
    assert ckpt["step"] == len(read_csv(steps)) >= 5


@pytest.mark.plots  # results.png of a run with a non-finite loss
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_policies(tmp_path, home, policy, monkeypatch, capsys):
    args = [*TINY, "--max-steps", "20", "--save-every", "5", "--loss-interval", "1", "--on-nan", policy,
            "--project", str(tmp_path), "--name", policy]
    monkeypatch.setenv("STREAMNMT_INJECT_INF_STEP", "7")
    monkeypatch.setenv("STREAMNMT_HOME", home)
    code = main(["train", *args])
    out = capsys.readouterr()
    run = tmp_path / policy
    rows = read_csv(run / "steps.csv")
    if policy == "stop":
        assert code == 1 and "step 7" in out.err
        assert torch.load(run / "weights" / "last.pt", weights_only=True)["step"] == 5  # last good one
    else:
        assert code == 0, out.err[-2000:]
        assert len(rows) == 20 and rows[6]["loss"] == "inf"
        assert all(float(r["loss"]) < 100 for i, r in enumerate(rows) if i != 6)
        assert "step 7" in out.out + out.err


def test_bad_checkpoints_are_refused(tmp_path, home, capsys, monkeypatch):
    monkeypatch.setenv("STREAMNMT_HOME", home)
    args = [*TINY, "--max-steps", "3", "--project", str(tmp_path), "--name", "ok"]
    assert main(["train", *args]) == 0
    good = tmp_path / "ok" / "weights" / "last.pt"
    st = load_safetensors(tmp_path / "ok" / "weights" / "best.safetensors")
    ref = torch.load(good, weights_only=True)["model"]
    assert set(st) == set(ref) and all(torch.equal(st[k], ref[k]) for k in ref)

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:1000])
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00not a checkpoint" * 50)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"format": "streamnmt-checkpoint", "x": Payload()}))
    other = tmp_path / "other.pt"
    ckpt = torch.load(good, weights_only=True)
    ckpt["model"]["generator.weight"] = torch.zeros(3, 3)
    torch.save(ckpt, other)
    for path, expect in ((tmp_path / "missing.pt", "not found"), (truncated, "not a valid"),
                         (corrupt, "not a valid"), (evil, "not a valid"), (other, "generator.weight")):
        code = main(["train", *args, "--weights", str(path), "--name", "w"])
        err = capsys.readouterr().err
        assert code == 1 and expect in err and str(path.name) in err, err
    assert not marker.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks resuming a GPU run on a machine without one")
def test_resume_a_gpu_checkpoint_on_cpu(tmp_path, home, monkeypatch, capsys):
    args = [*TINY, "--max-steps", "4", "--save-every", "2", "--project", str(tmp_path), "--name", "g"]
    code, out = train_here(args, home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    last = tmp_path / "g" / "weights" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["config"]["run"]["device"] = "cuda"  # as written by a run on a GPU
    ckpt["config"]["run"]["max_steps"] = 6
    for group in ckpt["optimizer"]["param_groups"]:
        group["capturable"] = True
    torch.save(ckpt, last)
    code, out = train_here(["--resume", str(last), "--device", "cpu"], home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    assert [int(r["step"]) for r in read_csv(tmp_path / "g" / "steps.csv")] == list(range(1, 7))


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_non_finite_gradient_under_a_finite_loss(tmp_path, home, policy, monkeypatch, capsys):
    """From step 6 on every gradient is infinite while the loss stays finite (test hook): steps.csv
    shows each step's gradient norm and skipped flag; --on-nan stop ends at step 6, --on-nan skip
    warns per step and --max-skipped-steps 3 ends the run after 3 skipped updates in a row."""
    args = [*TINY, "--max-steps", "20", "--save-every", "5", "--loss-interval", "1", "--on-nan", policy,
            "--max-skipped-steps", "3", "--project", str(tmp_path), "--name", policy]
    monkeypatch.setenv("STREAMNMT_INJECT_INF_GRAD_FROM", "6")
    monkeypatch.setenv("STREAMNMT_HOME", home)
    code = main(["train", *args])
    err = capsys.readouterr().err
    rows = read_csv(tmp_path / policy / "steps.csv")
    assert code == 1
    errors = [ln for ln in err.splitlines() if ln.startswith("streamnmt: error:")]
    last = 6 if policy == "stop" else 8
    assert len(errors) == 1 and f"step {last}" in errors[0]
    assert ("non-finite gradient norm" if policy == "stop" else "3 updates in a row skipped") in errors[0]
    assert [int(r["step"]) for r in rows] == list(range(1, last + 1))
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    assert [r["skipped"] for r in rows] == ["0"] * 5 + ["1"] * (last - 5)
    assert all(0 < float(r["grad_norm"]) < 1e3 for r in rows[:5]) and all(r["grad_norm"] == "inf" for r in rows[5:])
    assert torch.load(tmp_path / policy / "weights" / "last.pt", weights_only=True)["step"] == 5  # last good one


def test_a_failed_checkpoint_write_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk or a file-size limit as a RuntimeError; the CLI's
    one line (an OSError with the file) needs it as an OSError, and no file is left half written."""
    from streamnmt.checkpoint import save_checkpoint

    def failing_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5033408 vs 5033296")

    monkeypatch.setattr(torch, "save", failing_save)
    target = tmp_path / "weights" / "last.pt"
    target.parent.mkdir()  # a run's folder (one the write made itself goes with the failure)
    with pytest.raises(OSError, match="writing the checkpoint failed .*unexpected pos") as e:
        save_checkpoint(target, {"step": 1})
    assert e.value.filename == str(target)
    assert list(target.parent.iterdir()) == []


def test_an_uncaught_error_with_loader_workers_ends_the_process(tmp_path, home):
    """A run whose loop raises an error nothing catches (a bug) exits with its traceback: the loader's
    workers ignore SIGTERM, so an exit that only joined them (the traceback keeping the loader alive)
    waited forever."""
    code = ("import sys\n"
            "from streamnmt.training.trainer import Trainer\n"
            "after = Trainer._after_step\n"
            "def failing(self):\n"
            "    if self.global_step >= 3:\n"
            "        raise RuntimeError('injected failure in the loop')\n"
            "    return after(self)\n"
            "Trainer._after_step = failing\n"
            "from streamnmt.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    args = ["train", *TINY, "--workers", "1", "--sync-strategy", "full", "--project", str(tmp_path), "--name", "w"]
    env = dict(os.environ, STREAMNMT_HOME=home, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-2000:]
    assert "injected failure in the loop" in err


def test_a_new_run_in_a_reused_directory_leaves_no_earlier_last_pt(tmp_path, home, monkeypatch, capsys):
    """--exist-ok: the earlier run's last.pt beside the new run's config.yaml would be resumed as the
    new run's after a kill before its first save."""
    args = [*TINY, "--max-steps", "3", "--project", str(tmp_path), "--name", "x"]
    code, out = train_here(args, home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    last = tmp_path / "x" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["step"] == 3
    code, out = killed_in_child([*TINY, "--seed", "7", "--project", str(tmp_path), "--name", "x", "--exist-ok"],
                                home, 1, tmp_path / "killed.log")
    assert code == -signal.SIGKILL, out[-2000:]
    assert not last.exists()


def test_resume_refuses_a_checkpoint_outside_a_run_directory(tmp_path, home, monkeypatch, capsys):
    args = [*TINY, "--max-steps", "2", "--project", str(tmp_path / "runs"), "--name", "r"]
    code, out = train_here(args, home, monkeypatch, capsys)
    assert code == 0, out[-2000:]
    copy = tmp_path / "downloads" / "a" / "last.pt"
    copy.parent.mkdir(parents=True)
    copy.write_bytes((tmp_path / "runs" / "r" / "weights" / "last.pt").read_bytes())
    code, out = train_here(["--resume", str(copy)], home, monkeypatch, capsys)
    assert code == 1
    assert f"--resume: {copy} is not in a run's weights/ folder beside its config.yaml" in out and "--weights" in out
    assert sorted(p.name for p in (tmp_path / "downloads").rglob("*")) == ["a", "last.pt"]  # nothing written
    other = tmp_path / "downloads" / "weights" / "last.pt"  # a folder named weights/ is not yet a run
    other.parent.mkdir()
    other.write_bytes(copy.read_bytes())
    code, out = train_here(["--resume", str(other)], home, monkeypatch, capsys)
    assert code == 1 and "beside its config.yaml" in out
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == ["a", "weights"]
