"""Training: the loop that runs epochs through the stream engine.

The engine (``streamnmt.engine``) knows nothing of translation; it drives the step function of
``streamnmt.training.step`` (loss, backward, clipped Adam on the Noam schedule, without a host
sync). The run's parts are built by :func:`streamnmt.training.build.build_run`; the Trainer holds
the loop's state (step, epoch, position, stop flags) and calls the parts at named points: the
evaluations (:mod:`streamnmt.training.loop_evaluation`: when due, on the loop or beside it, best.pt,
patience), the checkpoints (:mod:`streamnmt.training.checkpoints`: what, when, in the background),
the metrics (:mod:`streamnmt.training.metrics`: logs, the epoch line, the end line) and the time
budget. The loop reads top to bottom in :meth:`Trainer.run_epoch`; the end of a run, however it
ends, in :meth:`Trainer._finish`. Every second of the wall clock is accounted to training,
evaluation, checkpoints, set-up or the rest, and said in the run's last line. On several processes
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

from streamnmt.config import TrainJob
from streamnmt.engine import STATS
from streamnmt.engine.losses import StepLoss
from streamnmt.errors import NonFiniteLoss
from streamnmt.training import compile_child
from streamnmt.training.async_bleu import Deferred
from streamnmt.training.averaging import average_at_end
from streamnmt.training.build import Run, build_run, resume_job
from streamnmt.training.checkpoints import LoopRecord
from streamnmt.training.monitor import CpuSampler, NvmlSampler
from streamnmt.training.reporting import merge_sync_stats, progress, time_line
from streamnmt.training.stopping import stop_signals
from streamnmt import testhooks
from streamnmt.dist import PeerLost, world_from_env

END_SHARE = 0.02  # of --time-limit, kept for the run's end (exports, plots), at most 5 s


class Trainer:
    """Trains: epochs of steps through the engine's strategy, evaluations and checkpoints when due,
    and the end of the run. ``run``: the parts :func:`build_run` made (a :class:`TrainJob` is built
    into them here, with ``log`` and ``resume``, a loaded checkpoint that continues a run exactly)."""

    def __init__(self, run: Run | TrainJob, log: Callable[[str], None] = print,
                 resume: dict[str, Any] | None = None):
        self.run = run if isinstance(run, Run) else build_run(run, log, resume)
        run = self.run
        # the parts the loop calls
        self.job, self.log, self.dist, self.device = run.job, run.log, run.dist, run.device
        self.model, self.train_step, self.strategy, self.losses = run.model, run.train_step, run.strategy, run.losses
        self.train_loader, self.budget, self.save_dir = run.train_loader, run.budget, run.save_dir
        self.evaluator, self.evaluations, self.metrics = run.evaluator, run.evaluations, run.metrics
        self.checkpoints, self.checkpointer = run.checkpoints, run.checkpoints.writer
        self.cooldown = run.cooldown
        # the loop's state
        self.global_step, self.epoch, self.epoch_pos = run.start.step, run.start.epoch, run.start.epoch_pos
        # resumed mid-epoch: that epoch's results row also counts the losses its steps.csv holds from before
        self._resumed_in = (run.start.epoch, run.start.step) if run.start.epoch_pos else None
        self.clock = time.perf_counter  # the loop's timings (injectable: tests use a fake clock)
        self.stop_requested, self.stop_reason = False, ""  # this rank: a signal, --time-limit or --patience
        self._loop_s, self._loop_steps = 0.0, 0  # the loop's training seconds and steps (mean step time)
        self.stopped = False  # the ranks agreed to stop
        self.kept: dict[str, float] | None = None  # --time-limit: the reserve the loop stopped with, by part
        self.kept_s = 0.0  # the reserve's sum at this step (_check_budget)
        self.signalled = False  # a first signal arrived (a second Ctrl-C aborts)
        self.pending_losses: list[StepLoss] = []  # drained by a stop mid-epoch, for the end's means
        # a stop mid-epoch: (epoch, tally, sync statistics) of its part, whose row the end writes
        self.stopped_epoch: tuple[int, dict[str, Any], dict[str, Any]] | None = None
        self.switch_s = 0.0  # --compile background: seconds of switching to the compiled step (set-up)

    @classmethod
    def from_checkpoint(cls, path: str, log: Callable[[str], None] = print, device: str | None = None,
                        time_limit: str | None = None, changes: dict[str, Any] | None = None) -> Trainer:
        """Continue the run of checkpoint ``path`` (see :func:`streamnmt.training.build.resume_job`)."""
        # before the process group exists: rank 0 alone says what the resume changes (a rank's error
        # is raised on every rank all the same)
        rank, world, _ = world_from_env()
        quiet = world > 1 and rank != 0
        job, ckpt = resume_job(path, log=(lambda _: None) if quiet else log, device=device, time_limit=time_limit,
                               changes=changes)
        return cls(build_run(job, log, ckpt))

    # -- the run ------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """The run; however it ends, every background write and BLEU pass is waited for or, where
        the run stops before deciding a pass, recorded in last.pt (:meth:`_abandon` for an error)."""
        try:
            return self._train()
        except BaseException as e:
            if isinstance(e, PeerLost):
                # torchrun stops a lost rank's survivors with SIGTERM: this one lands its writes and
                # exits with its one line (cli) instead of dying silently on the way
                with contextlib.suppress(ValueError):  # (not the main thread: no handler to set)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self._abandon(e)
            raise

    def _abandon(self, error: BaseException) -> None:
        """train() raised (an error, a lost peer, a second Ctrl-C): a pass beside training stops
        and the scoring workers exit; the write in flight lands, so that the run leaves whole files
        and its error line names a checkpoint that exists (only a kill leaves a write unfinished: its
        temporary file goes at the next start)."""
        with contextlib.suppress(Exception):
            self.evaluator.abort()
        with contextlib.suppress(Exception):
            self.train_loader.close()
        compile_child.stop(self.run)
        try:
            self.checkpointer.close()
        except Exception as e:  # noqa: BLE001 - the run's own error is the one raised
            self.log(f"warning: the checkpoint write in flight failed as well ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200] if str(e) else ''}); the files before it are whole")
        self.metrics.abandon()
        if isinstance(error, NonFiniteLoss):
            error.args = (f"{error}; {self.checkpoints.last_good()}",)

    def _train(self) -> dict[str, Any]:
        r, times = self.job.run, self.metrics.times
        row: dict[str, Any] = {}
        times["set-up"] = time.monotonic() - self.run.t_command  # from the command's start to the first step
        loop_start = self.clock()
        if self.cooldown is not None:  # --lr-cooldown: a run ending at a step count is planned now
            self.cooldown.begin(self.global_step)
        with stop_signals(self):
            self.evaluations.resume(self)
            self.log(f"{'Epoch':>7}{'GPU_mem':>9}{'steps':>9}{'tokens/s':>10}{'train_loss':>12}"
                     f"{'train_nll':>11}{'ppl':>9}{'val_loss':>10}{'BLEU':>7}{'time':>8}")
            while self.epoch < r.epochs and not self._done():
                row = self.run_epoch(self.epoch) or row
            self._finish()
            self.train_loader.close()  # its workers ignore SIGTERM: the interpreter's exit would wait on them
            if self.stopped_epoch is not None:  # a --time-limit, --patience or signal stop mid-epoch
                row = epoch_row(self, *self.stopped_epoch, self.evaluations.last_eval_at(self.global_step))
            self.metrics.restore_held()  # a resume that stopped before a step of its epoch
            loop_s = self.clock() - loop_start
            times["training"] = loop_s - times["evaluation"] - times["checkpoints"] - self.switch_s
            times["set-up"] += self.switch_s
            end_start = self.clock()
            # rank 0: ema.pt staged, then written beside the last last.pt; _close_logs waits for both
            ema = self.checkpoints.export_ema(self.record()) if self.dist.main else None
            ema_s = self.clock() - end_start
            times["checkpoints"] += ema_s
            write_s = self._close_logs()  # inside: a SIGTERM meanwhile is caught as in the loop
        result = {"save_dir": self.save_dir, "best_val": self.evaluator.best_val, "steps": self.global_step,
                  "last": row, "stopped": self.stopped, "signalled": self.signalled, "times": times}
        if not self.dist.main:
            return result
        if ema is not None:
            self.log(f"EMA weights: {ema}")
        if self.stopped:
            reason = self.stop_reason(self.global_step) if callable(self.stop_reason) else self.stop_reason
            if not reason:
                reason = (f"stopped by signal after step {self.global_step}" if self.signalled else
                          f"stopped after step {self.global_step}: another rank asked to (its time limit)")
            self.log(f"{reason}; saved {self.save_dir / 'weights' / 'last.pt'}")
        times["other"] = self.clock() - end_start - write_s - ema_s  # the sync table, logs closed, plots
        result["wall_s"] = time.monotonic() - self.run.t_command
        line = time_line(times, result["wall_s"])
        if self.kept is not None:  # what the loop left for the end against what it took
            parts = ", ".join(f"{k} {v:.1f}" for k, v in self.kept.items())
            line += (f"; the loop stopped with {sum(self.kept.values()):.1f} s of --time-limit kept for the end "
                     f"({parts})")
        self.log(line)
        return result

    def _close_logs(self) -> float:
        """The sync table, the logs closed and the plots drawn while the last last.pt (and ema.pt) is
        written; then the wait for those writes (returned, in seconds), so they end before the run says
        it saved."""
        try:
            self.metrics.finish(self.global_step)
        finally:
            te = self.clock()
            self.checkpointer.close()
            write_s = self.clock() - te
            self.metrics.times["checkpoints"] += write_s
        return write_s

    # -- when to stop -------------------------------------------------------------------------
    def _done(self) -> bool:
        r = self.job.run
        self._check_budget()  # e.g. after an evaluation
        return self._stop_agreed() or bool(r.max_steps and self.global_step >= r.max_steps)

    def _check_budget(self) -> None:
        """Ask to stop once --time-limit leaves only what the end of the run needs (reserve; its sum
        kept for the step's cool-down rule, :meth:`_after_step`)."""
        if self.stop_requested:
            return
        parts = self.reserve()
        self.kept_s = sum(parts.values())
        if self.budget.expired(self.kept_s):
            self.kept = parts  # the end line says it beside what the end took
            self.request_stop(self.budget.reason)

    def reserve(self, evaluation: bool = True) -> dict[str, float]:
        """Seconds the end of the run will take after the last step, by part: its evaluation (unless not
        ``evaluation``) and the best.pt it may write, its last.pt write and with ``--ema`` what its
        ema.pt, written beside it, takes longer (the evaluation as long as the longest of the last few,
        :attr:`Cadence.end_cost_s`; each write as long as the last one of its kind took, ema.pt as
        best.pt; a write still in flight counts what it has left; a pending pass counts the decoding it
        has left and the whole best.pt its collection may write, though that write runs beside the
        end's evaluation: up to one best.pt write of training given up for an end that fits) and the
        exports and plots (a small share)."""
        w = self.checkpointer.write_s
        cost = self.evaluator.cadence.end_cost_s or 0.0
        ev = cost + w.get("best", 0.0) if evaluation else 0.0
        # a pending pass: the end waits for one still running beside training (not counted where the
        # pass itself asks) or decodes a resumed run's on the loop (Deferred), and its collection may
        # write best.pt, which the end's last.pt waits for
        pending = self.evaluator.pending  # read once: a pass's thread asks too
        if evaluation and pending is not None:
            ev += (cost if not pending[2].done or isinstance(pending[2], Deferred) else 0.0) + w.get("best", 0.0)
        # --average-last: the end scores the mean of the last evaluated weights too, and may write best.pt
        ev += cost + w.get("best", 0.0) if evaluation and self.evaluator.averager.on else 0.0
        writes = w.get("last", 0.0) + self.checkpointer.in_flight_s()  # last.pt waits for a write in flight
        if self.train_step.ema is not None and self.dist.main:  # weights/ema.pt, written beside the last.pt
            ema = w.get("ema") or w.get("best") or w.get("last", 0.0)  # weights only, as best.pt
            writes += max(ema - w.get("last", 0.0), 0.0)  # the end waits for the longer of the two
        # several ranks agree to stop every --sync-interval steps: up to that many more steps run
        agreeing = (self.job.engine.sync_interval - 1) * self._loop_s / max(self._loop_steps, 1) \
            if self.dist.active else 0.0
        rest = min(END_SHARE * (self.budget.limit_s or 0.0), 5.0)
        return {"evaluation": ev, "writes": writes, "the rest": agreeing + rest}

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

    def request_stop(self, reason: str | Callable[[int], str]) -> None:
        """Ask to stop after this step (several ranks: after the step they agree on); ``reason`` is
        said once, when the run ends (a callable gets the step the run stopped after)."""
        self.stop_requested, self.stop_reason = True, reason

    # -- the loop -----------------------------------------------------------------------------
    def run_epoch(self, epoch: int) -> dict[str, Any]:
        r = self.job.run
        if 0 < len(self.train_loader) <= self.epoch_pos:  # resumed at the epoch's end (a checkpoint
            self.epoch, self.epoch_pos = epoch + 1, 0       # of an earlier version): nothing left to train
            return {}
        self.model.train()
        # --compile background: the compiled step takes over here once its child is done (traced and
        # captured in training mode); its seconds count as set-up
        step_s = self._loop_s / self._loop_steps if self._loop_steps else None  # uncompiled so far
        self.switch_s += compile_child.take_over_when_done(self.run, self.global_step, self.clock, step_s)
        self.train_loader.set_epoch(epoch)  # keeps a resumed mid-epoch position
        STATS.reset()
        nvml = NvmlSampler(self.device).start()  # GPU utilisation sampled in a thread; no device sync
        cpu = CpuSampler().start()  # CPU time of this process and its loader workers
        t0 = self.clock()
        self.metrics.new_epoch()  # what the loop waited for this epoch
        n_batches = len(self.train_loader) - self.epoch_pos  # micro-batches: --accum-steps per step
        if r.max_steps:
            n_batches = min(n_batches, (r.max_steps - self.global_step) * self.job.engine.accum_steps)
        if self.cooldown is not None and epoch == r.epochs - 1:  # the last epoch's length is known now
            self.cooldown.retarget(self.global_step + -(-n_batches // self.job.engine.accum_steps))
        bar = progress(n_batches, f"epoch {epoch + 1}" + (f"/{r.epochs}" if r.epochs < 1_000_000 else ""),
                       quiet=not self.dist.main)
        tally = self._steps(epoch, n_batches, bar)
        if self.stopped:  # the end of the run (_finish) drains, evaluates and saves where we are
            self.pending_losses = tally["losses"]  # _finish adds the steps it drains
            bar.close()
            waits = self.metrics.waits
            tally["epoch_s"] = self.clock() - t0 - waits["eval_s"] - waits["save_s"]
            tally["gpu_busy"] = nvml.stop().get("util_mean_pct")
            tally["cpu_util"] = cpu.stop()["util_pct"]
            if tally["tokens"]:  # its part's row (results.csv, sync_stats.json) once _finish evaluated
                self.stopped_epoch = (epoch, tally, STATS.reset())
            return {}
        # 4. epoch end: drain the streams and the remaining losses
        # Needed: the epoch's time and every loss must be final before they are reported.
        self.strategy.drain("epoch.drain")
        tally["losses"] += self.metrics.write_steps(self.losses.flush("epoch.losses"))
        bar.close()
        self._trained(self.clock() - tally["mark"])
        waits = self.metrics.waits
        tally["epoch_s"] = self.clock() - t0 - waits["eval_s"] - waits["save_s"]
        tally["gpu_busy"] = nvml.stop().get("util_mean_pct")
        tally["cpu_util"] = cpu.stop()["util_pct"]  # % of one core, loader workers included
        return self._epoch_end(epoch, tally, STATS.reset())

    def _steps(self, epoch: int, n_batches: int, bar: Any) -> dict[str, Any]:
        """The epoch's steps through the engine, with the mid-epoch evaluations and saves; returns
        the tally (tokens, padded positions, losses) and the clock's last mark."""
        r, metrics = self.job.run, self.metrics
        tokens, padded, losses = 0, 0, []
        end_pos = self.epoch_pos + n_batches  # where this epoch's part of the run ends (its own evaluation)
        mark = self.clock()
        for info in self.strategy.run(itertools.islice(self.train_loader, n_batches), self.train_step, self.losses,
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
            metrics.pending_rows[info.step] = {"step": info.step, "epoch": epoch + 1, "tokens": ntok,
                                               "lr": self.train_step.schedule.lr_at(info.step)}
            # 2. losses whose copies to the host have completed (never blocks)
            losses += metrics.write_steps(self.losses.poll())
            if metrics.last_loss is not None:
                bar.set_postfix_str(f"loss {metrics.last_loss:.4f} (as of last extraction)", refresh=False)
            self._trained(self.clock() - mark)
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
                losses += self.evaluations.evaluate(self, epoch)
                # --patience, or the time the evaluation took: stop after this step (every rank
                # evaluated here, so every rank takes part in this agreement)
                self._check_budget()
                self.stopped = self.dist.agree(self.stop_requested) if self.dist.active else self.stop_requested
            if r.save_every and self.global_step % r.save_every == 0:
                losses += self.drain("save")
                self._save_last(keep=r.keep_last)
            if self.global_step == testhooks.kill_at_step():
                # a crash after the checkpoints written so far: those in flight land first, so the
                # tests' resume point does not hang on a loaded machine's write speed
                self.checkpointer.wait()
                if self.dist.active:
                    self.dist.kill_launcher()
                os.kill(os.getpid(), signal.SIGKILL)
            mark = self.clock()
            if self.stopped:
                break
        return {"tokens": tokens, "padded": padded, "losses": losses, "mark": mark}

    def _epoch_end(self, epoch: int, tally: dict[str, Any], train_stats: dict[str, Any]) -> dict[str, Any]:
        """5. validation loss and BLEU when due, or at the run's last epoch end (timed apart from
        training); 6. last.pt when due; the epoch's row, statistics and line."""
        r = self.job.run
        cut = bool(r.max_steps) and self.global_step >= r.max_steps and self.epoch_pos < len(self.train_loader)
        if not cut:  # --max-steps ended the run mid-epoch: a resume with a larger one goes on from here
            self.epoch, self.epoch_pos = epoch + 1, 0
        ending = self.epoch >= r.epochs or bool(r.max_steps and self.global_step >= r.max_steps)
        result, evals = None, self.evaluations
        if evals.last_eval_step != self.global_step and (
                ending or self.evaluator.cadence.due_at_epoch_end(self.global_step, self.dist)):
            evals.evaluate(self, epoch, beside=not ending)
            result = evals.last_eval
        # the next epoch starts from its first batch (when due: see CheckpointManager.due_at_epoch_end)
        if ending or self.checkpoints.due_at_epoch_end(self.global_step):
            self._save_last()  # the end of the run waits for it (Trainer._close_logs)
        return epoch_row(self, epoch, tally, train_stats, result)

    def _trained(self, seconds: float) -> None:
        """Training time since the last mark: the evaluation and save cadences count it."""
        self._loop_s, self._loop_steps = self._loop_s + seconds, self._loop_steps + 1
        self.evaluator.cadence.trained(seconds)
        self.checkpoints.cadence.trained(seconds)

    def _after_step(self) -> bool:
        """Mid-epoch, after a step: sets ``self.stopped`` (every rank stops now) and returns whether
        to evaluate this step. One process decides alone. Several ranks: every --sync-interval
        steps one host-side all-reduce carries both answers, any rank's stop request and rank 0's
        time rule (its clock decides: the ranks' clocks differ a little); between those steps no
        rank stops, and only --eval-every N (the same step count everywhere) evaluates."""
        step = self.global_step
        due, ask = self.evaluator.cadence.due_mid_epoch(step, self.dist)
        c = self.cooldown  # --lr-cooldown: rank 0's clock decides, as for the stop
        cool = self.dist.main and c is not None and not c.planned and c.due(step, self.kept_s)
        if c is not None and c.finished(step) and not self.stop_requested:  # every rank: the same plan and step
            self.request_stop(lambda last, at=step: f"--lr-cooldown: the learning rate reached 0 after step {at}"
                              + ("" if last == at else f", the ranks stopped after step {last}"))
        if not self.dist.active:
            self.stopped = self.stop_requested
            if cool:
                c.agree(step, self.kept_s, self.dist)
            return due
        if step % self.job.engine.sync_interval == 0:
            self.stopped, agreed, cool = self.dist.agree_any((self.stop_requested, ask, cool), "dist.step")
            due = due or agreed
            if cool and not self.stopped:  # every rank plans rank 0's end: one more exchange, once a run
                c.agree(step, self.kept_s, self.dist)
        return due

    def drain(self, why: str) -> list[StepLoss]:
        # Needed: a checkpoint or an evaluation sees finished work only, and every loss up to it is logged first.
        self.strategy.drain(f"{why}.drain")
        return self.metrics.write_steps(self.losses.flush(f"{why}.losses"))

    # -- the end and the checkpoints --------------------------------------------------------------
    def _finish(self) -> None:
        """The end of the run, however it ends: every loss logged, the last step evaluated (not after
        a signal: the job is being stopped) and saved, and every write on disk."""
        losses, evals = self.pending_losses, self.evaluations
        compile_child.stop(self.run)  # still compiling: the end needs the GPU and cores more
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
            evaluated = evals.collect(self, wait=True)
        if self.global_step and evals.last_eval_step != self.global_step and not signalled:
            losses += evals.evaluate(self, self.epoch, beside=False)
            evaluated = True
        # --average-last: the mean of the last evaluated weights against the best single one (best.pt
        # the winner); last.pt again, so that it records the choice
        evaluated = average_at_end(self) or evaluated
        if 0 < len(self.train_loader) <= self.epoch_pos:  # stopped at an epoch's last batch: a resume starts the next
            self.epoch, self.epoch_pos = self.epoch + 1, 0
        # last.pt again where this step was saved before its evaluation (--save-every, an epoch end's
        # save): the checkpoint must hold the evaluation's best metric, cadence and patience
        if self.checkpoints.last_save_step != self.global_step or not self.global_step or evaluated:
            losses += self.drain("stop")
            self._save_last()  # written while the run's logs and plots are made; train() waits for it
        self.evaluator.close()

    def _save_last(self, keep: int = 0) -> None:
        """last.pt of this step; with --async-save (the default) the caller waits for its staging only."""
        ts = self.clock()
        self.checkpoints.save_last(self.record(), keep=keep)
        waited = self.clock() - ts
        self.metrics.waits["save_s"] += waited
        self.metrics.times["checkpoints"] += waited

    def record(self) -> LoopRecord:
        """The loop's part of a checkpoint of this step."""
        return LoopRecord(self.global_step, self.epoch, self.epoch_pos, self.evaluations.record(self.global_step),
                          self.run.wall_s())


def epoch_row(trainer: Trainer, epoch: int, tally: dict[str, Any], train_stats: dict[str, Any],
              result: Any) -> dict[str, Any]:
    """The epoch's results.csv row (a run stopped inside it: its part's), sync statistics and line
    (a function of the trainer's state, apart from its class: Trainer keeps to 20 methods)."""
    epoch_s = tally["epoch_s"]
    finite = [(v[1], v.values["nll"]) for v in tally["losses"] if math.isfinite(v[1])]  # a skipped step's left out
    if trainer._resumed_in is not None and trainer._resumed_in[0] == epoch:
        finite = trainer.metrics.earlier_losses(epoch + 1, trainer._resumed_in[1]) + finite
        trainer._resumed_in = None
    train_loss = sum(loss for loss, _ in finite) / max(len(finite), 1)
    train_nll = sum(nll for _, nll in finite) / max(len(finite), 1)
    waits, gpu_busy = trainer.metrics.waits, tally["gpu_busy"]
    row = {"epoch": epoch + 1, "train_loss": train_loss, "train_nll": train_nll,
           "train_ppl": math.exp(min(train_nll, 700.0)), "val_loss": "" if result is None else result.val_loss,
           "bleu": "" if result is None or result.bleu is None else round(result.bleu, 2),
           "tokens_per_s": tally["tokens"] / epoch_s, "padded_tokens_per_s": tally["padded"] / epoch_s,
           "epoch_s": round(epoch_s, 3), "bleu_s": "" if result is None else round(result.bleu_s, 3),
           "eval_s": round(waits["eval_s"], 3), "save_s": round(waits["save_s"], 3),
           "gpu_mem_gb": torch.cuda.max_memory_allocated(trainer.device) / 1e9 if trainer.device.type == "cuda" else 0.0,
           "gpu_busy": "" if gpu_busy is None else round(gpu_busy, 1),
           "sync_count": sum(s["count"] for s in train_stats.values()),
           "sync_ms": round(sum(s["total_ms"] for s in train_stats.values()), 3),
           "steps": trainer.global_step, "cpu_util": round(tally["cpu_util"], 1)}
    trainer.metrics.end_epoch(row, trainer.global_step, train_stats, {
        "epoch": epoch + 1, "strategy": trainer.strategy.name, "train": train_stats,
        "engine": trainer.strategy.counters(), "eval": merge_sync_stats([*waits["stats"], STATS.reset()])})
    return row
