"""Evaluations on the training loop: when one runs, on the loop or with its BLEU pass beside
training, its collection, best.pt's choice and --patience's stop request, the loop's waits for it
and its evals.csv row; and the evaluation record a checkpoint keeps.

The evaluation itself (validation, BLEU, the early-stopping state, the cadence) is
:class:`streamnmt.training.evaluator.Evaluator`'s. With ``--async-eval`` the BLEU pass runs on a
thread beside training (:mod:`streamnmt.training.async_bleu`): :meth:`LoopEvaluation.evaluate`
starts it and :meth:`LoopEvaluation.collect` finishes the evaluation at a later step. ``loop``, the
argument of each call, is the :class:`streamnmt.training.trainer.Trainer`: its step, signal flag,
clock, drain, reserve, log, stop request, metrics, checkpoints and run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from streamnmt.engine import STATS
from streamnmt.engine.losses import StepLoss
from streamnmt.training.evaluator import Evaluation


class LoopEvaluation:
    """The loop's evaluations (see the module's docstring); ``run``: the run's parts."""

    def __init__(self, run: Any):
        # the parts it reads, not the Run that holds this part: no reference cycle keeps the run alive
        self.evaluator, self.train_step, self.device, self.budget = run.evaluator, run.train_step, run.device, run.budget
        self.eval_ema = run.job.run.eval_ema
        self.last_eval: Evaluation | None = None
        self.launched: dict[str, Any] | None = None  # the evaluation whose BLEU pass runs beside training
        self.decided_eval_step = -1  # the last evaluation whose results are in (last.pt keeps it)
        self.last_eval_step = -1
        self.last_bleu_s = 0.0  # the newest finished BLEU pass's seconds (paces one beside training)
        # an evaluation a signal kept from running at its step ({step, epoch, beside}): a resume runs it first
        self.eval_due: dict[str, Any] | None = None

    def last_eval_at(self, step: int) -> Evaluation | None:
        """The newest evaluation if it evaluated ``step`` (whole: its BLEU pass decided)."""
        return self.last_eval if self.last_eval_step == step == self.decided_eval_step else None

    def evaluate(self, loop: Any, epoch: int, beside: bool = True) -> list[StepLoss]:
        """Drain, then validation loss and BLEU (with the EMA weights under --eval-ema); best.pt when
        --best-metric improved; a stop request when --patience ran out. With --async-eval and
        ``beside`` (not at the run's end), after the first evaluation: validation now, the BLEU pass
        beside training (:meth:`collect` decides later). Returns the drained losses."""
        ev, step = self.evaluator, loop.global_step
        if ev.pending is not None:  # the last pass is decided now (it may still run: wait for it)
            self.collect(loop, wait=True)
            if loop.signalled:  # before or while it was collected: the run stops after this step;
                ev.interrupt()  # last.pt records that pass undecided and this evaluation as due,
                self.eval_due = {"step": step, "epoch": epoch, "beside": beside}
                return []       # and the resumed run does both first, as this run would have now
        te = loop.clock()
        losses = loop.drain("eval")
        wall_s = loop.run.wall_s()  # when the run reached the evaluated weights (the drain: the GPU too)
        held, STATS.sites = STATS.sites, {}  # the evaluation's host waits are not training's
        ema = self.train_step.ema if self.eval_ema else None
        stop = self.bleu_stop(loop)
        if beside and ev.beside and ev.passes:
            result = ev.launch(step, ema, stop)
            first = self.launched is None
            self._launched(loop, result, epoch, wall_s, te, held)
            # Its cost is known when it is collected, at the next evaluation: until then the cadence
            # counts the validation just run and the last pass's BLEU seconds, not the cost of an
            # evaluation before (the first one holds its graphs' captures).
            ev.cadence.started(estimate_s=self.launched["eval_s"] + self.last_bleu_s)
            if first and ev.passes == 1:
                loop.log("eval: from now on the BLEU passes run beside training; an epoch line shows the newest "
                         "finished one (evals.csv: the step it evaluated)")
            return losses
        self._on_loop(loop, epoch, ema, stop, te, wall_s, held)
        return losses

    def _launched(self, loop: Any, result: Evaluation, epoch: int, wall_s: float | None, te: float,
                  held: dict) -> None:
        """An evaluation whose BLEU pass runs beside training, or was cut by a signal: decided later."""
        metrics = loop.metrics
        metrics.waits["stats"].append(STATS.reset())
        STATS.sites = held
        cost = loop.clock() - te
        metrics.account(evaluation=cost)
        self.launched = {"step": loop.global_step, "epoch": epoch + 1, "wall_s": wall_s, "eval_s": cost}
        self.last_eval, self.last_eval_step = result, loop.global_step

    def _on_loop(self, loop: Any, epoch: int, ema: Any, stop: Callable[[], bool], te: float,
                 wall_s: float | None, held: dict) -> None:
        """An evaluation decided on the loop: best.pt when better, its row, --patience."""
        ev, device, metrics, step = self.evaluator, self.device, loop.metrics, loop.global_step
        first = self.last_eval is None and device.type == "cuda"
        before = torch.cuda.memory_reserved(device) if first else 0  # host-side counters: no sync
        best_s: list[float] = []
        result = ev.evaluate(step, ema, on_better=lambda: best_s.append(self.write_best(loop)), stop=stop,
                             interrupted=lambda: loop.signalled)
        if result.deferred:  # a signal cut the BLEU pass: undecided, last.pt records it (see Evaluator.record)
            self._launched(loop, result, epoch, wall_s, te, held)
            return
        if first:  # what the evaluation's graphs (validation, decoding buckets) hold for the rest of the run
            grown = (torch.cuda.memory_reserved(device) - before) / 2 ** 20
            took = loop.clock() - te
            loop.log(f"eval: the first evaluation took {took:.1f} s (validation {result.val_s:.1f} s, BLEU "
                     f"{result.bleu_s:.1f} s, captures included; the rest {took - result.val_s - result.bleu_s:.1f} s); "
                     f"its graphs and buffers reserved {grown:+.0f} MiB on the GPU")
        metrics.waits["stats"].append(STATS.reset())
        STATS.sites = held
        cost = loop.clock() - te - sum(best_s)
        ev.cadence.done(cost)
        self.last_bleu_s = result.bleu_s
        metrics.account(evaluation=cost, checkpoints=sum(best_s))
        self.last_eval, self.last_eval_step = result, step
        self.decided_eval_step = step
        self._decided(loop, result, epoch + 1, wall_s, cost, sum(best_s))

    def bleu_stop(self, loop: Any) -> Callable[[], bool]:
        """The loop's rule that cuts a BLEU pass short: a signal (a grace period is short), and under
        --time-limit where the run's end (the pass's best.pt, the last write, the exports) would no
        longer fit: a half-trained model can decode several times longer than the last evaluation
        did, which the reserve had counted on."""
        budget = self.budget

        def stop() -> bool:
            if loop.signalled:
                return True
            # the end after the pass: its best.pt (if better), then last.pt and the rest
            after = sum(loop.reserve(evaluation=False).values()) + loop.checkpointer.write_s.get("best", 0.0)
            return budget.limit_s is not None and budget.expired(after)
        return stop

    def collect(self, loop: Any, wait: bool = False) -> bool:
        """A BLEU pass beside training that has ended (``wait``: wait for it): best.pt from the
        evaluated step's weights, --patience, its evals.csv row. Returns whether one was collected."""
        tc = loop.clock()
        best_s: list[float] = []
        launched, metrics = self.launched, loop.metrics
        got = self.evaluator.collect(lambda weights: best_s.append(self.write_best(loop, weights, launched["step"])),
                                     wait=wait, interrupted=lambda: loop.signalled,
                                     stop=self.bleu_stop(loop)) if launched else None
        if got is None:
            return False
        result, stats = got
        waited = loop.clock() - tc - sum(best_s)
        metrics.account(evaluation=waited, checkpoints=sum(best_s))
        metrics.waits["stats"].append(stats)
        self.evaluator.cadence.done(launched["eval_s"] + result.bleu_s, restart=False)
        self.last_bleu_s = result.bleu_s
        metrics.fresh_bleu = result.bleu
        self._decided(loop, result, launched["epoch"], launched["wall_s"], launched["eval_s"] + waited, sum(best_s))
        self.launched = None
        self.decided_eval_step = result.step
        return True

    def write_best(self, loop: Any, weights: dict[str, torch.Tensor] | None = None, step: int | None = None) -> float:
        """best.pt (the model's weights, or ``weights`` of ``step``) unless the one on disk is better;
        returns the seconds the loop waited."""
        return loop.checkpoints.write_best(loop.record(), weights, step, clock=loop.clock)

    def _decided(self, loop: Any, result: Any, epoch: int, wall_s: float | None, eval_s: float,
                 save_s: float) -> None:
        """An evaluation's evals.csv row and scalars; its --patience stop request."""
        loop.metrics.log_eval(result, epoch, wall_s, eval_s, save_s)
        if self.evaluator.stopper.should_stop:
            loop.request_stop(self.evaluator.stopper.reason())

    def resume(self, loop: Any) -> None:
        """A resumed run first does what a signal kept the interrupted one from doing at the
        checkpoint's step: decide an evaluation whose pass was on the loop, run an evaluation that
        was due (it decides a pass beside training first), and stop where --patience ran out."""
        due, self.eval_due = self.eval_due, None
        if due is not None and due["step"] == loop.global_step:
            self.evaluate(loop, due["epoch"], beside=due["beside"])
        elif self.evaluator.pending is not None and (not self.evaluator.beside or self.evaluator.pending_on_loop):
            self.collect(loop, wait=True)
        # a run --patience stopped ends again at once (a scheduler that resubmits with --resume
        # would otherwise train it on to the next evaluation each time)
        if self.evaluator.stopper.should_stop and not loop.stop_requested:
            loop.request_stop(self.evaluator.stopper.reason())

    # -- the record a checkpoint keeps --------------------------------------------------------
    def record(self, step: int) -> dict[str, Any]:
        """What last.pt keeps of the evaluations at ``step``: the last one evaluated, one undecided
        (its pass is decoded again on resume) and one a signal kept from running."""
        pending = self.evaluator.record()
        if pending is not None and self.launched is not None:
            pending.update({k: self.launched[k] for k in ("epoch", "wall_s", "eval_s")})
        return {"last_eval_step": self.last_eval_step if pending else self.decided_eval_step,
                "pending_eval": pending,
                "eval_due": self.eval_due if self.eval_due and self.eval_due["step"] == step else None}

    def restore(self, ckpt: dict[str, Any]) -> None:
        """The record of a checkpoint: a checkpoint of a step that was not evaluated (a signal,
        --save-every) gets its evaluation; an undecided one is decided again where it would have."""
        self.last_eval_step = ckpt.get("last_eval_step", ckpt["step"])
        self.decided_eval_step = self.last_eval_step
        self.eval_due = ckpt.get("eval_due")
        pending = ckpt.get("pending_eval")
        if pending:
            self.evaluator.restore(pending)
            self.launched = {"step": pending["step"], **{k: pending.get(k) for k in ("epoch", "wall_s", "eval_s")}}
            self.launched["eval_s"] = self.launched["eval_s"] or 0.0
