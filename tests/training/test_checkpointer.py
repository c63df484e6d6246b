"""Background checkpoint writes: what they write, that a kill mid-write leaves the last good
file, and that a resume after one equals a resume after a synchronous save (CPU)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from streamnmt.checkpoint import load_checkpoint
from streamnmt.cli import main
from streamnmt.training import checkpointer as ckpt_mod
from streamnmt.training.checkpointer import Checkpointer
from streamnmt.training.runs import read_csv
from tests.conftest import Forked

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--device", "cpu", "--model", "tiny", "--builtin-size", "200", "--bleu-samples", "0", "--batch-size", "16",
        "--max-len", "32", "--dropout", "0", "--sync-strategy", "event", "--loss-interval", "1", "--seed", "7"]


@pytest.fixture(autouse=True)
def home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "home"
    monkeypatch.setenv("STREAMNMT_HOME", str(home))
    return home


def test_the_written_state_is_the_state_at_save_time(tmp_path):
    w = torch.arange(6.0)
    state = {"model": {"a": w, "tied": w}, "step": 3, "nested": [torch.ones(2), ("x", 1)]}
    c = Checkpointer(torch.device("cpu"), background=True)
    c.save(tmp_path / "last.pt", state)
    w.add_(100.0)  # training goes on and changes the weights in place while the writer writes
    c.close()
    got = load_checkpoint(tmp_path / "last.pt")
    assert torch.equal(got["model"]["a"], torch.arange(6.0)) and got["step"] == 3
    assert got["model"]["a"].data_ptr() == got["model"]["tied"].data_ptr()  # a tied tensor is written once
    assert got["nested"][1] == ("x", 1) and not list(tmp_path.glob(".*.tmp"))


def _gated_writes(monkeypatch, held=None) -> tuple[threading.Event, list[tuple[str, str]]]:
    """Writes that record their start and end and wait for the gate (those named in ``held`` only,
    where given) before they write."""
    gate, order = threading.Event(), []
    real = ckpt_mod.save_checkpoint

    def gated(path, state):
        order.append(("start", path.name))
        if held is None or path.name in held:
            gate.wait(10)
        real(path, state)
        order.append(("end", path.name))

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", gated)
    return gate, order


def test_one_write_in_flight_and_its_error_reaches_the_loop(tmp_path, monkeypatch):
    gate, order = _gated_writes(monkeypatch)
    c = Checkpointer(torch.device("cpu"), background=True)
    c.save(tmp_path / "a.pt", {"step": 1})
    assert c.busy
    threading.Timer(0.3, gate.set).start()
    t0 = time.perf_counter()
    waited = c.save(tmp_path / "b.pt", {"step": 2})  # waits for a.pt's write first
    assert waited >= 0.2 and time.perf_counter() - t0 >= 0.2
    c.close()
    assert order == [("start", "a.pt"), ("end", "a.pt"), ("start", "b.pt"), ("end", "b.pt")]

    def broken(path, state):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", broken)
    c.save(tmp_path / "c.pt", {"step": 3})
    with pytest.raises(OSError, match="No space left"):
        c.wait()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    ck = load_checkpoint(path)
    return {**ck["model"], **{f"opt{i}.{k}": v for i, s in ck["optimizer"]["state"].items()
                              for k, v in s.items() if isinstance(v, torch.Tensor)}}


def test_resume_after_an_async_save_equals_resume_after_a_sync_save(tmp_path):
    common = [*TINY, "--epochs", "3", "--max-steps", "12", "--save-every", "5", "--keep-last", "2",
              "--project", str(tmp_path)]
    assert main(["train", *common, "--name", "async"]) == 0
    assert main(["train", *common, "--name", "sync", "--no-async-save"]) == 0
    for name in ("step_000005.pt", "step_000010.pt", "last.pt"):
        a, s = _weights(tmp_path / "async" / "weights" / name), _weights(tmp_path / "sync" / "weights" / name)
        assert a.keys() == s.keys() and all(torch.equal(a[k], s[k]) for k in a), name
    for name in ("async", "sync"):
        assert main(["train", "--resume", str(tmp_path / name / "weights" / "step_000005.pt"), "--max-steps", "12"]) == 0
    a, s = _weights(tmp_path / "async" / "weights" / "last.pt"), _weights(tmp_path / "sync" / "weights" / "last.pt")
    assert all(torch.equal(a[k], s[k]) for k in a)
    best = load_checkpoint(tmp_path / "async" / "weights" / "best.pt")
    assert "optimizer" not in best and set(best["model"]) == {k for k in a if not k.startswith("opt")}  # weights only
    assert (tmp_path / "async" / "weights" / "best.safetensors").is_file()


def _run_stuck_mid_write(argv: list[str], marker: Path) -> int:
    """``streamnmt ARGV`` whose write of step 6's checkpoint stops halfway (``marker`` then
    written) until the process is killed; in a forked child of the test process."""
    from streamnmt.fsutil import atomic_path

    real = ckpt_mod.save_checkpoint

    def stuck_at_step_6(path, state):
        if state.get("step") != 6:
            return real(path, state)
        with atomic_path(path) as tmp:  # half a file, then the process is killed
            tmp.write_bytes(b"PK\x03\x04 half of a checkpoint")
            marker.touch()
            time.sleep(120)

    ckpt_mod.save_checkpoint = stuck_at_step_6  # this child's module only
    return main(argv)


def test_a_kill_mid_write_leaves_the_last_good_checkpoint_exact_to_resume(tmp_path, home):
    common = [*TINY, "--epochs", "3", "--max-steps", "9", "--save-every", "3", "--project", str(tmp_path)]
    assert main(["train", *common, "--name", "ref"]) == 0
    env = dict(os.environ, STREAMNMT_HOME=str(home))
    marker = tmp_path / "midwrite"
    proc = Forked(lambda: _run_stuck_mid_write(["train", *common, "--name", "killed"], marker), env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.wait(30)
        out, err = proc.communicate()
    assert marker.exists(), (out + err)[-3000:]
    weights = tmp_path / "killed" / "weights"
    assert list(weights.glob(".last.pt.*.tmp")), "the kill came mid-write"
    assert load_checkpoint(weights / "last.pt")["step"] == 3  # the write of step 6 never replaced it
    assert main(["train", "--resume", str(weights / "last.pt")]) == 0
    assert not list(weights.glob(".*.tmp"))  # the resumed run removed the torn temporary
    ref = [(r["step"], r["loss"]) for r in read_csv(tmp_path / "ref" / "steps.csv")]
    got = [(r["step"], r["loss"]) for r in read_csv(tmp_path / "killed" / "steps.csv")]
    assert got == ref and len(ref) == 9


def test_ema_pt_is_written_beside_a_last_pt_write_and_close_waits_for_both(tmp_path, monkeypatch):
    """ema.pt (an OVERLAPS kind) does not wait for the last.pt write in flight; last.pt and best.pt
    still wait for every write (last.pt names the best.pt on disk); close() waits for all, and an
    error of either write reaches the loop."""
    real = ckpt_mod.save_checkpoint
    gate, order = _gated_writes(monkeypatch, held={"last.pt"})
    c = Checkpointer(torch.device("cpu"), background=True)
    c.save(tmp_path / "last.pt", {"step": 1})
    waited = c.save(tmp_path / "ema.pt", {"step": 1}, kind="ema")
    assert waited < 5.0 and c.busy  # not after last.pt: that write is still held by the gate
    deadline = time.monotonic() + 10
    while ("end", "ema.pt") not in order and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == [("start", "last.pt"), ("start", "ema.pt"), ("end", "ema.pt")]
    threading.Timer(0.3, gate.set).start()
    waited = c.save(tmp_path / "best.pt", {"step": 1}, kind="best")  # waits for last.pt's write
    assert waited >= 0.2 and order.index(("end", "last.pt")) < order.index(("start", "best.pt"))
    c.close()
    assert not c.busy and {p.name for p in tmp_path.glob("*.pt")} == {"last.pt", "ema.pt", "best.pt"}
    assert load_checkpoint(tmp_path / "ema.pt")["step"] == 1

    def broken_ema(path, state):
        if path.name == "ema.pt":
            raise OSError(28, "No space left on device", str(path))
        real(path, state)

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", broken_ema)
    c.save(tmp_path / "last.pt", {"step": 2})
    c.save(tmp_path / "ema.pt", {"step": 2}, kind="ema")
    with pytest.raises(OSError, match="No space left"):
        c.close()
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 2


def test_a_write_in_flight_counts_what_it_has_left_by_the_last_of_its_kind(tmp_path, monkeypatch):
    """The run's end reserve waits for the writes in flight: by the last write of their kind (any
    kind's before one of theirs ended) less the time they have run, nothing once none is in flight."""
    gate, _ = _gated_writes(monkeypatch, held={"held.pt"})
    c = Checkpointer(torch.device("cpu"), background=True)
    assert c.in_flight_s() == 0.0
    c.write_s = {"last": 30.0}
    c.save(tmp_path / "held.pt", {"step": 1}, kind="best")  # no best.pt has ended: last.pt's 30 s
    time.sleep(0.2)
    left = c.in_flight_s()
    assert 29.0 < left <= 29.8
    gate.set()
    c.close()
    assert c.in_flight_s() == 0.0 and "best" in c.write_s
    c.write_s = {**c.write_s, "best": 20.0}
    gate.clear()
    c.save(tmp_path / "held.pt", {"step": 2}, kind="best")
    assert 19.0 < c.in_flight_s() <= 20.0  # its own kind's last write now
    gate.set()
    c.close()
