"""The run's checkpoints, one owner (as torchtitan's CheckpointManager): when an epoch end's
last.pt is due, what a checkpoint holds, its write in the background
(:class:`streamnmt.training.checkpointer.Checkpointer`), last.pt, best.pt (only a better model
than the one on disk), the --keep-last step files and --ema's ema.pt, and the parts restored from a
checkpoint for ``--resume``.

What a checkpoint holds of the loop (its step, the epoch's position, the evaluation record) the
loop hands over as a :class:`LoopRecord`; the parts it holds (model, optimizer, schedule, scaler,
data order, RNG, evaluator, EMA) it reads itself.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamnmt.checkpoint import load_model_weights, rng_state, set_rng_state, tokenizer_entry
from streamnmt.training.cadence import Cadence
from streamnmt.training.checkpointer import Checkpointer, new_weights_id, safetensors_beside, weights_only
from streamnmt.training.stopping import is_better


PARTS = ("job", "log", "dist", "device", "recipe_device", "data", "shape", "model", "train_step", "train_loader",
         "evaluator")


@dataclasses.dataclass
class LoopRecord:
    """The loop's part of a checkpoint: its step and position, and its evaluation record."""

    step: int
    epoch: int
    epoch_pos: int
    evaluation: dict[str, Any]  # last_eval_step, pending_eval, eval_due (LoopEvaluation.record)
    wall_s: float | None  # the run's wall clock when it reached this state (None: unknown)


