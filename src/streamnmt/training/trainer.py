"""Training: the loop that runs epochs through the stream engine.

The engine (``streamnmt.engine``) knows nothing of translation; it drives the step function of
``streamnmt.training.step`` (loss, backward, clipped Adam on the Noam schedule, without a host
sync). The parts around the loop are built by :class:`streamnmt.training.build.TrainerSetup`;
the Trainer runs the loop and calls them at named points: the evaluator (validation, BLEU,
best.pt, patience, when to evaluate; the loop's side in :mod:`streamnmt.training.evaluating`), the
checkpointer (background writes), the time budget. The
loop reads top to bottom in :meth:`Trainer.run_epoch`; the end of a run, however it ends, in
:meth:`Trainer._finish`. Every second of the wall clock is accounted to training, evaluation,
checkpoints, set-up or the rest, and said in the run's last line. On several processes
(torchrun; ``streamnmt.dist``) every rank runs this Trainer on its share of each global step;
rank 0 alone writes the run directory.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch

from streamnmt.checkpoint import rng_state
from streamnmt.engine import STATS
from streamnmt.engine.losses import StepLoss
from streamnmt.syncstats import format_table
from streamnmt.errors import NonFiniteLoss
from streamnmt.training.averaging import average_at_end
from streamnmt.training.checkpointer import new_weights_id, safetensors_beside, weights_only
from streamnmt.training.evaluating import EvaluationPoints
from streamnmt.training.monitor import CpuSampler, NvmlSampler
from streamnmt.training.plots import plot_results
from streamnmt.training.reporting import epoch_line, merge_sync_stats, progress, time_line
from streamnmt.training.runs import write_json
from streamnmt.training.build import TrainerSetup
from streamnmt.training.step import noam_lr
from streamnmt.training.stopping import stop_signals

END_SHARE = 0.02  # of --time-limit, kept for the run's end (exports, plots), at most 5 s


class Trainer(EvaluationPoints, TrainerSetup):
    """Trains: epochs of steps through the engine's strategy, evaluations and checkpoints when due,
    and the end of the run. What it trains is built by :class:`TrainerSetup` from a :class:`TrainJob`;
    ``resume``, a loaded checkpoint, continues a run exactly (see there)."""

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """The run; however it ends, every background write and BLEU pass is waited for or, where
        the run stops before deciding a pass, recorded in last.pt (:meth:`_abandon` for an error)."""
        try:
            return self._train()
        except BaseException as e:
            self._abandon(e)
            raise

    def _abandon(self, error: BaseException) -> None:
        """train() raised (an error, a lost peer, a second Ctrl-C): a pass beside training stops
        and the scoring workers exit; the write in flight lands, so that the run leaves whole files
        and its error line names a checkpoint that exists (only a kill leaves a write unfinished: its
        temporary file goes at the next start)."""
        with contextlib.suppress(Exception):
            self.evaluator.abort()
        try:
            self.checkpointer.close()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
            self.log(f"warning: the checkpoint write in flight failed as well ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200] if str(e) else ''}); the files before it are whole")
        for log in (self.steps_log, self.results_log, self.evals_log, self.scalars):
            with contextlib.suppress(Exception):
                log.close()
        if isinstance(error, NonFiniteLoss):
            error.args = (f"{error}; {self._last_good()}",)

    def _last_good(self) -> str:
        """The checkpoint a failed run leaves to go on from, as it is on disk now."""
        last = self.save_dir / "weights" / "last.pt"
        try:
            step = torch.load(last, map_location="cpu", weights_only=True, mmap=True)["step"]
        except Exception:  # noqa: BLE001 - absent, or not whole: not one to name
            return "no checkpoint was written (weights/last.pt does not exist)"
        return f"the last good checkpoint is {last} (step {step})"

    def _train(self) -> dict[str, Any]:
        r = self.job.run
        row: dict[str, Any] = {}
        self.times["set-up"] = time.monotonic() - self.t_command  # from the command's start to the first step
        loop_start = self.clock()
        with stop_signals(self):
            self._resume_evaluations()
            self.log(f"{'Epoch':>7}{'GPU_mem':>9}{'batches':>9}{'tokens/s':>10}{'train_loss':>12}"
                     f"{'train_nll':>11}{'ppl':>9}{'val_loss':>10}{'BLEU':>7}{'time':>8}")
            while self.epoch < r.epochs and not self._done():
                row = self.run_epoch(self.epoch) or row
            self._finish()
            loop_s = self.clock() - loop_start
            self.times["training"] = loop_s - self.times["evaluation"] - self.times["checkpoints"]
            end_start = self.clock()
            write_s = self._close_logs()  # inside: a SIGTERM meanwhile is caught as in the loop
        result = {"save_dir": self.save_dir, "best_val": self.best_val, "steps": self.global_step, "last": row,
                  "stopped": self.stopped, "times": self.times}
        if not self.dist.main:
            return result
        te = self.clock()
        self._export_ema()
        ema_s = self.clock() - te
        self.times["checkpoints"] += ema_s
        if self.stopped:
            reason = self.stop_reason(self.global_step) if callable(self.stop_reason) else self.stop_reason
            if not reason:
                reason = (f"stopped by signal after step {self.global_step}" if self.signalled else
                          f"stopped after step {self.global_step}: another rank asked to (its time limit)")
            self.log(f"{reason}; "
                     f"saved {self.save_dir / 'weights' / 'last.pt'}")
        self.times["other"] = self.clock() - end_start - write_s - ema_s  # the sync table, logs closed, plots
        result["wall_s"] = time.monotonic() - self.t_command
        self.log(time_line(self.times, result["wall_s"]))
        return result

    def _resume_evaluations(self) -> None:
        """A resumed run first does what a signal kept the interrupted one from doing at the
        checkpoint's step: decide an evaluation whose pass was on the loop, run an evaluation that
        was due (it decides a pass beside training first), and stop where --patience ran out."""
        due, self.eval_due = self.eval_due, None
        if due is not None and due["step"] == self.global_step:
            self._evaluate(due["epoch"], beside=due["beside"])
        elif self.evaluator.pending is not None and (not self.evaluator.beside or self.evaluator.pending_on_loop):
            self._collect_eval(wait=True)
        else:
            return
        if self.evaluator.stopper.should_stop and not self.stop_requested:
            self._request_stop(self.evaluator.stopper.reason())

    def _close_logs(self) -> float:
        """The sync table, the logs closed and the plots drawn while the last last.pt is written;
        then the wait for that write (returned, in seconds), so it ends before the run says it saved."""
        try:
            if self.sync_stats:  # the whole run's host waits once, instead of a table per epoch
                self.log(f"training host syncs over {len(self.sync_stats)} epoch(s):\n"
                         + format_table(merge_sync_stats([e["train"] for e in self.sync_stats])))
            for log in (self.steps_log, self.results_log, self.evals_log, self.scalars):
                log.close()
            if self.dist.main and (self.save_dir / "steps.csv").stat().st_size > 0 and self.global_step > 0:
                plot_results(self.save_dir)
        finally:
            te = self.clock()
            self.checkpointer.close()
            write_s = self.clock() - te
            self.times["checkpoints"] += write_s
        return write_s

    def _done(self) -> bool:
        r = self.job.run
        self._check_budget()  # e.g. after an evaluation
        return self._stop_agreed() or bool(r.max_steps and self.global_step >= r.max_steps)

    def _check_budget(self) -> None:
        """Ask to stop once --time-limit leaves only what the end of the run needs (_reserve)."""
        if not self.stop_requested and self.budget.expired(self._reserve()):
            self._request_stop(self.budget.reason)

    def _reserve(self, evaluation: bool = True) -> float:
        """Seconds the end of the run will take after the last step: its evaluation (unless not
        ``evaluation``) and the best.pt it may write, its last.pt write and with ``--ema`` its
        ema.pt (each as long as the last one of its kind took, ema.pt as best.pt; a write still in
        flight counts once more) and the exports and plots (a small share)."""
        w = self.checkpointer.write_s
        cost = self.evaluator.cadence.cost_s or 0.0
        ev = cost + w.get("best", 0.0) if evaluation else 0.0
        # a pass beside training: the end waits for it (not counted where the pass itself asks)
        ev += cost if evaluation and self.evaluator.running else 0.0
        # --average-last: the end scores the mean of the last evaluated weights too, and may write best.pt
        ev += cost + w.get("best", 0.0) if evaluation and self.evaluator.averager.on else 0.0
        writes = w.get("last", 0.0) + (max(w.values(), default=0.0) if self.checkpointer.busy else 0.0)
        if self.step_fn.ema is not None and self.dist.main:  # weights/ema.pt, written after the last.pt
            writes += w.get("ema") or w.get("best") or w.get("last", 0.0)  # weights only, as best.pt
        # several ranks agree to stop every --sync-interval steps: up to that many more steps run
        agreeing = (self.job.engine.sync_interval - 1) * self._loop_s / max(self._loop_steps, 1) \
            if self.dist.active else 0.0
        return ev + writes + agreeing + min(END_SHARE * (self.budget.limit_s or 0.0), 5.0)

    def _stop_agreed(self) -> bool:
        """Between epochs: stop now? One process: a signal, --time-limit or --patience asked for it.
        Several: the ranks agree (one host-side all-reduce) on the long control group, since rank 0
        may still be busy alone (an epoch end's evaluation and checkpoint wait). In the loop the
        agreement is :meth:`_after_step`'s."""
        if not self.dist.active:
            self.stopped = self.stop_requested
        else:
            self.stopped = self.dist.agree(self.stop_requested, long_wait=True)
        return self.stopped

    def run_epoch(self, epoch: int) -> dict[str, Any]:
        r = self.job.run
        if 0 < len(self.train_loader) <= self.epoch_pos:  # resumed at the epoch's end (a checkpoint
            self.epoch, self.epoch_pos = epoch + 1, 0       # of an earlier version): nothing left to train
            return {}
        self.model.train()
        self.train_loader.set_epoch(epoch)  # keeps a resumed mid-epoch position
        STATS.reset()
        nvml = NvmlSampler(self.device).start()  # GPU utilisation sampled in a thread; no device sync
        cpu = CpuSampler().start()  # CPU time of this process and its loader workers
        t0 = self.clock()
        self.waits = {"eval_s": 0.0, "save_s": 0.0, "stats": []}  # what the loop waited for this epoch
        tokens, padded, losses = 0, 0, []
        n_batches = len(self.train_loader) - self.epoch_pos  # micro-batches: --accum-steps per step
        if r.max_steps:
            n_batches = min(n_batches, (r.max_steps - self.global_step) * self.job.engine.accum_steps)
        end_pos = self.epoch_pos + n_batches  # where this epoch's part of the run ends (its own evaluation)
        bar = progress(n_batches, f"epoch {epoch + 1}" + (f"/{r.epochs}" if r.epochs < 1_000_000 else ""),
                       quiet=not self.dist.main)
        mark = self.clock()
        for info in self.strategy.run(itertools.islice(self.train_loader, n_batches), self.step_fn, self.losses,
                                      start_step=self.global_step):
            # 1. bookkeeping on the host only: no device value is read here
            self.epoch_pos += 1
            padded += info.batch.tgt_out.numel() * self.dist.world  # a shape: no device access
            bar.update(1)
            if not info.ends_step:  # an accumulation micro-batch: the step goes on
                continue
            self.global_step = info.step
            ntok = info.batch.norm_tokens or info.batch.ntokens  # real target tokens of the global step (all ranks)
            tokens += ntok
            self.pending_rows[info.step] = {"step": info.step, "epoch": epoch + 1, "tokens": ntok,
                                            "lr": noam_lr(info.step, self.shape.d_model, self.job.optim.warmup,
                                                          self.job.optim.lr)}
            # 2. losses whose copies to the host have completed (never blocks)
            losses += self._write_steps(self.losses.poll())
            if self.last_loss is not None:
                bar.set_postfix_str(f"loss {self.last_loss:.4f} (as of last extraction)", refresh=False)
            now = self.clock()
            self._trained(now - mark)
            # (a BLEU pass beside training is decided at the next evaluation or the end of the run,
            # not when it ends: a step that does not depend on its speed, so a resume replays it)
            # 3. the time budget; then whether to stop and whether to evaluate (host flags; several
            # ranks: one agreement); evaluation before a save of the same step, so that the
            # checkpoint holds its early-stopping state; mid-epoch checkpoint; kill test hook
            self._check_budget()
            due = self._after_step()
            if self.stopped:  # the end of the run (_finish) evaluates and saves this step
                break
            if due and self.epoch_pos < end_pos:  # the epoch's end has its own
                losses += self._evaluate(epoch)
                # --patience, or the time the evaluation took: stop after this step (every rank
                # evaluated here, so every rank takes part in this agreement)
                self._check_budget()
                self.stopped = self.dist.agree(self.stop_requested) if self.dist.active else self.stop_requested
            if r.save_every and self.global_step % r.save_every == 0:
                losses += self._save_mid_epoch("save", keep=r.keep_last)
            if self.global_step == int(os.environ.get("STREAMNMT_TEST_KILL_AT_STEP", "0")):
                # a crash after the checkpoints written so far: those in flight land first, so the
                # tests' resume point does not hang on a loaded machine's write speed
                self.checkpointer.wait()
                if self.dist.active:
                    self.dist.kill_launcher()
                os.kill(os.getpid(), signal.SIGKILL)
            mark = self.clock()
            if self.stopped:
                break
        if self.stopped:  # the end of the run (_finish) drains, evaluates and saves where we are
            self.pending_losses = losses
            bar.close()
            nvml.stop()
            cpu.stop()
            return {}
        # 4. epoch end: drain the streams and the remaining losses
        # Needed: the epoch's time and every loss must be final before they are reported.
        self.strategy.drain("epoch.drain")
        losses += self._write_steps(self.losses.flush("epoch.losses"))
        bar.close()
        self._trained(self.clock() - mark)
        epoch_s = self.clock() - t0 - self.waits["eval_s"] - self.waits["save_s"]
        gpu_busy = nvml.stop().get("util_mean_pct")
        cpu_util = cpu.stop()["util_pct"]  # % of one core, loader workers included
        train_stats = STATS.reset()
        # 5. validation loss and BLEU when due, or at the run's last epoch end (timed apart from training)
        cut = bool(r.max_steps) and self.global_step >= r.max_steps and self.epoch_pos < len(self.train_loader)
        if not cut:  # --max-steps ended the run mid-epoch: a resume with a larger one goes on from here
            self.epoch, self.epoch_pos = epoch + 1, 0
        ending = self.epoch >= r.epochs or bool(r.max_steps and self.global_step >= r.max_steps)
        result = None
        if self.last_eval_step != self.global_step and (ending or self.evaluator.cadence.due_at_epoch_end(self.global_step, self.dist)):
            self._evaluate(epoch, beside=not ending)
            result = self.last_eval
        finite = [v for v in losses if math.isfinite(v[1])]  # a skipped step's loss is left out
        train_loss = sum(v[1] for v in finite) / max(len(finite), 1)
        train_nll = sum(v.values["nll"] for v in finite) / max(len(finite), 1)
        # 6. checkpoint: the next epoch starts from its first batch (when due: see _save_due)
        if ending or self._save_due():
            self._save_last()  # the end of the run waits for it (Trainer._close_logs)
        row = {"epoch": epoch + 1, "train_loss": train_loss, "train_nll": train_nll,
               "train_ppl": math.exp(min(train_nll, 700.0)), "val_loss": "" if result is None else result.val_loss,
               "bleu": "" if result is None or result.bleu is None else round(result.bleu, 2),
               "tokens_per_s": tokens / epoch_s, "padded_tokens_per_s": padded / epoch_s,
               "epoch_s": round(epoch_s, 3), "bleu_s": "" if result is None else round(result.bleu_s, 3),
               "eval_s": round(self.waits["eval_s"], 3), "save_s": round(self.waits["save_s"], 3),
               "gpu_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9 if self.device.type == "cuda" else 0.0,
               "gpu_busy": "" if gpu_busy is None else round(gpu_busy, 1),
               "sync_count": sum(s["count"] for s in train_stats.values()),
               "sync_ms": round(sum(s["total_ms"] for s in train_stats.values()), 3),
               "steps": self.global_step, "cpu_util": round(cpu_util, 1)}
        self.results_log.write(row)
        self.sync_stats.append({"epoch": epoch + 1, "strategy": self.strategy.name, "train": train_stats,
                                "engine": self.strategy.counters(),
                                "eval": merge_sync_stats([*self.waits["stats"], STATS.reset()])})
        if self.dist.main:
            write_json(self.save_dir / "sync_stats.json", self.sync_stats)
        self.scalars.add(self.global_step, {"epoch/train_loss": row["train_loss"], "epoch/train_nll": train_nll,
                                            "epoch/tokens_per_s": row["tokens_per_s"],
                                            "sync/count": row["sync_count"], "sync/ms": row["sync_ms"]})
        # the console shows the newest BLEU: a pass beside training reports at a later epoch
        shown, self.fresh_bleu = self.fresh_bleu, None
        self.log(epoch_line(row if row["bleu"] != "" or shown is None else {**row, "bleu": round(shown, 2)}, r.epochs))
        if r.verbose:
            self.log(format_table(train_stats))
        return row

    def _trained(self, seconds: float) -> None:
        """Training time since the last mark: the evaluation and save cadences count it."""
        self._loop_s, self._loop_steps = self._loop_s + seconds, self._loop_steps + 1
        self.evaluator.cadence.trained(seconds)
        self.save_cadence.trained(seconds)

    def _after_step(self) -> bool:
        """Mid-epoch, after a step: sets ``self.stopped`` (every rank stops now) and returns whether
        to evaluate this step. One process decides alone. Several ranks: every --sync-interval
        steps one host-side all-reduce carries both answers, any rank's stop request and rank 0's
        time rule (its clock decides: the ranks' clocks differ a little); between those steps no
        rank stops, and only --eval-every N (the same step count everywhere) evaluates."""
        step = self.global_step
        due, ask = self.evaluator.cadence.due_mid_epoch(step, self.dist)
        if not self.dist.active:
            self.stopped = self.stop_requested
            return due
        if step % self.job.engine.sync_interval == 0:
            self.stopped, agreed = self.dist.agree_any((self.stop_requested, ask), "dist.step")
            due = due or agreed
        return due

    def _save_due(self) -> bool:
        """An epoch end's last.pt, by the evaluation's rule (its cost: the last write's time on the
        writer), unless a write is still in flight; rank 0's answer on every rank."""
        due = not self.checkpointer.busy and self.save_cadence.due(self.global_step, epoch_end=True)
        return self.dist.broadcast(due, "dist.cadence") if self.dist.active else due

    def _finish(self) -> None:
        """The end of the run, however it ends: every loss logged, the last step evaluated (not after
        a signal: the job is being stopped) and saved, and every write on disk."""
        losses = getattr(self, "pending_losses", [])
        # one rank's signal; rank 0 may still be waiting for a write alone
        signalled = self.dist.agree(self.signalled, "dist.stop", long_wait=True) if self.dist.active else self.signalled
        self.signalled = signalled  # any rank's: what the last line says
        # a BLEU pass beside training ends first; it changed the early-stopping state that last.pt
        # keeps. After a signal it stops short instead and last.pt records it undecided (a resume
        # decodes it again and decides where this run would have)
        if signalled:
            self.evaluator.interrupt()
            evaluated = False
        else:
            evaluated = self._collect_eval(wait=True)
        if self.global_step and self.last_eval_step != self.global_step and not signalled:
            losses += self._evaluate(self.epoch, beside=False)
            evaluated = True
        # --average-last: the mean of the last evaluated weights against the best single one (best.pt
        # the winner); last.pt again, so that it records the choice
        evaluated = average_at_end(self) or evaluated
        if 0 < len(self.train_loader) <= self.epoch_pos:  # stopped at an epoch's last batch: a resume starts the next
            self.epoch, self.epoch_pos = self.epoch + 1, 0
        # last.pt again where this step was saved before its evaluation (--save-every, an epoch end's
        # save): the checkpoint must hold the evaluation's best metric, cadence and patience
        if self.last_save_step != self.global_step or not self.global_step or evaluated:
            losses += self._drain("stop")
            self._save_last()  # written while the run's logs and plots are made; train() waits for it
        self.evaluator.close()

    def _save_last(self, keep: int = 0) -> None:
        """last.pt of this step; with --async-save (the default) the caller waits for its staging only."""
        ts = self.clock()
        self._save("last.pt", keep=keep)
        waited = self.clock() - ts
        self.waits["save_s"] += waited
        self.times["checkpoints"] += waited
        self.save_cadence.done(self.checkpointer.write_s.get("last", 0.0))
        self.last_save_step = self.global_step

    def _request_stop(self, reason: str | Callable[[int], str]) -> None:
        """Ask to stop after this step (several ranks: after the step they agree on); ``reason`` is
        said once, when the run ends (a callable gets the step the run stopped after)."""
        self.stop_requested, self.stop_reason = True, reason

    def _write_steps(self, pairs: list[StepLoss]) -> list[StepLoss]:
        """Log the extracted steps; returns them (their losses and named values) for the epoch's means."""
        for rec in pairs:
            step, loss = rec
            row = self.pending_rows.pop(step)
            grad_norm, skipped = rec.values.get("grad_norm", math.nan), rec.values.get("skipped", 0.0)
            row.update(loss=loss, nll=rec.values["nll"], grad_norm=grad_norm, skipped=int(skipped))
            self.steps_log.write(row)
            self.scalars.add(step, {"train/loss": loss, "train/nll": row["nll"], "train/lr": row["lr"],
                                    "train/grad_norm": grad_norm})
            self.last_loss = loss
            self._check_step(step, loss, grad_norm, bool(skipped))
        return list(pairs)

    def _check_step(self, step: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """--on-nan for a non-finite loss or gradient (with fp16, the grad scaler's overflow skips
        are its own business); --max-skipped-steps for a run that no longer updates at all."""
        r = self.job.run
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        if not math.isfinite(loss) or (skipped and self.scaler is None):
            self.nonfinite_steps.append(step)
            what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm}, loss {loss:.4f})"
            if r.on_nan == "stop":
                raise NonFiniteLoss(f"non-finite {what} at step {step} (--on-nan stop)")  # + the checkpoint: _abandon
            self.log(f"warning: non-finite {what} at step {step}; the update was skipped (--on-nan skip)")
        if r.max_skipped_steps and self.skipped_in_row >= r.max_skipped_steps:
            raise NonFiniteLoss(f"{self.skipped_in_row} updates in a row skipped (non-finite loss or gradient) up "
                                f"to step {step} (--max-skipped-steps {r.max_skipped_steps})")

    def _drain(self, why: str) -> list[StepLoss]:
        # Needed: a checkpoint or an evaluation sees finished work only, and every loss up to it is logged first.
        self.strategy.drain(f"{why}.drain")
        return self._write_steps(self.losses.flush(f"{why}.losses"))

    def _save_mid_epoch(self, why: str, keep: int = 0) -> list[StepLoss]:
        """--save-every: last.pt (and with --keep-last a step copy) of this step."""
        losses = self._drain(why)
        self._save_last(keep=keep)
        return losses

    def _save(self, name: str, kind: str = "last", keep: int = 0, weights: dict[str, torch.Tensor] | None = None,
              step: int | None = None) -> float:
        """weights/``name`` of this step (every rank calls it; rank 0 writes); ``kind`` best: the
        weights only (:data:`WEIGHTS_KEYS`), with best.safetensors beside it, the model's or
        ``weights`` of ``step``. Returns the seconds the loop waited (the staging copy; a write
        still in flight before it)."""
        rngs = self.dist.gather(rng_state()) if self.dist.active else None
        if not self.dist.main:
            return 0.0
        path = self.save_dir / "weights" / name
        state = {**self.checkpoint_state(), "rng_ranks": rngs}
        if weights is not None:
            state.update(model=weights, step=step)
        then = None
        if kind == "best":
            stopper = self.evaluator.stopper
            state = {**weights_only(state), "best": {"metric": stopper.metric, "value": stopper.best,
                                                     "step": stopper.best_step}, "weights_id": new_weights_id()}
            then = safetensors_beside(path)
        return self.checkpointer.save(path, state, kind=kind, keep=keep, step=self.global_step, then=then)

    def _export_ema(self) -> None:
        """--ema: the averaged weights as weights/ema.pt, a weights-only checkpoint that translate, eval,
        export, average and --weights load like any other (last.pt keeps the trained weights)."""
        ema = self.step_fn.ema
        if ema is None or self.global_step == 0:
            return
        path = self.save_dir / "weights" / "ema.pt"
        with ema.swapped():  # the model holds the averaged weights until they are staged
            state = {**weights_only(self.checkpoint_state()), "ema_of_step": self.global_step}
            self.checkpointer.save(path, state, kind="ema")
        self.checkpointer.wait()
        self.log(f"EMA weights: {path}")





