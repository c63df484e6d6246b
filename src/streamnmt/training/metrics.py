"""A run's metrics: the CSV logs (steps, results, evals), TensorBoard scalars, the host-sync
statistics, the seconds the loop waited and where the wall clock went, the epoch line and the
run's last line; and the health of each logged step (--on-nan, --max-skipped-steps).

Rank 0 writes; the other ranks hold null logs. A resumed run keeps its logs up to the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamnmt import dist as distributed
from streamnmt.engine.losses import StepLoss
from streamnmt.errors import NonFiniteLoss
from streamnmt.syncstats import format_table
from streamnmt.training.plots import plot_results
from streamnmt.training.reporting import Scalars, epoch_line, merge_sync_stats
from streamnmt.training.runs import CsvLog, read_csv, write_json

STEP_COLUMNS = ["step", "epoch", "loss", "nll", "lr", "tokens", "grad_norm", "skipped"]
# train_loss: with the training's label smoothing; train_nll (and train_ppl = exp of it): the plain
# NLL of the same steps, which compares with val_loss.
RESULT_COLUMNS = ["epoch", "train_loss", "train_nll", "train_ppl", "val_loss", "bleu", "tokens_per_s",
                  "padded_tokens_per_s", "epoch_s", "bleu_s", "eval_s", "save_s",
                  "gpu_mem_gb", "gpu_busy", "sync_count", "sync_ms", "steps", "cpu_util"]
# eval_s, save_s: the seconds the training loop waited for the evaluation and for its best.pt;
# wall_s: the run's wall clock (from the command's start, summed over resumes) when it reached the
# evaluated weights, for time-to-BLEU curves (scripts/plot_time_to_bleu.py);
# bleu_n: the dev sentences BLEU scored (fewer than --bleu-samples where the time limit cut the pass)
# kind: empty for an evaluation of the run's weights, "average" for the end of the run's mean of the
# last --average-last evaluated weights (training/averaging.py)
EVAL_COLUMNS = ["step", "epoch", "wall_s", "val_loss", "bleu", "bleu_n", "bleu_s", "val_s", "best", "eval_s",
                "save_s", "kind"]


class RunMetrics:
    """The logs of a run in ``save_dir`` (see the module's docstring). ``step``, ``epoch`` and
    ``evals_after``: where a resumed run's steps, results and evals logs go on (a new run: 0)."""

    def __init__(self, save_dir: Path, *, main: bool, tensorboard: bool, run: Any, log: Callable[[str], None],
                 step: int = 0, epoch: int = 0, evals_after: int = 0, resumed: bool = False,
                 overflow_skips: bool = False):
        null = distributed.NullLog
        self.save_dir, self.main, self.run, self.log = save_dir, main, run, log
        # a run resumed inside an epoch an earlier stop wrote a row of (its part): the row goes with the
        # truncation below and is written again at the end unless this run writes the epoch's own
        self.held: tuple[dict[str, str], dict[str, Any] | None] | None = None
        if resumed and main:
            self.held = _held_part(save_dir, epoch + 1)
        self.steps_log = CsvLog(save_dir / "steps.csv", STEP_COLUMNS, truncate_after=step) if main else null()
        self.results_log = CsvLog(save_dir / "results.csv", RESULT_COLUMNS, truncate_after=epoch) if main else null()
        self.evals_log = CsvLog(save_dir / "evals.csv", EVAL_COLUMNS, truncate_after=evals_after) \
            if main else null()
        self.scalars = Scalars(save_dir, tensorboard and main)
        stats_path = save_dir / "sync_stats.json"
        self.sync_stats: list[dict[str, Any]] = []
        if resumed and stats_path.is_file():
            self.sync_stats = [e for e in json.loads(stats_path.read_text()) if e["epoch"] <= epoch]
        self.pending_rows: dict[int, dict[str, Any]] = {}  # step -> row waiting for its loss
        self.last_loss: float | None = None
        self.times = dict.fromkeys(("training", "evaluation", "checkpoints", "set-up", "other"), 0.0)
        self.waits: dict[str, Any] = {"eval_s": 0.0, "save_s": 0.0, "stats": []}  # the loop's, this epoch
        self.fresh_bleu: float | None = None  # a pass beside training's BLEU, for the next epoch line
        self.overflow_skips = overflow_skips  # fp16: the grad scaler's overflow skips are its own business
        self.skipped_in_row = 0  # consecutive skipped updates (--max-skipped-steps)
        self.nonfinite_steps: list[int] = []

    def logs(self) -> tuple[Any, ...]:
        return self.steps_log, self.results_log, self.evals_log, self.scalars

    def new_epoch(self) -> None:
        """What the loop waited for is counted per epoch."""
        self.waits = {"eval_s": 0.0, "save_s": 0.0, "stats": []}

    def account(self, evaluation: float = 0.0, checkpoints: float = 0.0) -> None:
        """Seconds the loop waited for an evaluation and for checkpoint writes."""
        self.waits["eval_s"] += evaluation
        self.waits["save_s"] += checkpoints
        self.times["evaluation"] += evaluation
        self.times["checkpoints"] += checkpoints

    def earlier_losses(self, epoch: int, upto: int) -> list[tuple[float, float]]:
        """(loss, nll) of epoch ``epoch``'s finite steps up to ``upto`` as steps.csv holds them (a run
        resumed mid-epoch: the steps before its resume); none where this rank keeps no steps.csv."""
        path = getattr(self.steps_log, "path", None)
        if path is None or not Path(path).is_file():
            return []
        out = []
        for row in read_csv(path):
            try:
                step, loss, nll = int(row["step"]), float(row["loss"]), float(row["nll"])
            except (KeyError, TypeError, ValueError):  # a row of an earlier version without its nll
                continue
            if row.get("epoch") == str(epoch) and step <= upto and math.isfinite(loss):
                out.append((loss, nll))
        return out

    def write_steps(self, pairs: list[StepLoss]) -> list[StepLoss]:
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
        r = self.run
        self.skipped_in_row = self.skipped_in_row + 1 if skipped else 0
        if not math.isfinite(loss) or (skipped and not self.overflow_skips):
            self.nonfinite_steps.append(step)
            what = f"loss ({loss})" if not math.isfinite(loss) else f"gradient norm ({grad_norm}, loss {loss:.4f})"
            if r.on_nan == "stop":
                raise NonFiniteLoss(f"non-finite {what} at step {step} (--on-nan stop)")  # + the checkpoint: _abandon
            self.log(f"warning: non-finite {what} at step {step}; the update was skipped (--on-nan skip)")
        if r.max_skipped_steps and self.skipped_in_row >= r.max_skipped_steps:
            raise NonFiniteLoss(f"{self.skipped_in_row} updates in a row skipped (non-finite loss or gradient) up "
                                f"to step {step} (--max-skipped-steps {r.max_skipped_steps})")

    def log_eval(self, result: Any, epoch: int, wall_s: float | None, eval_s: float, save_s: float,
                 kind: str = "") -> None:
        """An evaluation's evals.csv row and scalars (``kind``: the row of another model than the
        run's weights, e.g. --average-last's mean; no scalars, it is no point of the run's curve)."""
        self.evals_log.write({"step": result.step, "epoch": epoch,
                              "wall_s": "" if wall_s is None else round(wall_s, 1),
                              "val_loss": result.val_loss,
                              "bleu": "" if result.bleu is None else round(result.bleu, 2),
                              "bleu_n": "" if result.bleu is None else result.bleu_n,
                              "bleu_s": round(result.bleu_s, 3), "val_s": round(result.val_s, 3),
                              "best": int(result.better),
                              "eval_s": round(eval_s, 3), "save_s": round(save_s, 3), "kind": kind})
        if not kind:
            self.scalars.add(result.step, {"dev/val_loss": result.val_loss, "dev/bleu": result.bleu})

    def restore_held(self) -> None:
        """The end of a resumed run that wrote no row of the epoch it resumed inside (it stopped before a
        step): the earlier part's row and sync entry back as they were."""
        if self.held is None:
            return
        row, sync = self.held
        self.held = None
        self.results_log.write(row)
        if sync is not None:
            self.sync_stats.append(sync)
            write_json(self.save_dir / "sync_stats.json", self.sync_stats)

    def end_epoch(self, row: dict[str, Any], step: int, train_stats: dict[str, Any], sync: dict[str, Any]) -> None:
        """An epoch's results.csv row, its sync statistics (sync_stats.json), scalars and console line."""
        if self.held is not None and str(row["epoch"]) == self.held[0].get("epoch"):
            self.held = None  # this run's row of that epoch replaces the earlier part's
        self.results_log.write(row)
        self.sync_stats.append(sync)
        if self.main:
            write_json(self.save_dir / "sync_stats.json", self.sync_stats)
        self.scalars.add(step, {"epoch/train_loss": row["train_loss"], "epoch/train_nll": row["train_nll"],
                                "epoch/tokens_per_s": row["tokens_per_s"],
                                "sync/count": row["sync_count"], "sync/ms": row["sync_ms"]})
        # the console shows the newest BLEU: a pass beside training reports at a later epoch
        shown, self.fresh_bleu = self.fresh_bleu, None
        self.log(epoch_line(row if row["bleu"] != "" or shown is None else {**row, "bleu": round(shown, 2)},
                            self.run.epochs))
        if self.run.verbose:
            self.log(format_table(train_stats))

    def finish(self, steps: int) -> None:
        """The run's end: the whole run's host waits once (instead of a table per epoch), the logs
        closed, the plots drawn."""
        if self.sync_stats:
            self.log(f"training host syncs over {len(self.sync_stats)} epoch(s):\n"
                     + format_table(merge_sync_stats([e["train"] for e in self.sync_stats])))
        for log in self.logs():
            log.close()
        if self.main and (self.save_dir / "steps.csv").stat().st_size > 0 and steps > 0:
            plot_results(self.save_dir)

    def abandon(self) -> None:
        """The run failed: every log closed, whatever fails on the way."""
        for log in self.logs():
            with contextlib.suppress(Exception):
                log.close()


def _held_part(save_dir: Path, epoch: int) -> tuple[dict[str, str], dict[str, Any] | None] | None:
    """results.csv's row of ``epoch`` and its sync_stats.json entry, where an earlier stop wrote them."""
    path = save_dir / "results.csv"
    rows = [r for r in read_csv(path) if r.get("epoch") == str(epoch)] if path.is_file() else []
    if not rows:
        return None
    stats_path = save_dir / "sync_stats.json"
    try:
        entries = json.loads(stats_path.read_text()) if stats_path.is_file() else []
    except ValueError:
        entries = []
    return rows[-1], next((e for e in entries if e.get("epoch") == epoch), None)
