"""``--average-last K``: the mean of the last K evaluated weights, scored at the end of the run
beside the best single evaluation; ``best.pt`` is the winner.

Users coming from fairseq average the last few checkpoints of a run (``average_checkpoints.py``;
the Transformer recipe averages the last 5): the mean of weights a little apart along a plateau
usually translates a little better than any one of them, and a run that ends past its plateau
then ends no lower than its best. Here the run keeps the weights of its last K evaluations (the
weights that were scored: the moving average's under ``--eval-ema``) and, at its end, validates
and scores their mean on dev like an evaluation. The mean replaces ``best.pt`` only where it is
strictly better by ``--best-metric`` than the best single evaluation (a tie keeps the single
evaluation's weights, already on disk); ``evals.csv`` gets its row (``kind`` ``average``) and one
line names the winner.

What it costs: a ring of K host copies of the model's state (float32, tied tensors once; pinned
on a GPU, filled by copies queued on the loop's stream before the evaluation's validation, whose
own host wait covers them), ``last.pt`` carries the ring (so a resumed run ends as the
uninterrupted one would) and grows by as much, and at the end one evaluation more and one copy of
the weights on the device while the mean is evaluated. The mean is the element-wise mean of the
K copies, summed in float64 and rounded once to the weights' dtype (as ``streamnmt average``);
tensors that are not floating point are the last evaluation's. Several ranks: every rank counts
the evaluated steps, rank 0 alone keeps the copies, evaluates the mean and tells the others its
scores (one broadcast at the end, none in the step).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from streamnmt.engine import STATS
from streamnmt.syncstats import host_sync
from streamnmt.training.checkpointer import new_weights_id, safetensors_beside, weights_only
from streamnmt.training.runs import read_csv

KIND = "average"  # evals.csv's kind of the averaged row (an evaluation's row leaves it empty)


class Averager:
    """The weights of the last ``k`` evaluations, oldest first (``k`` 0: off). ``keep``: this rank
    holds the copies (rank 0); every rank records the steps, so that all decide alike."""

    def __init__(self, k: int, device: torch.device, keep: bool = True):
        self.k, self.keep = k, keep
        self.pinned = device.type == "cuda"
        self.steps: list[int] = []
        self.ring: list[dict[str, torch.Tensor]] = []  # parallel to steps where ``keep``
        self.last: tuple[int, float] | None = None  # the newest decided evaluation's (step, score)
        self.decided: dict[str, Any] | None = None  # the end of the run's choice: {step, line}
        self._copied: torch.cuda.Event | None = None

    @property
    def on(self) -> bool:
        return self.k > 0

    def add(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """The weights evaluated at ``step`` (the model's state dict as scored); the oldest of a
        full ring makes room (its buffers are reused)."""
        if not self.on:
            return
        reuse: dict[str, torch.Tensor] | None = None
        if self.steps and self.steps[-1] == step:  # the same step again: its copy is replaced
            self.steps.pop()
            reuse = self.ring.pop() if self.ring else None
        elif len(self.steps) >= self.k:
            self.steps.pop(0)
            reuse = self.ring.pop(0) if self.ring else None
        self.steps.append(step)
        if self.keep:
            self.ring.append(self._copy(state, reuse))

    def _copy(self, state: dict[str, torch.Tensor], reuse: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies of ``state`` (into ``reuse``'s buffers where they fit); a tensor shared by
        two keys (a tied embedding) is copied once and stays shared."""
        out: dict[str, torch.Tensor] = {}
        seen: dict[tuple, str] = {}
        used: set[int] = set()  # buffers taken (a reused slot's shared buffer serves one key)
        with torch.no_grad():
            for key, t in state.items():
                t = t.detach()
                ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                if t.numel() and ident in seen:
                    out[key] = out[seen[ident]]
                    continue
                buf = (reuse or {}).get(key)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or id(buf) in used:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
                buf.copy_(t, non_blocking=self.pinned)
                used.add(id(buf))
                seen[ident], out[key] = key, buf
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out

    def _landed(self) -> None:
        if self._copied is not None:
            # Needed: the host reads the copies (last.pt's staging, the mean); the evaluation's
            # validation already waited for them, so this returns at once.
            host_sync("average.copy", self._copied)
            self._copied = None

    def scored(self, step: int, value: float | None) -> None:
        """A decided evaluation's --best-metric value (the newest one is said at the end)."""
        if self.on and value is not None and math.isfinite(value):
            self.last = (step, float(value))

    def mean(self) -> dict[str, torch.Tensor]:
        """The element-wise mean of the kept copies (float64 sum, rounded once to each tensor's
        dtype); tensors that are not floating point are the newest copy's. Shared tensors stay shared."""
        if not self.ring:
            raise RuntimeError("no evaluated weights kept to average")
        self._landed()
        newest = self.ring[-1]
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for key, t in newest.items():
            if id(t) in done:
                out[key] = done[id(t)]
                continue
            if t.is_floating_point():
                total = torch.zeros(t.shape, dtype=torch.float64)
                for copy in self.ring:
                    total.add_(copy[key])
                m = total.div_(len(self.ring)).to(t.dtype)
            else:
                m = t.clone()
            done[id(t)] = out[key] = m
        return out

    def state_dict(self) -> dict[str, Any]:
        self._landed()
        return {"k": self.k, "steps": list(self.steps), "ring": list(self.ring) if self.keep else None,
                "last": list(self.last) if self.last else None, "decided": self.decided}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's averager (None, or a run's from before --average-last: an empty ring)."""
        if not state or not self.on:
            return
        steps, ring = list(state["steps"])[-self.k:], list(state.get("ring") or [])[-self.k:]
        if self.keep and len(ring) != len(steps):
            raise ValueError("the checkpoint's averaged weights do not match its evaluated steps")
        self.steps, self.ring = steps, [self._copy(copy, None) for copy in ring] if self.keep else []
        self.last = tuple(state["last"]) if state.get("last") else None  # type: ignore[assignment]
        self.decided = state.get("decided")

    def memory_mb(self, model: torch.nn.Module) -> float:
        """Host memory of a full ring (tied tensors once)."""
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
        return self.k * sum(seen.values()) / 2 ** 20

    def start_note(self, model: torch.nn.Module) -> str:
        if not self.on:
            return ""
        return (f"; at the end, the mean of the last {self.k} evaluated weights is scored too (--average-last; "
                f"{self.memory_mb(model):.0f} MiB of host memory, and as much in last.pt)")


def better(metric: str, value: float | None, than: float | None) -> bool:
    """``value`` strictly better than ``than`` by ``metric`` (BLEU: higher, val_loss: lower); a
    missing or non-finite value is never better, anything finite beats a missing one."""
    if value is None or not math.isfinite(value):
        return False
    if than is None:
        return True
    return value > than if metric == "bleu" else value < than


def choose(metric: str, average: float | None, best_single: float | None) -> str:
    """``average`` or ``single``: the mean wins only where it is strictly better; on a tie the best
    single evaluation's weights stay (they are on disk already, and are one model, not a mix)."""
    return "average" if better(metric, average, best_single) else "single"


