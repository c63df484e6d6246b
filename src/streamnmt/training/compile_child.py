"""``--compile background``: the step compiled in a child process while the run trains uncompiled.

A cold torch.compile of the training step (Dynamo's trace, AOTAutograd, Inductor's lowering and the
Triton kernels' builds) is most of a long run's set-up on a fresh machine, and a run that compiles in
its own process trains nothing meanwhile (how long: docs/PERFORMANCE.md, "What compiling buys").
Instead, once the engine is prepared (uncompiled), :func:`start` runs
this module as a child process (a fresh interpreter: TorchDynamo and Inductor are not thread-safe,
so not a thread) that builds the same model, compiles its step for each training batch shape and
runs one step of each, which fills the persistent compile cache (:mod:`.compile_cache`: the
directories the parent staged, which the child inherits, and the key's manifest, saved by the
child). The trainer polls :class:`BackgroundCompile` between epochs; when the child is done it
compiles its own step from the warm cache, captures it again and trains on compiled
(:meth:`streamnmt.training.trainer.Trainer.run_epoch`). A child that fails or times out costs one
line: the run goes on uncompiled.

What the compile's artefacts depend on is what the child is given: the model's shape and
attention kernels, the batch shapes (packed or not), the mixed precision, label smoothing and
Inductor's options (:func:`streamnmt.training.step.inductor_options`, read in both processes).
The weights' values do not matter, so the child's model is freshly initialised. One process only
(a torchrun run compiles in its own processes, ``--compile on``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streamnmt.errors import one_line

# many times a cold compile's set-up on a GPU (docs/PERFORMANCE.md, "What compiling buys"): a child
# still running then is stuck, or on a CPU that training keeps busy
TIMEOUT_S = 900.0
TAIL_CHARS = 300  # of the child's output, in the failure line
FINISHED = "finished at"  # the child's last line: its wall-clock time (time.time()) when done


@dataclasses.dataclass(frozen=True)
class Done:
    """How the child ended: ``ok``, its wall seconds, and where not ok the reason (one line)."""

    ok: bool
    seconds: float
    why: str = ""


class BackgroundCompile:
    """The child compiling the step; :meth:`poll` never blocks."""

    def __init__(self, proc: subprocess.Popen, out: Path, spec: Path, timeout_s: float = TIMEOUT_S):
        self.proc, self.out, self.spec, self.timeout_s = proc, out, spec, timeout_s
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.done: Done | None = None

    def poll(self) -> Done | None:
        """None while the child runs; else how it ended (a child past its timeout is stopped). A
        failed child's output file stays, for the line that names it."""
        if self.done is not None:
            return self.done
        rc = self.proc.poll()
        seconds = time.monotonic() - self.t0
        if rc is None:
            if seconds < self.timeout_s:
                return None
            self.stop()
            self.done = Done(False, seconds, f"no result after {self.timeout_s:.0f} s")
        elif rc == 0:
            finished = self._finished_at()  # the child's own end, not when this process polled
            self._cleanup(keep_out=False)
            self.done = Done(True, finished - self.t0_wall if finished is not None else seconds)
        else:
            self._cleanup(keep_out=True)
            self.done = Done(False, seconds, f"exit code {rc}: {self._tail()}")
        return self.done

    def _finished_at(self) -> float | None:
        try:
            found = re.findall(rf"^{FINISHED} ([\d.]+)$", self.out.read_text(encoding="utf-8", errors="replace"),
                               flags=re.MULTILINE)
        except OSError:
            return None
        return float(found[-1]) if found else None

    def _tail(self) -> str:
        try:
            text = self.out.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return "no output"
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        return (last[:TAIL_CHARS] + f" (its output: {self.out})") if last else str(self.out)

    def stop(self) -> None:
        """End the child (the run ended before it did); its cache entries written so far stay."""
        if self.done is not None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup(keep_out=False)

    def _cleanup(self, keep_out: bool) -> None:
        self.spec.unlink(missing_ok=True)
        if not keep_out:
            self.out.unlink(missing_ok=True)