class CheckpointManager:
    """Saves and restores a run's parts (``run``: the :class:`streamnmt.training.build.Run`, read
    for the parts a checkpoint holds; ``save_dir``: the run directory)."""

    def __init__(self, run: Any, save_dir: Path):
        # the parts it reads, not the Run that holds this manager: no reference cycle keeps the run
        # (its loader's worker processes) alive after the Trainer goes
        self.run = types.SimpleNamespace(**{name: getattr(run, name) for name in PARTS})
        self.save_dir = save_dir
        self.writer = Checkpointer(run.device, background=run.job.run.async_save)
        self.cadence = Cadence(None, first_after_s=0.0)  # an epoch end's last.pt: --eval-every auto's rule
        self.best_on_disk: float | None = None  # the --best-metric value of the model best.pt holds
        self.last_save_step = -1

    def use_job(self, job: Any) -> None:
        """The job the checkpoints record from now on (the set-up changed a setting: Triton's
        attention fell back to sdpa)."""
        self.run.job = job

    # -- what a checkpoint holds ------------------------------------------------------------------
    def state(self, loop: LoopRecord) -> dict[str, Any]:
        run = self.run
        train_step = run.train_step
        return {
            "model": run.model.state_dict(),
            "model_shape": dataclasses.asdict(run.shape),
            "optimizer": train_step.optimizer.state_dict(),
            "scaler": train_step.scaler.state_dict() if train_step.scaler else None,
            "tokenizers": {side: tokenizer_entry(tok) for side, tok in (("src", run.data.src_tok),
                                                                          ("tgt", run.data.tgt_tok))},
            "config": run.job.to_dict(),
            # the last evaluation: decided, or pending (a BLEU pass beside training, one a signal cut),
            # recorded with its weights in pending_eval (Evaluator.record): a resume decides it
            "step": loop.step, "best_val": run.evaluator.best_val,
            **loop.evaluation,
            "wall_s": loop.wall_s,
            "recipe_device": dataclasses.asdict(run.recipe_device),
            "sampler": {**run.train_loader.state_dict(), "epoch": loop.epoch, "position": loop.epoch_pos},
            "rng": rng_state(),
            "stopping": run.evaluator.state_dict(),
            "ema": train_step.ema.state_dict() if train_step.ema is not None else None,
            "averager": run.evaluator.averager.state_dict(),  # --average-last: an exact resume ends alike
        }

    # -- writing ------------------------------------------------------------------------------
    def save(self, name: str, loop: LoopRecord, kind: str = "last", keep: int = 0,
             weights: dict[str, torch.Tensor] | None = None, step: int | None = None,
             best: dict[str, Any] | None = None) -> float:
        """weights/``name`` of this step (every rank calls it; rank 0 writes); ``kind`` best: the
        weights only (:data:`WEIGHTS_KEYS`), with best.safetensors beside it, the model's or
        ``weights`` of ``step``, its ``best`` record the early-stopping state's (``best``: entries
        in its place). Returns the seconds the loop waited (the staging copy; a write still in
        flight before it)."""
        dist = self.run.dist
        rngs = dist.gather(rng_state()) if dist.active else None
        if not dist.main:
            return 0.0
        path = self.save_dir / "weights" / name
        state = {**self.state(loop), "rng_ranks": rngs}
        if weights is not None:
            state.update(model=weights, step=step)
        then = None
        if kind == "best":
            stopper = self.run.evaluator.stopper
            record = {"metric": stopper.metric, "value": stopper.best, "step": stopper.best_step, **(best or {})}
            state = {**weights_only(state), "best": record, "weights_id": new_weights_id()}
            then = safetensors_beside(path)
        return self.writer.save(path, state, kind=kind, keep=keep, step=loop.step, then=then)

    def save_last(self, loop: LoopRecord, keep: int = 0) -> None:
        """last.pt of this step; with --async-save (the default) the caller waits for its staging only."""
        self.save("last.pt", loop, keep=keep)
        self.cadence.done(self.writer.write_s.get("last", 0.0))
        self.last_save_step = loop.step

    def write_best(self, loop: LoopRecord, weights: dict[str, torch.Tensor] | None = None,
                   step: int | None = None, clock: Callable[[], float] = lambda: 0.0) -> float:
        """best.pt (the model's weights, or ``weights`` of ``step``) unless the one on disk is better;
        returns the seconds the loop waited."""
        stopper = self.run.evaluator.stopper
        value, metric, on_disk = stopper.best, stopper.metric, self.best_on_disk
        # a resume's best.pt may hold a better model than last.pt knew of
        if on_disk is not None and value is not None and not is_better(metric, value, on_disk):
            return 0.0
        ts = clock()
        self.save("best.pt", loop, kind="best", weights=weights, step=step)
        self.best_on_disk = value
        return clock() - ts

    def write_average(self, loop: LoopRecord, weights: dict[str, torch.Tensor] | None, value: float | None,
                      averaged: list[int]) -> None:
        """best.pt with --average-last's mean of the weights evaluated at steps ``averaged`` (rank 0
        holds it; None elsewhere), which scored ``value`` by --best-metric and won
        (:mod:`streamnmt.training.averaging` decided)."""
        self.save("best.pt", loop, kind="best", weights=weights, step=loop.step,
                  best={"value": value, "step": loop.step, "averaged": list(averaged)})
        self.best_on_disk = value

    def due_at_epoch_end(self, step: int) -> bool:
        """An epoch end's last.pt, by the evaluation's rule (its cost: the last write's time on the
        writer), unless a write is still in flight; rank 0's answer on every rank."""
        dist = self.run.dist
        due = not self.writer.busy and self.cadence.due(step, epoch_end=True)
        return dist.broadcast(due, "dist.cadence") if dist.active else due

    def export_ema(self, loop: LoopRecord) -> Path | None:
        """--ema: the averaged weights as weights/ema.pt, a weights-only checkpoint that translate, eval,
        export, average and --weights load like any other (last.pt keeps the trained weights). Staged
        here and written beside a last.pt write in flight (the writer's OVERLAPS): the caller waits
        for both with ``writer.close()``. Its path, or None where there is no moving average."""
        ema = self.run.train_step.ema
        if ema is None or loop.step == 0:
            return None
        path = self.save_dir / "weights" / "ema.pt"
        with ema.swapped():  # the model holds the averaged weights until they are staged
            state = {**weights_only(self.state(loop)), "ema_of_step": loop.step}
            self.writer.save(path, state, kind="ema")
        return path

    def last_good(self) -> str:
        """The checkpoint a failed run leaves to go on from, as it is on disk now."""
        last = self.save_dir / "weights" / "last.pt"
        try:
            step = torch.load(last, map_location="cpu", weights_only=True, mmap=True)["step"]
        except Exception:  # noqa: BLE001 - absent, or not whole: not one to name
            return "no checkpoint was written (weights/last.pt does not exist)"
        return f"the last good checkpoint is {last} (step {step})"

    # -- restoring (--resume) -------------------------------------------------------------------
    def restore(self, ckpt: dict[str, Any]) -> tuple[int, int]:
        """The parts as the checkpoint holds them; returns the data order's (epoch, position), in
        this run's units (the loader converts a position saved at another world size)."""
        run = self.run
        load_model_weights(run.model, ckpt, run.job.run.resume, flag="--resume")
        train_step = run.train_step
        train_step.optimizer.load_state_dict(ckpt["optimizer"])
        for group in train_step.optimizer.param_groups:  # the saved groups carry the saving device's settings
            group["lr"] = train_step.schedule.lr_t       # keep reading the schedule's device tensor
            group["fused"], group["capturable"] = True, run.device.type == "cuda"
        train_step.schedule.set_step(ckpt["step"])
        train_step.count_updates(ckpt["step"])  # which of the next updates refresh the EMA (--ema-every)
        if train_step.scaler is not None and ckpt.get("scaler"):
            train_step.scaler.load_state_dict(ckpt["scaler"])
        run.evaluator.best_val = ckpt["best_val"]
        self.last_save_step = ckpt["step"]
        run.train_loader.load_state_dict(ckpt["sampler"])
        run.evaluator.load_state_dict(ckpt.get("stopping"))
        if train_step.ema is not None and ckpt.get("ema"):
            train_step.ema.load_state_dict(ckpt["ema"])
        run.evaluator.averager.load_state_dict(ckpt.get("averager"))  # --average-last's kept weights
        self._restore_rng(ckpt)
        return run.train_loader.epoch, run.train_loader.position

    def _restore_rng(self, ckpt: dict[str, Any]) -> None:
        """Each rank's RNG as saved; a change of world size or --accum-steps said in one line."""
        run, dist = self.run, self.run.dist
        ranks = ckpt.get("rng_ranks") or [ckpt["rng"]]
        saved = (ckpt["sampler"].get("world", 1), ckpt["sampler"].get("accum", 1))
        k = run.job.engine.accum_steps
        if saved != (dist.world, k) or len(ranks) != dist.world:
            loader = run.train_loader
            steps = len(loader) // k  # this run's optimizer steps per epoch
            run.log(f"resume: saved with {saved[0]} process(es) x --accum-steps {saved[1]}, now {dist.world} x "
                    f"{k}: epoch {loader.epoch + 1} continues at its step {loader.position // k} of {steps}, the "
                    f"share of the epoch the saved run had trained rounded up to a whole step (at most one step's "
                    f"pairs of the epoch left out); from there each step groups the epoch's pairs differently, "
                    f"so training continues from step {ckpt['step']}, not bit-exactly" + (
                        f"; a step now trains {dist.world * k} batches (of --batch-size or --max-tokens each), "
                        f"not {saved[0] * saved[1]}, with the learning-rate schedule as it was"
                        if dist.world * k != saved[0] * saved[1] else ""))
        if dist.rank < len(ranks):
            set_rng_state(ranks[dist.rank])
        else:  # a rank the checkpoint had not: rank 0's state, then a dropout stream of its own
            set_rng_state(ckpt["rng"])
            torch.manual_seed(run.job.run.seed + 1_000_003 * dist.rank)

    def read_best_on_disk(self) -> None:
        """The metric of the model best.pt holds (its ``best`` record), which may be newer than
        last.pt's (a kill after an evaluation wrote best.pt, or a resume from an earlier
        ``step_*.pt``): the resumed run replaces best.pt only with a better model. The early-stopping
        state stays as the checkpoint recorded it, so the resume replays the run exactly. Rank 0's
        file decides for every rank (their ``save`` calls must agree)."""
        path = self.save_dir / "weights" / "best.pt"
        dist, best = self.run.dist, None
        if dist.main and path.exists():
            try:
                best = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("best")
            except Exception:  # an unreadable best.pt is not this resume's business (last.pt is whole)
                best = None
            if not best or best.get("metric") != self.run.evaluator.stopper.metric or best.get("value") is None:
                best = None
        best = dist.broadcast(best, "dist.resume")
        self.best_on_disk = None if best is None else float(best["value"])
