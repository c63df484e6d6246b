"""The training loop's evaluation points: an evaluation on the loop or beside it, its collection,
best.pt, the accounting of the loop's waits and the evals.csv row.

Mixed into :class:`streamnmt.training.trainer.Trainer` (it reads the loop's state: the evaluator,
checkpointer, clocks and logs that :class:`streamnmt.training.build.TrainerSetup` builds), so that
the loop itself reads top to bottom in trainer.py. With ``--async-eval`` the BLEU pass of an
evaluation runs on a thread beside training (:mod:`streamnmt.training.async_bleu`): :meth:`_evaluate`
starts it and :meth:`_collect_eval` finishes the evaluation at a later step.
"""

from __future__ import annotations

from typing import Any

import torch

from streamnmt.engine import STATS
from streamnmt.engine.losses import StepLoss


class EvaluationPoints:
    """The Trainer's evaluation methods (see the module's docstring)."""

    def _evaluate(self, epoch: int, beside: bool = True) -> list[StepLoss]:
        """Drain, then validation loss and BLEU (with the EMA weights under --eval-ema); best.pt when
        --best-metric improved; a stop request when --patience ran out. With --async-eval and
        ``beside`` (not at the run's end), after the first evaluation: validation now, the BLEU pass
        beside training (:meth:`_collect_eval` decides later). Returns the drained losses."""
        ev = self.evaluator
        if ev.pending is not None:  # the last pass is decided now (it may still run: wait for it)
            self._collect_eval(wait=True)
            if self.signalled:  # before or while it was collected: the run stops after this step;
                ev.interrupt()  # last.pt records that pass undecided and this evaluation as due,
                self.eval_due = {"step": self.global_step, "epoch": epoch, "beside": beside}
                return []       # and the resumed run does both first, as this run would have now
        te = self.clock()
        losses = self._drain("eval")
        wall_s = self.run_wall_s()  # when the run reached the evaluated weights (the drain: the GPU too)
        held, STATS.sites = STATS.sites, {}  # the evaluation's host waits are not training's
        ema = self.step_fn.ema if self.job.run.eval_ema else None
        stop = self._bleu_stop

        if beside and ev.beside and ev.passes:
            result = ev.launch(self.global_step, ema, stop)
            self.waits["stats"].append(STATS.reset())
            STATS.sites = held
            cost = self.clock() - te
            ev.cadence.started()
            self._account(evaluation=cost)
            if self.launched is None and ev.passes == 1:
                self.log("eval: from now on the BLEU passes run beside training; an epoch line shows the newest "
                         "finished one (evals.csv: the step it evaluated)")
            self.launched = {"step": self.global_step, "epoch": epoch + 1, "wall_s": wall_s, "eval_s": cost}
            self.last_eval, self.last_eval_step = result, self.global_step
            return losses
        first = self.last_eval is None and self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if first else 0  # host-side counters: no sync
        best_s: list[float] = []
        result = ev.evaluate(self.global_step, ema, on_better=lambda: best_s.append(self._write_best()), stop=stop,
                             interrupted=lambda: self.signalled)
        if result.deferred:  # a signal cut the BLEU pass: undecided, last.pt records it (see Evaluator.record)
            self.waits["stats"].append(STATS.reset())
            STATS.sites = held
            cost = self.clock() - te
            self._account(evaluation=cost)
            self.launched = {"step": self.global_step, "epoch": epoch + 1, "wall_s": wall_s, "eval_s": cost}
            self.last_eval, self.last_eval_step = result, self.global_step
            return losses
        if first:  # what the evaluation's graphs (validation, decoding buckets) hold for the rest of the run
            grown = (torch.cuda.memory_reserved(self.device) - before) / 2 ** 20
            took = self.clock() - te
            self.log(f"eval: the first evaluation took {took:.1f} s (validation {result.val_s:.1f} s, BLEU "
                     f"{result.bleu_s:.1f} s, captures included; the rest {took - result.val_s - result.bleu_s:.1f} s); "
                     f"its graphs and buffers reserved {grown:+.0f} MiB on the GPU")
        self.waits["stats"].append(STATS.reset())
        STATS.sites = held
        cost = self.clock() - te - sum(best_s)
        ev.cadence.done(cost)
        self._account(evaluation=cost, checkpoints=sum(best_s))
        self.last_eval, self.last_eval_step = result, self.global_step
        self.decided_eval_step = self.global_step
        self._log_eval(result, epoch + 1, wall_s, cost, sum(best_s))
        return losses

    def _bleu_stop(self) -> bool:
        """A BLEU pass stops decoding on a signal (a grace period is short), and under --time-limit
        where the run's end (its last write and exports) would no longer fit: a half-trained model
        can decode several times longer than the last evaluation did, which the reserve had counted on."""
        return self.signalled or (self.budget.limit_s is not None
                                  and self.budget.expired(self._reserve(evaluation=False)))

    def _collect_eval(self, wait: bool = False) -> bool:
        """A BLEU pass beside training that has ended (``wait``: wait for it): best.pt from the
        evaluated step's weights, --patience, its evals.csv row. Returns whether one was collected."""
        tc = self.clock()
        best_s: list[float] = []
        launched = self.launched
        got = self.evaluator.collect(lambda weights: best_s.append(self._write_best(weights, launched["step"])),
                                     wait=wait, interrupted=lambda: self.signalled,
                                     stop=self._bleu_stop) if launched else None
        if got is None:
            return False
        result, stats = got
        waited = self.clock() - tc - sum(best_s)
        self._account(evaluation=waited, checkpoints=sum(best_s))
        self.waits["stats"].append(stats)
        self.evaluator.cadence.done(launched["eval_s"] + result.bleu_s, restart=False)
        self.fresh_bleu = result.bleu
        self._log_eval(result, launched["epoch"], launched["wall_s"], launched["eval_s"] + waited, sum(best_s))
        self.launched = None
        self.decided_eval_step = result.step
        return True

    def _account(self, evaluation: float = 0.0, checkpoints: float = 0.0) -> None:
        """Seconds the loop waited for an evaluation and for checkpoint writes."""
        self.waits["eval_s"] += evaluation
        self.waits["save_s"] += checkpoints
        self.times["evaluation"] += evaluation
        self.times["checkpoints"] += checkpoints

    def _write_best(self, weights: dict[str, torch.Tensor] | None = None, step: int | None = None) -> float:
        """best.pt (the model's weights, or ``weights`` of ``step``) unless the one on disk is better;
        returns the seconds the loop waited."""
        value, metric = self.evaluator.stopper.best, self.evaluator.stopper.metric
        on_disk = self.best_on_disk  # a resume's best.pt may hold a better model than last.pt knew of
        if on_disk is not None and value is not None and not (value > on_disk if metric == "bleu" else value < on_disk):
            return 0.0
        ts = self.clock()
        self._save("best.pt", kind="best", weights=weights, step=step)
        self.best_on_disk = value
        return self.clock() - ts

    def _log_eval(self, result: Any, epoch: int, wall_s: float | None, eval_s: float, save_s: float) -> None:
        """An evaluation's evals.csv row and scalars; its --patience stop request."""
        self.evals_log.write({"step": result.step, "epoch": epoch,
                              "wall_s": "" if wall_s is None else round(wall_s, 1),
                              "val_loss": result.val_loss,
                              "bleu": "" if result.bleu is None else round(result.bleu, 2),
                              "bleu_n": "" if result.bleu is None else result.bleu_n,
                              "bleu_s": round(result.bleu_s, 3), "val_s": round(result.val_s, 3),
                              "best": int(result.better),
                              "eval_s": round(eval_s, 3), "save_s": round(save_s, 3)})
        self.scalars.add(result.step, {"dev/val_loss": result.val_loss, "dev/bleu": result.bleu})
        if self.evaluator.stopper.should_stop:
            self._request_stop(self.evaluator.stopper.reason())