def start(*, shape: Any, attention: str, amp: str, label_smoothing: float, clip: float, device: Any,
          batch_shapes: Sequence[Sequence[int]], packed: bool, seed: int, deterministic: bool,
          facts: dict[str, Any] | None, cache_root: str | None, log: Callable[[str], None]) -> BackgroundCompile:
    """Start the child for a step of ``shape`` (a :class:`streamnmt.models.transformer.ModelShape`)
    with ``attention`` kernels on ``device``; ``facts`` and ``cache_root``: the compile cache's key
    and folder (:class:`streamnmt.training.compile_cache.CompileCache`), so that the child saves the
    key's manifest (None: the directories alone). The child inherits the environment, where the
    cache directories point."""
    spec = {"shape": dataclasses.asdict(shape), "attention": attention, "amp": amp,
            "label_smoothing": label_smoothing, "clip": clip, "device": str(device),
            "batch_shapes": [list(s) for s in batch_shapes], "packed": packed, "seed": seed,
            "deterministic": deterministic, "facts": facts, "cache_root": cache_root, "parent": os.getpid()}
    fd, spec_path = tempfile.mkstemp(prefix="streamnmt-compile-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(spec, f, default=str)
    fd, out_path = tempfile.mkstemp(prefix="streamnmt-compile-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streamnmt.training.compile_child", spec_path],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_child_env())
    log(f"engine: compiling the step in a child process (pid {proc.pid}) while training starts uncompiled; "
        f"the compiled step takes over at the first epoch end after it is done")
    handle = BackgroundCompile(proc, Path(out_path), Path(spec_path))
    atexit.register(handle.stop)  # a run that ends (or fails) before the child does takes it along
    return handle


def take_over_when_done(run: Any, global_step: int, clock: Callable[[], float] = time.monotonic,
                        step_s: float | None = None) -> float:
    """Between epochs (the engine drained, no step in flight): once ``run``'s child is done, its step
    runs compiled from here, compiled from the cache the child filled and captured again; a child
    that failed, or a switch that fails, leaves it uncompiled, with one line. Not while a BLEU pass
    runs beside training (a capture beside another thread's GPU work is unsafe): at a later epoch
    end. ``step_s``: the uncompiled step's mean seconds so far (what a run that ends at a step count
    has left is counted in). Returns the seconds the switch took by ``clock`` (0 where nothing
    switched)."""
    child = getattr(run, "background_compile", None)
    done = child.poll() if child is not None else None
    pending = getattr(getattr(run, "evaluator", None), "pending", None) if done is not None else None
    if done is None or (done.ok and pending is not None and not pending[2].done):
        return 0.0
    run.background_compile = None
    if not done.ok:
        run.log(f"engine: the step's compile in the background failed ({done.why}); training goes on uncompiled")
        return 0.0
    left = worth_switching(time_left(run, global_step, step_s), len(run.train_loader.shapes()))
    if left is not None:
        run.log(f"engine: the step's compile in the background is done ~{left:.0f} s before the run's end: too "
                f"late to win the switch back; training ends uncompiled")
        return 0.0
    t0 = clock()
    step, strategy = run.train_step, run.strategy
    missed = _cache_misses()
    try:
        step.use_compiled(len(run.train_loader.shapes()))
        why = strategy.prepare(step, run.examples(), again=True)
    except Exception as e:  # noqa: BLE001 - whatever compiling raised: the run goes on as it was
        why = one_line(e, typed=True)
    if why is not None:
        step.use_uncompiled()
    seconds = clock() - t0
    missed = _cache_misses() - missed  # graph mode compiled in its warm-up: the child's entries should serve
    here = (f"compiled here from its cache and captured in {seconds:.1f} s" if "recapture_s" in strategy.report
            else "compiled here from its cache at each batch shape's next step")
    if missed:
        here += f"; {missed} graph(s) missed the cache and compiled here cold"
    run.log(f"engine: the switch to the compiled step failed ({why}); training goes on uncompiled" if why else
            f"engine: compiled step from step {global_step + 1} on (compiled beside training in "
            f"{done.seconds:.0f} s; {here})")
    return seconds


def time_left(run: Any, global_step: int, step_s: float | None) -> float | None:
    """Seconds the run has left: to ``--time-limit``, or to the step its ``--epochs``/``--max-steps``
    end it at, at ``step_s`` a step, the sooner; None where neither is known (a run until its plateau)."""
    from streamnmt.training.cooldown import steps_of_run

    budget = getattr(run, "budget", None)
    lefts = [budget.limit_s - budget.elapsed()] if budget is not None and budget.limit_s is not None else []
    job = getattr(run, "job", None)
    if job is not None and step_s:
        end = steps_of_run(job.run.max_steps, job.run.epochs, len(run.train_loader), job.engine.accum_steps)
        if end is not None:
            lefts.append((end - global_step) * step_s)
    return min(lefts) if lefts else None


