"""Checkpoint writes that keep the training loop training: a copy to pinned memory, then a writer.

A base-model ``last.pt`` (weights, Adam's two moments, EMA) is most of a gigabyte; serialising
it, fsyncing it and renaming it takes seconds, which a synchronous save spends with the GPU idle.
Here the loop waits only for a copy of the state's device tensors into pinned host buffers,
issued on a side stream and waited on through one event; a writer thread then serialises the copy
(``torch.save``), fsyncs it and renames it over the target (:func:`streamnmt.checkpoint.save_checkpoint`),
so a kill at any moment leaves the previous file whole. At most one write is in flight: a save
that finds the writer busy waits for it first, and so do the end of the run, a stop (SIGTERM,
``--time-limit``, ``--patience``) and :meth:`Checkpointer.close`. The one exception is ema.pt
(:data:`OVERLAPS`): written at the end of a run, right after the last last.pt, and named by no other
file, it is written beside that last.pt instead of after it, so the end waits for the longer write
rather than for both.

Why a thread of our own and not ``torch.distributed.checkpoint.async_save`` (torchtitan's
choice): DCP writes a directory of shards with its own metadata, made for sharded models that
are loaded back by DCP on any number of ranks. A streamnmt checkpoint is one ``.pt`` file that
``torch.load(weights_only=True)`` reads anywhere, embeds its tokenizers, and is read by
translate, eval, export, average and ``--weights``; rank 0 holds the whole (replicated) state.
The staging half of DCP's design (pinned buffers reused between saves, one copy on a side
stream) is what saves the time, and it is kept here.

The pinned buffers are allocated on the first save of each kind and reused (pinning a gigabyte
costs more than copying it); they are rewritten only once the writer has finished with them.
``background=False`` (``--no-async-save``) writes on the calling thread, as before.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamnmt.checkpoint import (keep_step_copy, load_safetensors, safetensors_metadata, save_checkpoint,
                                  save_safetensors)
from streamnmt.errors import InputError
from streamnmt.syncstats import host_sync

# What best.pt and ema.pt keep: enough to translate, evaluate, export, average and start a run
# from (--weights); an exact resume needs last.pt alone, so best.pt skips the optimizer's moments.
WEIGHTS_KEYS = ("model", "model_shape", "tokenizers", "config", "step", "best")
# Kinds whose write may run beside a write of another kind. Not last.pt and best.pt: last.pt records
# which best.pt is on disk, so best.pt must have landed before the last.pt that names it.
OVERLAPS = ("ema",)


class Checkpointer:
    """Writes checkpoints of one run; rank 0 alone holds one (the other ranks write nothing)."""

    def __init__(self, device: torch.device, background: bool = True):
        self.device, self.background = device, background
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda and background else None  # made once
        self._pinned: dict[tuple, torch.Tensor] = {}  # staging buffers, by (kind, path in the state)
        # writes in flight, by kind: the thread and when it began (perf_counter). Replaced, never
        # changed in place: a BLEU pass's thread reads it (the run's time reserve, in_flight_s)
        self._threads: dict[str, tuple[threading.Thread, float]] = {}
        self._error: BaseException | None = None  # the first error of a write, raised on the loop
        self._lock = threading.Lock()  # two writers (OVERLAPS) record their seconds
        # how long the last write of each kind (last, best, ema) took on the writer (serialise,
        # fsync, rename): last.pt holds the optimizer's moments too, best.pt a third of that.
        # Replaced, never changed in place: a BLEU pass's thread reads it (the run's time reserve)
        # while the writer records a write.
        self.write_s: dict[str, float] = {}
        self.writes = 0

    # -- the loop's side ------------------------------------------------------------------------
    def save(self, path: Path, state: dict[str, Any], *, kind: str = "last", keep: int = 0, step: int = 0,
             then: Callable[[dict[str, Any]], None] | None = None) -> float:
        """Write ``state`` to ``path``; returns the seconds the caller waited.

        ``keep``: also keep the file as ``step_NNNNNN.pt`` with the ``keep`` newest such copies
        (``--keep-last``); ``then``: run on the writer with the written (host) state after the file is
        in place.
        """
        t0 = time.perf_counter()
        # at most one write in flight (one of an OVERLAPS kind aside): the staging buffers are free after this
        self.wait(kind if kind in OVERLAPS else None)
        if not self.background:
            # Needed: torch.save copies every device tensor to the host (callers drained the
            # streams first, so this waits for nothing queued, but it is a host-device sync).
            host_sync("checkpoint.save", lambda: self._write(kind, path, state, keep, step, then))
            return time.perf_counter() - t0
        staged = self._stage(kind, state)
        thread = threading.Thread(target=self._run, args=(kind, path, staged, keep, step, then),
                                  name=f"streamnmt-checkpoint-writer-{kind}", daemon=True)
        self._threads = {**self._threads, kind: (thread, time.perf_counter())}
        thread.start()
        return time.perf_counter() - t0

    def wait(self, kind: str | None = None) -> float:
        """Wait for the writes in flight (those of ``kind`` only, where given); re-raise an error of
        any write here. Returns the seconds waited."""
        t0 = time.perf_counter()
        for k in [kind] if kind is not None else list(self._threads):
            entry = self._threads.get(k)
            if entry is not None:
                entry[0].join()
                self._threads = {j: e for j, e in self._threads.items() if j != k}
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return time.perf_counter() - t0

    @property
    def busy(self) -> bool:
        return any(thread.is_alive() for thread, _ in self._threads.values())

    def in_flight_s(self) -> float:
        """Seconds the writes in flight have left, by the last write of their kind (of any kind where
        none of theirs has ended yet): what a write staged now waits for. The writes run side by side
        (an OVERLAPS kind beside another), so the longest of them."""
        now, threads, took = time.perf_counter(), self._threads, self.write_s  # each read once
        left = [max(took.get(kind, max(took.values(), default=0.0)) - (now - t0), 0.0)
                for kind, (thread, t0) in threads.items() if thread.is_alive()]
        return max(left, default=0.0)

    def close(self) -> float:
        """The end of the run: every write finished (or its error raised)."""
        return self.wait()

    # -- staging ------------------------------------------------------------------------------
    def _stage(self, kind: str, state: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state`` that training can no longer change: device tensors into pinned
        buffers on the side stream, host tensors cloned, containers rebuilt; shared tensors stay
        shared (a tied embedding is written once)."""
        seen: dict[tuple, torch.Tensor] = {}
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the state is final there
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            staged = self._copy(state, (kind,), seen)
        if self._stream is not None:
            done = torch.cuda.Event()
            done.record(self._stream)
            # Needed: the training's next step rewrites the weights and moments in place; their
            # copies must have landed in the pinned buffers first (one event, the copies only).
            host_sync("checkpoint.stage", done)
        return staged

    def _copy(self, obj: Any, where: tuple, seen: dict[tuple, torch.Tensor]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
            if ident in seen and t.numel():
                return seen[ident]
            if t.device.type == "cuda":
                buf = self._pinned.get(where)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._pinned[where] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                out = buf
            else:
                out = t.clone()
            seen[ident] = out
            return out
        if isinstance(obj, dict):
            return {k: self._copy(v, (*where, k), seen) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, (*where, i), seen) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj  # numbers, strings, bytes, None: immutable

    # -- the writer's side --------------------------------------------------------------------
    def _run(self, kind: str, path: Path, state: dict[str, Any], keep: int, step: int,
             then: Callable[[dict[str, Any]], None] | None) -> None:
        try:
            self._write(kind, path, state, keep, step, then)
        except BaseException as e:  # raised on the loop's thread at its next save or wait
            with self._lock:
                self._error = self._error or e

    def _write(self, kind: str, path: Path, state: dict[str, Any], keep: int, step: int,
               then: Callable[[dict[str, Any]], None] | None) -> None:
        t0 = time.perf_counter()
        save_checkpoint(path, state)
        if keep:
            keep_step_copy(path, step, keep)
        if then is not None:
            then(state)
        with self._lock:
            self.write_s = {**self.write_s, kind: time.perf_counter() - t0}
            self.writes += 1


def weights_only(state: dict[str, Any]) -> dict[str, Any]:
    """The part of a training state that best.pt and ema.pt keep (see :data:`WEIGHTS_KEYS`)."""
    return {k: state[k] for k in WEIGHTS_KEYS if k in state}


def remove_stale_temporaries(weights_dir: Path) -> None:
    """Temporary files of writes that a kill interrupted (the targets themselves are whole)."""
    for tmp in weights_dir.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def safetensors_beside(path: Path) -> Callable[[dict[str, Any]], None]:
    """A writer's follow-up: the weights of a checkpoint just written to ``path`` also as
    ``path.safetensors`` (for tools that read safetensors; the .pt file stays the reference), from
    the same staged state, tagged with the checkpoint's ``weights_id`` (see :func:`new_weights_id`)
    so that a kill between the two writes is found and repaired (:func:`repair_safetensors_beside`)."""
    def write(state: dict[str, Any]) -> None:
        _write_safetensors(path.with_suffix(".safetensors"), state)
    return write


def new_weights_id() -> str:
    """A fresh tag for one best.pt write, kept in best.pt and in best.safetensors' metadata."""
    return uuid.uuid4().hex


def _write_safetensors(path: Path, state: dict[str, Any]) -> None:
    save_safetensors(path, state["model"], {"model_shape": json.dumps(state["model_shape"]),
                                            "weights_id": str(state.get("weights_id") or "")})


def repair_safetensors_beside(pt: Path, log: Callable[[str], None]) -> bool:
    """Make ``pt``'s .safetensors hold ``pt``'s weights where a kill came between the two writes
    (best.pt is written first: the .safetensors file is then missing or an older model's). The tags
    decide; a best.pt without one (an earlier version) is compared tensor by tensor. Returns
    whether the file was rewritten."""
    st = pt.with_suffix(".safetensors")
    if not pt.is_file():
        return False
    try:
        ckpt = torch.load(pt, map_location="cpu", weights_only=True, mmap=True)
        model, want = ckpt["model"], ckpt.get("weights_id")
    except Exception:  # noqa: BLE001 - an unreadable best.pt: nothing to repair from (last.pt is whole)
        return False
    if st.is_file():
        try:
            have = safetensors_metadata(st).get("weights_id")
            if want and have == want:
                return False
            if not want:
                tensors = load_safetensors(st)
                if tensors.keys() == model.keys() and all(torch.equal(tensors[k], model[k]) for k in model):
                    return False
        except (InputError, OSError, ValueError):
            pass  # a torn or foreign file: rewritten
    _write_safetensors(st, {**ckpt, "model": {k: v.contiguous() for k, v in model.items()}})
    log(f"{st}: did not hold {pt.name}'s weights (a kill between the two writes); rewritten from {pt.name}")
    return True
