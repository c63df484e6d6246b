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
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from streamnmt.engine import STATS
from streamnmt.syncstats import host_sync
from streamnmt.training.runs import read_csv
from streamnmt.training.stopping import is_better

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
        """A decided evaluation's --best-metric value (the newest one is said at the end; None: not
        comparable, e.g. a BLEU pass cut short, and nothing is said)."""
        if self.on:
            self.last = (step, float(value)) if value is not None and math.isfinite(value) else None

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


def choose(metric: str, average: float | None, best_single: float | None) -> str:
    """``average`` or ``single``: the mean wins only where it is strictly better; on a tie the best
    single evaluation's weights stay (they are on disk already, and are one model, not a mix)."""
    return "average" if is_better(metric, average, best_single) else "single"


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


@dataclasses.dataclass
class MeanScore:
    """The mean's evaluation, as an evals.csv row reads it (:meth:`RunMetrics.log_eval`)."""

    step: int
    val_loss: float
    bleu: float | None
    bleu_s: float
    bleu_n: int
    val_s: float
    better: bool = False  # the mean won: best.pt holds it


def decide(metric: str, score: float | None, cut: bool, best: float | None,
           on_disk: float | None) -> tuple[str, float | None]:
    """``average`` or ``single``, and the value of a best.pt on disk better than the run's best
    single evaluation (a resume's: it held a better model than last.pt knew of), or None: the mean
    must beat that too. A BLEU pass cut short is not compared."""
    winner = "single" if cut else choose(metric, score, best)
    held = on_disk if on_disk is not None and is_better(metric, on_disk, best) else None
    if winner == "average" and held is not None and not is_better(metric, score, held):
        winner = "single"
    return winner, held


def average_at_end(loop: Any) -> bool:
    """The end of the run of ``loop`` (the Trainer, after its last evaluation, before its last
    last.pt): score the mean of the last K evaluated weights, write best.pt with it where it wins
    (the checkpoints), its evals.csv row (the metrics) and the line that names the winner. Returns
    whether it ran (last.pt must then record it). Not after a signal (the run's last evaluation does
    not run either: the resumed run ends it)."""
    av: Averager = loop.evaluator.averager
    if not av.on or loop.signalled or not loop.global_step:
        return False
    if av.decided is not None and av.decided["step"] == loop.global_step:  # a resume of a run that had ended
        loop.log(av.decided["line"])
        return False
    if len(av.steps) < 2:
        stopper = loop.evaluator.stopper
        if av.steps and stopper.best is not None:  # one evaluation: the line still names what best.pt holds
            loop.log(f"best.pt: the best single evaluation, step {stopper.best_step} (--average-last {av.k}: "
                     f"one evaluation, nothing to average)")
        return False
    loop.drain("average")
    te = loop.clock()
    held_stats, STATS.sites = STATS.sites, {}  # the evaluation's host waits are not training's
    wall_s = loop.run.wall_s()
    weights, result, asked, signalled = _score_mean(loop, av)
    stopper = loop.evaluator.stopper
    metric = stopper.metric
    score = result.bleu if metric == "bleu" else result.val_loss
    cut = metric == "bleu" and result.bleu is not None and result.bleu_n < asked
    if cut and signalled:  # a signal cut the mean's pass: undecided, the resumed run scores it in full
        STATS.sites = held_stats
        return False
    winner, held = decide(metric, score, cut, stopper.best, loop.checkpoints.best_on_disk)
    save_s = 0.0
    if winner == "average":
        ts = loop.clock()
        loop.checkpoints.write_average(loop.record(), weights, score, av.steps)
        save_s = loop.clock() - ts
    result.better = winner == "average"
    ema = av.last[1] if loop.job.run.eval_ema and av.last is not None else None
    line = end_line(metric, winner, len(av.steps), av.steps, score, cut, stopper.best, stopper.best_step, ema,
                    held=held if winner == "single" else None)
    loop.metrics.waits["stats"].append(STATS.reset())
    STATS.sites = held_stats
    cost = loop.clock() - te - save_s
    loop.metrics.account(evaluation=cost, checkpoints=save_s)
    if loop.dist.main and not _logged(loop.save_dir / "evals.csv", loop.global_step):
        epoch = loop.epoch if loop.epoch and not loop.epoch_pos else loop.epoch + 1  # the epoch of the last step
        loop.metrics.log_eval(result, epoch, wall_s, cost, save_s, kind=KIND)
    av.decided = {"step": loop.global_step, "line": line}
    loop.log(line)
    return True


def _score_mean(loop: Any, av: Averager) -> tuple[dict[str, torch.Tensor] | None, MeanScore, int]:
    """The mean of the kept weights (rank 0's; None elsewhere), validated and scored on dev with the
    loop's stop rule as the run's evaluations are; every rank learns the scores and the dev
    sentences a full BLEU pass scores, and whether rank 0 had a signal by the pass's end (it cuts the pass)."""
    ev, weights = loop.evaluator, None
    got: tuple[Any, ...] = (math.nan, 0.0, None, 0.0, 0, 0, False)
    if loop.dist.main:
        weights = av.mean()
        with loaded(ev.model, weights):
            got = (*ev.score(loop.evaluations.bleu_stop(loop)), bool(loop.signalled))
    val_loss, val_s, bleu, bleu_s, bleu_n, asked, signalled = loop.dist.broadcast(got, "dist.average")
    return weights, MeanScore(loop.global_step, val_loss, bleu, bleu_s, bleu_n, val_s), asked, signalled


def _logged(path: Any, step: int) -> bool:
    """evals.csv already has the averaged row of ``step``: a run killed after writing it and before
    the last.pt that records the choice (a resume keeps rows up to its checkpoint's step)."""
    try:
        return any(r.get("kind") == KIND and r.get("step") == str(step) for r in read_csv(path))
    except OSError:
        return False