def _cache_misses() -> int:
    """Inductor's FX graph cache misses in this process so far (its counters; 0 before TorchDynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["inductor"]["fxgraph_cache_miss"]) if utils is not None else 0


def worth_switching(left_s: float | None, shapes: int) -> float | None:
    """None where the switch pays: nothing known of the run's end, or the ``left_s`` seconds left save
    (at ``--compile auto``'s estimated saving, :mod:`streamnmt.engine.auto`) at least twice the warm
    compile of ``shapes`` batch shapes; else the seconds left."""
    from streamnmt.engine.auto import COMPILE_S_PER_SHAPE_WARM, COMPILE_SAVING

    if left_s is None:
        return None
    return None if left_s * COMPILE_SAVING >= 2 * COMPILE_S_PER_SHAPE_WARM * max(shapes, 1) else left_s


def stop(run: Any) -> None:
    """The run ends: its child, if still compiling, is stopped (the end needs the GPU and the cores)."""
    child, run.background_compile = getattr(run, "background_compile", None), None
    if child is not None:
        child.stop()


def _child_env() -> dict[str, str]:
    """This process's environment, with the package importable where it runs from a source tree,
    and Inductor's parallel kernel builds held to the cores the training loop and its loader
    workers leave (:data:`streamnmt.setupclock.LEFT_CORES`) unless the user set their number."""
    from streamnmt.setupclock import LEFT_CORES, usable_cores

    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, usable_cores() - LEFT_CORES)))
    src = str(Path(__file__).resolve().parents[2])
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if src not in paths:
        env["PYTHONPATH"] = os.pathsep.join([src, *paths])
    return env


def compile_step(spec: dict[str, Any], log: Callable[[str], None] = print) -> None:
    """The child's work: the step of ``spec``'s model compiled and run once per batch shape; the
    compile cache's manifest saved."""
    from streamnmt import testhooks

    if testhooks.compile_child_fails():
        raise RuntimeError("compile child failure injected by STREAMNMT_TEST_COMPILE_CHILD_FAILS")
    import torch

    from streamnmt.engine.base import move
    from streamnmt.models.transformer import ModelShape, Transformer
    from streamnmt.syncstats import host_sync
    from streamnmt.training import compile_cache
    from streamnmt.training.step import example_batch, make_step

    device = torch.device(spec["device"])
    if device.type == "cuda":  # the parent's device ("cuda" names the current one, as in the parent)
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    if spec["deterministic"]:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec["seed"])
    shape = ModelShape(**spec["shape"])
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        model = Transformer(shape)
    model.to(device)
    model.set_attention(spec["attention"])
    model.train()
    if spec["facts"] is not None:  # the parent's key: the manifest says the artefacts are there
        root = Path(spec["cache_root"]) if spec["cache_root"] else None
        compile_cache.stage(compile_cache.CompileCache(spec["facts"], root, since="the child's start"), log)
    step = make_step(model, device, d_model=shape.d_model, amp=spec["amp"], clip=spec["clip"],
                     label_smoothing=spec["label_smoothing"], compile=True, shapes=len(spec["batch_shapes"]))
    for i, bs in enumerate(spec["batch_shapes"]):
        batch = move(example_batch(tuple(bs), shape, spec["seed"] + i, packed=spec["packed"]), device)
        loss = step.forward(batch)  # the first call of a shape compiles its forward, its backward below
        step.backward(loss)
        step.optimizer_step()
    if device.type == "cuda":
        # Needed: the compiled kernels' first launches must have run (Triton builds at first launch)
        # before the cache is saved and the parent is told the compile is done.
        host_sync("compile_child.done", lambda: torch.cuda.synchronize(device))
    step.compile_cache.save(log)
    log(f"compiled {len(spec['batch_shapes'])} batch shape(s)")
    log(f"{FINISHED} {time.time():.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m streamnmt.training.compile_child SPEC.json", file=sys.stderr)
        return 2
    from streamnmt.dist import die_with_parent

    die_with_parent()  # a run killed outright takes its child along (atexit does not run then)
    # Ctrl-C reaches the whole process group: the run stops the child itself, with no traceback here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path = Path(args[0])
    spec = json.loads(path.read_text(encoding="utf-8"))
    path.unlink(missing_ok=True)
    if spec.get("parent") not in (None, os.getppid()):  # the run died before the line above took hold
        return 3
    try:
        compile_step(spec)
    except Exception as e:  # noqa: BLE001 - the parent reads the last line and trains on uncompiled
        print(one_line(e, typed=True, limit=TAIL_CHARS), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