def end_line(metric: str, winner: str, n: int, steps: list[int], average: float | None, cut: bool,
             best: float | None, best_step: int, ema: float | None, held: float | None = None) -> str:
    """The run's line on what best.pt holds, e.g. ``best.pt: average of the last 5 evaluations,
    steps 500-900 (dev BLEU 53.10; best single 52.70 at step 900; EMA 52.90)``."""
    name, fmt = ("dev BLEU", "{:.2f}") if metric == "bleu" else ("validation loss", "{:.4f}")

    def num(v: float | None) -> str:
        return "none" if v is None else fmt.format(v)

    window = f"the last {n} evaluations, steps {steps[0]}-{steps[-1]}"
    single = f"best single {num(best)} at step {best_step}" if best is not None else "best single none"
    avg = f"average of {window} {num(average)}" + (" (BLEU pass cut short, not compared)" if cut else "")
    extra = f"; EMA {num(ema)}" if ema is not None else ""
    if winner == "average":
        return f"best.pt: average of {window} ({name} {num(average)}; {single}{extra})"
    if held is not None:
        return f"best.pt: the model it held before this run resumed ({name} {num(held)}; {avg}; {single}{extra})"
    if best is None:
        return f"best.pt: none written (no evaluation scored; {avg}{extra})"
    return f"best.pt: the best single evaluation, step {best_step} ({name} {num(best)}; {avg}{extra})"


