"""Evaluation in a training run: validation loss, dev BLEU, best weights, patience, and when.

On a small corpus an epoch takes about a second and a dev BLEU pass a few: evaluating at every
epoch end spends most of a run's wall clock outside training (docs/PERFORMANCE.md, "Evaluation
and checkpoints in a run"). Three things keep evaluation a bounded share of the run:

* :class:`Cadence` (``--eval-every auto``, the default): evaluate once the training time since
  the last evaluation is at least :data:`COST_RATIO` times what that evaluation cost, so that
  evaluation stays under ~10 % of the wall clock; the first evaluation comes at the first epoch end
  or after :data:`FIRST_EVAL_S` of training. ``--eval-every N`` evaluates every N steps and at
  epoch ends, ``0`` at epoch ends only, as before. The end of the run always evaluates.
* The validation loss runs from CUDA graphs (:class:`CapturedLoss`): one graph per dev batch
  shape, captured at the first evaluation and replayed after; the sums stay on the device.
* Dev BLEU decodes through the graph decoder (:mod:`streamnmt.inference.graph_search`) on a
  decoding copy of the model in ``--eval-dtype`` (bf16 where the GPU has it) whose weights stay at
  fixed addresses, so its buckets are captured once per run and replayed at every evaluation.
* ``--async-eval`` (on a GPU with one process): after the first evaluation, which captures the
  decoding graphs on the loop, the BLEU pass runs on a thread beside training
  (:mod:`streamnmt.training.async_bleu`): :meth:`Evaluator.launch` starts it, :meth:`Evaluator.collect`
  decides with its result at the next evaluation or the end of the run, steps that do not depend
  on how fast the pass ran, so that a run replays exactly from its last.pt.

An evaluation whose BLEU is not decided yet (a pass beside training, or one a signal cut short) is
``pending``: a last.pt written meanwhile records it, its evaluated weights included
(:meth:`Evaluator.record`), and a resumed run decodes those weights again (:meth:`Evaluator.restore`)
and decides where the uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from streamnmt.data import read_pairs
from streamnmt.engine.base import tensors
from streamnmt.syncstats import host_sync
from streamnmt.inference.decoding import SearchOptions, decoding_copy
from streamnmt.inference.scoring import ScorePool, bleu_on_pairs
from streamnmt.models import masks
from streamnmt.training.async_bleu import Beside, Deferred, Snapshot
from streamnmt.training.averaging import Averager
from streamnmt.training.cadence import COST_RATIO, Cadence
from streamnmt.training.step import LossModel
from streamnmt.config import best_metric
from streamnmt.training.stopping import EarlyStopping

EVAL_BATCH = 64  # dev sentences per decoding batch


@dataclass
class Evaluation:
    val_loss: float
    bleu: float | None
    bleu_s: float
    better: bool
    bleu_n: int = 0  # dev sentences scored: fewer than --bleu-samples when the time limit cut the pass
    val_s: float = 0.0  # seconds of the validation loss (the first: its graph's capture included)
    step: int = 0  # the step whose weights were evaluated (its BLEU None while its pass runs beside training)
    deferred: bool = False  # a signal cut its BLEU pass: not decided, pending (a resume decodes it again)


class CapturedLoss:
    """``fn(batch) -> (nll_sum, tokens)`` replayed from one CUDA graph per batch shape (forward
    only, no host sync). A shape whose capture fails is said in one line and runs eagerly after."""

    def __init__(self, fn: Callable[[Any], tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 log: Callable[[str], None]):
        self.fn, self.device, self.log = fn, device, log
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)  # the warm-ups' stream, made once (streams partition the allocator)
        self.failed: str | None = None

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.failed is not None:
            return self.fn(batch)
        key = tuple((tuple(t.shape), t.dtype) for t in tensors(batch))
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(batch)
            except RuntimeError as e:
                self.failed = str(e).splitlines()[0][:200]
                self.log(f"eval: validation runs eagerly (CUDA graph capture failed: {self.failed})")
                # Needed: the failed capture's work must be finished before eager validation starts.
                host_sync("eval.capture", lambda: torch.cuda.synchronize(self.device))
                return self.fn(batch)
        graph, static, out = entry
        for dst, src in zip(tensors(static), tensors(batch)):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    def _capture(self, batch: Any):
        static = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).clone()
                                               for f in dataclasses.fields(batch)
                                               if isinstance(getattr(batch, f.name), torch.Tensor)})
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.fn(static)  # warm-up: lazy initialisations (cuBLAS handles, Triton kernels) outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fn(static)
        finally:  # a capture that fails in capture_end leaves the capture stream current: not ours
            torch.cuda.set_stream(current)
        return graph, static, out


class Evaluator:
    """Validation loss and dev BLEU of the model; best.pt and --patience through ``stopper``.
    Rank 0 evaluates, every rank learns its results (so that they decide alike)."""

    def __init__(self, *, model: torch.nn.Module, amp_dtype: torch.dtype | None, dev_loader: Iterable,
                 data: Any, job: Any, device: torch.device, dist: Any, bleu_dtype: torch.dtype,
                 log: Callable[[str], None]):
        # Validation runs the model itself, not the training step's module: that one may be compiled
        # (a compile per dev batch shape) or wrapped by DDP (whose forward expects every rank).
        self.model, self.loss_model, self.amp_dtype = model, LossModel(model, 0.0), amp_dtype
        self.dev_loader = dev_loader
        self.data, self.job, self.device, self.dist, self.log = data, job, device, dist, log
        run = job.run
        self.stopper = EarlyStopping(best_metric(run), run.patience)
        self.cadence = Cadence.of_run(run)
        self.best_val = math.inf
        self.bleu_dtype = bleu_dtype
        self.bleu_model: torch.nn.Module | None = None
        self.options = SearchOptions(beam_size=run.beam_size, graph=device.type == "cuda")
        self._pairs: list[tuple[str, str]] | None = None
        # scoring workers for the run's BLEU passes, started now (they start while the run sets up)
        self.pool = ScorePool(job.data.tgt_lang) if run.bleu_samples and dist.main else None
        self._captured = CapturedLoss(self._nll, device, log) if device.type == "cuda" else None
        # --async-eval: the BLEU pass on a thread beside training (one process: with several ranks
        # rank 0's evaluation is agreed on at once, see Trainer._after_step)
        # auto: where the training step is captured (graph mode), since the pass's sdpa_kernel
        # settings are process-wide and would steer an eager step's attention while it runs
        captured = job.engine.sync_strategy == "graph"
        wanted = run.async_eval == "on" or (run.async_eval == "auto" and device.type == "cuda" and captured)
        self.beside = wanted and not dist.active and bool(run.bleu_samples)
        self._side = torch.cuda.Stream(device) if self.beside and device.type == "cuda" else None
        self._snapshot = Snapshot()  # the evaluated step's weights, for best.pt (device buffers)
        self.pending: tuple[Evaluation, dict[str, torch.Tensor], Beside | Deferred] | None = None
        self.passes = 0  # BLEU passes made
        self.aborted = False  # train() raised: a pass beside training stops at its next batch
        # the pending evaluation's pass was the loop's (a signal cut it there), not one beside training
        self.pending_on_loop = False
        # --average-last: the last K evaluated weights (rank 0 keeps them), scored at the end of the run
        self.averager = Averager(run.average_last, device, keep=dist.main)

    # -- what the loop calls ------------------------------------------------------------------
    def evaluate(self, step: int, ema: Any = None, on_better: Callable[[], None] | None = None,
                 stop: Callable[[], bool] | None = None, interrupted: Callable[[], bool] | None = None) -> Evaluation:
        """Validate and score (with the EMA weights when ``ema`` is given); ``on_better`` runs with
        those weights in the model when --best-metric improved (it writes best.pt). ``stop()``
        (rank 0's, asked between decoding batches) cuts the BLEU pass short for a time limit: that
        BLEU is reported with its sentence count, and not compared for best.pt or --patience (it
        writes best.pt only where no full pass has set a best yet). One process, a pass cut where
        ``interrupted()`` (a signal: the run stops after this step): nothing is decided, the
        evaluation is pending (``deferred``) and last.pt records it for the resumed run."""
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            self.averager.add(step, self.model.state_dict())  # --average-last: the weights scored here
            if self.dist.main:
                val_loss, val_s, bleu, bleu_s, bleu_n, asked = self.score(stop)
                if (not self.dist.active and bleu is not None and bleu_n < asked and interrupted is not None
                        and interrupted()):
                    weights = self._snapshot.take(self.model.state_dict())
                    self.best_val = min(self.best_val, val_loss)
                    result = Evaluation(val_loss, None, 0.0, False, 0, val_s, step, deferred=True)
                    self.pending = (result, weights, self._deferred(weights))
                    self.pending_on_loop = True  # decided where the run resumes, as it would have been here
                    return result
            else:
                val_loss, val_s, bleu, bleu_s, bleu_n, asked = math.nan, 0.0, None, 0.0, 0, 0
            # every rank learns rank 0's results (best.pt and --patience decide alike everywhere)
            val_loss, bleu, bleu_s, bleu_n, asked = self.dist.broadcast((val_loss, bleu, bleu_s, bleu_n, asked),
                                                                        "dist.evaluate")
            self.best_val = min(self.best_val, val_loss)
            better = self._decide(step, val_loss, bleu, bleu_n, asked)
            if better and on_better is not None:
                on_better()
        return Evaluation(val_loss, bleu, bleu_s, better, bleu_n, val_s, step)

    def launch(self, step: int, ema: Any = None, stop: Callable[[], bool] | None = None) -> Evaluation:
        """``--async-eval``: validate now and start the BLEU pass of these weights beside training
        (the caller drained the streams first); :meth:`collect` decides with its result."""
        if self.pending is not None:
            raise RuntimeError("a BLEU pass is still beside training: collect it first")
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            weights = self._snapshot.take(self.model.state_dict())
            self.averager.add(step, weights)  # --average-last: the weights scored here
            self.bleu_model = decoding_copy(self.model, self.bleu_dtype, self.bleu_model, separate=True)
            t0 = time.perf_counter()
            val_loss = self.validate()  # its host sync waits for the copies above too (queued before it)
            val_s = time.perf_counter() - t0
        self.best_val = min(self.best_val, val_loss)
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # the copies (done already)
        result = Evaluation(val_loss, None, 0.0, False, 0, val_s, step)
        def cut() -> bool:  # the pass stops where the loop's rule says, or where train() raised (abort)
            return self.aborted or (stop is not None and stop())
        self.pending = (result, weights, Beside(lambda: self._decode(cut), self.device, self._side))
        self.pending_on_loop = False
        return result

    def _deferred(self, weights: dict[str, torch.Tensor]) -> Deferred:
        """A BLEU pass of ``weights`` that runs on the loop when collected (its own decoding copy,
        loaded with them: the model trains on meanwhile)."""
        def decode(stop: Callable[[], bool] | None) -> tuple[float | None, float, int]:
            self.bleu_model = decoding_copy(self.model, self.bleu_dtype, self.bleu_model, separate=True)
            self.bleu_model.load_state_dict(weights)
            return self._decode(stop)
        return Deferred(decode)

    def record(self) -> dict[str, Any] | None:
        """The pending evaluation as last.pt keeps it (its BLEU pass is decoded again on resume),
        or None. The weights are the evaluated step's (the snapshot, staged by the writer)."""
        if self.pending is None:
            return None
        launched, weights, _ = self.pending
        return {"step": launched.step, "val_loss": launched.val_loss, "val_s": launched.val_s, "model": weights,
                "on_loop": self.pending_on_loop}

    def restore(self, record: dict[str, Any] | None) -> None:
        """A resumed run's pending evaluation (:meth:`record`): decided at :meth:`collect`, where the
        interrupted run would have decided it, after a pass of the recorded weights on the loop."""
        if not record:
            return
        weights = self._snapshot.take({k: v.to(self.device) for k, v in record["model"].items()})
        launched = Evaluation(record["val_loss"], None, 0.0, False, 0, record["val_s"], record["step"])
        self.pending = (launched, weights, self._deferred(weights))
        self.pending_on_loop = bool(record.get("on_loop"))  # a record from before the key: beside

    def interrupt(self) -> None:
        """A signal stops the run: a pass beside training stops (it asks the run's stop rule,
        which the signal answers) and its result is dropped; the evaluation stays pending for
        last.pt, as a pass of its weights on the loop."""
        if self.pending is None:
            return
        launched, weights, task = self.pending
        if isinstance(task, Beside):
            try:
                task.join()  # a cut pass: its result is not used
            except Exception as e:  # nor its error, but it is said (the resumed run may meet it again)
                first = (str(e).strip().splitlines() or [""])[0][:160]
                self.log(f"eval: the BLEU pass beside training failed as the run stopped ({type(e).__name__}: "
                         f"{first}); its evaluation stays pending for the resumed run")
            self.pending = (launched, weights, self._deferred(weights))

    def abort(self) -> None:
        """train() raised: a pass beside training stops at its next decoding batch and is waited
        for (its error, if any, is not the one to report), and the scoring workers exit."""
        self.aborted = True
        pending, self.pending = self.pending, None
        if pending is not None and isinstance(pending[2], Beside):
            with contextlib.suppress(BaseException):
                pending[2].join()
        self.close()

    @property
    def running(self) -> bool:
        """A BLEU pass beside training that has not finished yet (asked from either thread)."""
        pending = self.pending  # read once: the loop may clear it meanwhile
        return pending is not None and not pending[2].done

    def collect(self, on_better: Callable[[dict[str, torch.Tensor]], None] | None = None, wait: bool = False,
                interrupted: Callable[[], bool] | None = None, stop: Callable[[], bool] | None = None
                ) -> tuple[Evaluation, dict[str, dict[str, float]]] | None:
        """The pending evaluation (a pass beside training, or one to decode on the loop now), once
        its pass has finished (``wait``: wait for it), decided as :meth:`evaluate` decides;
        ``on_better`` gets the evaluated step's weights (the snapshot). Returns it and the pass's
        host waits; None where none is ready, or where ``interrupted()`` (a signal) cut the pass:
        then it stays pending, undecided (see :meth:`record`). ``stop()``: the loop's rule that cuts a
        pass decoded here on the loop (a resumed run's pending one, or one a signal cut), as
        :meth:`evaluate`'s."""
        if self.pending is None or (not wait and self.running):
            return None
        launched, weights, task = self.pending
        try:
            bleu, bleu_s, bleu_n = task.join(stop) if isinstance(task, Deferred) else task.join()
        finally:
            self.pending = None  # after the join: the pass asks `running` while it decodes
        if interrupted is not None and bleu is not None and bleu_n < len(self._pairs or ()) and interrupted():
            self.pending = (launched, weights, self._deferred(weights))
            return None
        better = self._decide(launched.step, launched.val_loss, bleu, bleu_n, len(self._pairs or ()))
        if better and on_better is not None:
            on_better(weights)
        done = dataclasses.replace(launched, bleu=bleu, bleu_s=bleu_s, bleu_n=bleu_n, better=better)
        return done, task.stats

    def _decide(self, step: int, val_loss: float, bleu: float | None, bleu_n: int, asked: int) -> bool:
        """best.pt and --patience: True where ``step``'s weights are the best so far."""
        cut = bleu is not None and bleu_n < asked
        # said at the end beside the mean; a pass cut short is not (its BLEU is on the longest sentences only)
        self.averager.scored(step, None if cut and self.stopper.metric == "bleu" else
                             bleu if self.stopper.metric == "bleu" else val_loss)
        if cut and self.stopper.metric == "bleu":
            # Not comparable with a full pass's BLEU: best.pt takes these weights only while no
            # full pass has set a best, and --patience does not count this evaluation.
            better = self.stopper.best is None
            self.log(f"eval: the end of the run (time limit or signal) cut the BLEU pass at {bleu_n} of {asked} dev "
                     f"sentences (the longest first): BLEU {bleu:.2f} on those, "
                     + ("best.pt until a full pass sets a best" if better else "not compared for best.pt"))
            return better
        if cut:
            self.log(f"eval: the end of the run (time limit or signal) cut the BLEU pass at {bleu_n} of {asked} "
                     f"dev sentences (the longest first): BLEU {bleu:.2f} on those")
        return self.stopper.update(bleu if self.stopper.metric == "bleu" else val_loss, step)

    def start_line(self) -> str:
        """What evaluation runs on, and the decoding copy's memory (made now, kept for the run)."""
        run = self.job.run
        if run.bleu_samples and self.device.type == "cuda":
            self.bleu_model = decoding_copy(self.model, self.bleu_dtype, self.bleu_model, separate=self.beside)
        copy_mb = 0.0
        if self.bleu_model is not None and self.bleu_model is not self.model:
            copy_mb = sum(p.numel() * p.element_size() for p in self.bleu_model.parameters()) / 2 ** 20
        snap_mb = sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) / 2 ** 20
        beside = ""
        if self.beside:
            beside = (f"; after the first, BLEU passes beside training (--async-eval; best.pt's weights copied at "
                      f"the evaluated step, {snap_mb:.0f} MiB)")
        elif run.bleu_samples and run.async_eval != "off" and (self.dist.active or self.device.type == "cuda"):
            why = "several ranks" if self.dist.active else "the training step is not captured"
            beside = f"; BLEU on the loop (--async-eval {run.async_eval}: {why})"
        every = self.cadence.every
        when = ("auto: when the training since the last evaluation reaches "
                f"{COST_RATIO:g}x its cost, and at the end" if every is None else
                f"every {every} steps and at epoch ends" if self.cadence.every else "at epoch ends")
        bleu = ("no BLEU" if not run.bleu_samples else
                f"BLEU of {run.bleu_samples} dev sentences, beam {run.beam_size}, "
                f"{str(self.bleu_dtype).removeprefix('torch.')} "
                + (f"CUDA graphs (decoding copy {copy_mb:.0f} MiB)" if self.options.graph else "eager"))
        return (f"eval: {when}; validation {'CUDA graphs' if self._captured else 'eager'}; {bleu}{beside}"
                + self.averager.start_note(self.model))

    # -- the parts ----------------------------------------------------------------------------
    def _nll(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            _, nll = self.loss_model(batch.src, batch.tgt_in, batch.tgt_out, segments=batch.segments())
        return nll.float(), (batch.tgt_out != masks.PAD).sum()

    @torch.no_grad()
    def validate(self) -> float:
        """Token-level validation loss (plain NLL, no label smoothing); sums stay on the device, one
        counted sync at the end."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        ntok = torch.zeros((), dtype=torch.int64, device=self.device)
        run = self._captured or self._nll
        for batch in self.dev_loader:
            nll, n = run(batch.to(self.device, non_blocking=True))
            total += nll.double()
            ntok += n
        self.model.train()
        # Needed: the validation loss is reported and compared for best.pt.
        return float(host_sync("eval.val_loss", lambda: (total / ntok.clamp(min=1)).item()))

    def score(self, stop: Callable[[], bool] | None = None) -> tuple[float, float, float | None, float, int, int]:
        """The model as it is, validated and scored on rank 0, nothing decided: validation loss, its
        seconds, BLEU, its seconds, the dev sentences scored and those a full pass scores (more
        where ``stop()`` cut the pass). :meth:`evaluate`'s measure, and --average-last's of its mean."""
        t0 = time.perf_counter()
        val_loss = self.validate()
        val_s = time.perf_counter() - t0
        bleu, bleu_s, bleu_n = self.bleu(stop)
        return val_loss, val_s, bleu, bleu_s, bleu_n, len(self._pairs or ())

    def bleu(self, stop: Callable[[], bool] | None = None) -> tuple[float | None, float, int]:
        """Dev BLEU, its seconds and the sentences it scored (fewer when ``stop()`` cut it)."""
        n = self.job.run.bleu_samples
        if n == 0:
            return None, 0.0, 0
        t0 = time.perf_counter()
        self.bleu_model = decoding_copy(self.model, self.bleu_dtype, self.bleu_model, separate=self.beside)
        bleu, _, bleu_n = self._decode(stop)
        return bleu, time.perf_counter() - t0, bleu_n

    def _decode(self, stop: Callable[[], bool] | None) -> tuple[float | None, float, int]:
        """The BLEU pass of the decoding copy as it is (on the loop or beside it)."""
        if self._pairs is None:
            self._pairs = read_pairs(self.job.data, "dev")[:self.job.run.bleu_samples]
        t0 = time.perf_counter()
        res = bleu_on_pairs(self.bleu_model, self.data.src_tok, self.data.tgt_tok, self._pairs, device=self.device,
                            beam_size=self.job.run.beam_size, batch_size=EVAL_BATCH,
                            tgt_lang=self.job.data.tgt_lang, options=self.options, pool=self.pool, stop=stop)
        self.passes += 1
        return res["bleu"], time.perf_counter() - t0, res["n"]

    def close(self) -> None:
        """The end of the run: the scoring workers exit (the caller collected any pass beside training)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.stopper.state_dict(), "cadence": self.cadence.state_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.stopper.load_state_dict(state)
        self.cadence.load_state_dict((state or {}).get("cadence"))
