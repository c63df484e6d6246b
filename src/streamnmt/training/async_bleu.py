"""The dev BLEU pass beside training (``--async-eval``, on by default on a GPU with one process in
graph mode).

On a small corpus the step is fast and a BLEU pass costs several epochs' worth of decoding; with
``--eval-every auto`` evaluation takes its rule's ~8-10 % of the run's wall clock on the loop
(docs/PERFORMANCE.md, "Evaluation and checkpoints in a run"). Decoding needs no gradients and no
random numbers, so it can run while training goes on:

* the loop drains, copies the weights into the decoding copy and into a :class:`Snapshot` (fp32,
  on the device, for best.pt), validates (the validation loss stays on the loop: its host sync
  also waits for those copies), and trains on;
* a thread (:class:`Beside`) decodes the dev sources from the decoding copy on a stream of its own,
  replaying the decoding graphs that the first evaluation captured on the loop and capturing none
  (:func:`streamnmt.inference.graph_search.replays_only`: a capture beside training replays is
  unsafe in torch 2.11); its host waits are counted apart from the loop's;
* the loop collects the result at a later step (it never waits for the pass, except at the end
  of the run or where ``--eval-every N`` is due again first); best.pt is then written from the
  snapshot, so it holds the evaluated step's weights.

Whether a replay that draws no random numbers beside a dropout graph's replay leaves its masks
alone (what this relies on) is tested on the GPU: tests/engine/test_replay_beside_gpu.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from streamnmt.syncstats import STATS, host_sync
from streamnmt.inference.graph_search import replays_only


class Snapshot:
    """A copy of a state dict in buffers kept for the run (allocated at the first :meth:`take`);
    tensors shared in the source (a tied embedding) stay shared."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Queue copies of ``state`` into the buffers (on the current stream) and return them."""
        out: dict[str, torch.Tensor] = {}
        seen: dict[tuple, torch.Tensor] = {}
        with torch.no_grad():
            for key, t in state.items():
                t = t.detach()
                ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                if ident in seen and t.numel():
                    out[key] = seen[ident]
                    continue
                buf = self._bufs.get(key)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                    buf = self._bufs[key] = torch.empty_like(t)
                buf.copy_(t)
                seen[ident] = out[key] = buf
        return out


class Beside:
    """``fn()`` once, on a thread of its own; on CUDA on ``stream`` (which the caller made wait for
    what ``fn`` reads), through captured decoding graphs only. :meth:`join` returns its result or
    raises its error on the caller's thread; :attr:`stats` are its host waits."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, stream: torch.cuda.Stream | None):
        self.result: Any = None
        self.error: BaseException | None = None
        self.stats: dict[str, dict[str, float]] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, device, stream), name="streamnmt-bleu-pass",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any], device: torch.device, stream: torch.cuda.Stream | None) -> None:
        try:
            with STATS.own() as sites, replays_only(), contextlib.ExitStack() as on:
                if stream is not None:
                    on.enter_context(torch.cuda.device(device))
                    on.enter_context(torch.cuda.stream(stream))
                try:
                    self.result = fn()
                finally:
                    if stream is not None:
                        # Needed: the loop rewrites the decoding copy at its next evaluation once
                        # this thread has ended; every kernel that reads it must have run by then.
                        host_sync("eval.beside", stream)
            self.stats = {site: s.as_dict() for site, s in sorted(sites.items())}
        except BaseException as e:  # noqa: BLE001 - raised on the loop's thread by join()
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Any:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result


class Deferred:
    """A BLEU pass that has not run: ``fn(stop)`` runs on the caller's thread at :meth:`join` (a
    resumed run's pending evaluation, or one a signal cut short), cut short where ``stop()`` says
    (the loop's rule: a signal, a time limit). Never running beside training."""

    done = True

    def __init__(self, fn: Callable[[Callable[[], bool] | None], Any]):
        self.fn = fn
        self.stats: dict[str, dict[str, float]] = {}

    def join(self, stop: Callable[[], bool] | None = None) -> Any:
        with STATS.own() as sites:
            result = self.fn(stop)
        self.stats = {site: s.as_dict() for site, s in sorted(sites.items())}
        return result