@contextlib.contextmanager
@torch.no_grad()
def loaded(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``weights`` in ``model`` for the body of the ``with`` (copied in place: captured graphs keep
    their addresses); the model's own weights after."""
    state = model.state_dict()
    backup = {k: v.detach().clone() for k, v in state.items()}
    for k, v in state.items():
        v.copy_(weights[k])
    try:
        yield
    finally:
        for k, v in state.items():
            v.copy_(backup[k])


def average_at_end(t: Any) -> bool:
    """The end of run ``t`` (a Trainer, after its last evaluation, before its last last.pt): score
    the mean of the last K evaluated weights, write best.pt with it where it wins, its evals.csv
    row and the line that names the winner. Returns whether it ran (last.pt must then record it).
    Not after a signal (the run's last evaluation does not run either: the resumed run ends it)."""
    ev = t.evaluator
    av: Averager = ev.averager
    if not av.on or t.signalled or not t.global_step:
        return False
    if av.decided is not None and av.decided["step"] == t.global_step:  # a resume of a run that had ended
        t.log(av.decided["line"])
        return False
    if len(av.steps) < 2:
        return False
    t._drain("average")
    te = t.clock()
    held_stats, STATS.sites = STATS.sites, {}  # the evaluation's host waits are not training's
    wall_s = t.run_wall_s()

    def stop() -> bool:  # as the run's evaluations: a time limit that the end would no longer fit
        return t.signalled or (t.budget.limit_s is not None and t.budget.expired(t._reserve(evaluation=False)))

    weights = None
    if t.dist.main:
        weights = av.mean()
        with loaded(ev.model, weights):
            t0 = time.perf_counter()
            val_loss = ev.validate()
            val_s = time.perf_counter() - t0
            bleu, bleu_s, bleu_n = ev.bleu(stop)
        asked = len(ev._pairs or ())  # the dev sentences a full BLEU pass scores
    else:
        val_loss, val_s, bleu, bleu_s, bleu_n, asked = math.nan, 0.0, None, 0.0, 0, 0
    val_loss, val_s, bleu, bleu_s, bleu_n, asked = t.dist.broadcast((val_loss, val_s, bleu, bleu_s, bleu_n, asked),
                                                                    "dist.average")
    stopper = ev.stopper
    metric = stopper.metric
    score = bleu if metric == "bleu" else val_loss
    cut = metric == "bleu" and bleu is not None and bleu_n < asked
    winner = "single" if cut else choose(metric, score, stopper.best)
    on_disk = t.best_on_disk  # a resume's best.pt may hold a better model than the run's evaluations
    held = on_disk if on_disk is not None and better(metric, on_disk, stopper.best) else None
    if winner == "average" and held is not None and not better(metric, score, held):
        winner = "single"
    save_s = 0.0
    if winner == "average":
        ts = t.clock()
        if t.dist.main:
            path = t.save_dir / "weights" / "best.pt"
            state = {**weights_only(t.checkpoint_state()), "model": weights, "step": t.global_step,
                     "best": {"metric": metric, "value": score, "step": t.global_step, "averaged": list(av.steps)},
                     "weights_id": new_weights_id()}
            t.checkpointer.save(path, state, kind="best", then=safetensors_beside(path))
        t.best_on_disk = score
        save_s = t.clock() - ts
    ema = av.last[1] if t.job.run.eval_ema and av.last is not None else None
    line = end_line(metric, winner, len(av.steps), av.steps, score, cut, stopper.best, stopper.best_step, ema,
                    held=held if winner == "single" else None)
    t.waits["stats"].append(STATS.reset())
    STATS.sites = held_stats
    cost = t.clock() - te - save_s
    t._account(evaluation=cost, checkpoints=save_s)
    if t.dist.main and not _logged(t.save_dir / "evals.csv", t.global_step):
        epoch = t.epoch if t.epoch and not t.epoch_pos else t.epoch + 1  # the epoch of the last step
        t.evals_log.write({"step": t.global_step, "epoch": epoch, "wall_s": "" if wall_s is None else round(wall_s, 1),
                           "val_loss": val_loss, "bleu": "" if bleu is None else round(bleu, 2),
                           "bleu_n": "" if bleu is None else bleu_n, "bleu_s": round(bleu_s, 3),
                           "val_s": round(val_s, 3), "best": int(winner == "average"), "eval_s": round(cost, 3),
                           "save_s": round(save_s, 3), "kind": KIND})
    av.decided = {"step": t.global_step, "line": line}
    t.log(line)
    return True


def _logged(path: Any, step: int) -> bool:
    """evals.csv already has the averaged row of ``step``: a run killed after writing it and before
    the last.pt that records the choice (a resume keeps rows up to its checkpoint's step)."""
    try:
        return any(r.get("kind") == KIND and r.get("step") == str(step) for r in read_csv(path))
    except OSError:
        return False
