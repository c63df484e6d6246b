"""Decoding at serving speed: the search step of :mod:`streamnmt.inference.search` in CUDA graphs.

The eager search launches about a hundred small kernels per token and the GPU, in bf16 above all,
mostly waits for them. Here the whole per-token step of :class:`streamnmt.inference.search.StaticSearch`
(decoder on its preallocated :class:`~streamnmt.inference.search.StaticCache`, and the search bookkeeping)
is captured once in a CUDA graph and replayed: one launch per token. It is the same search the
eager path runs, so the two give the same results.

* Buckets: a batch is decoded in a bucket of (rows, beam, source width, output width). Rows round
  up to a power of two (at most the batch size), source widths to a few coarse sizes (8, 12, 16,
  24, 32, 48, ... each 1.5x or 4/3 the one before), and the output width follows from the source
  width, so a file or a test set sorted by length needs a few buckets, not one per batch; padding
  rows start finished, padding source positions are masked. A batch runs in the narrowest kept
  bucket of its rows and beam whose source width is from its own to twice it, so a test set sorted
  longest first captures its first batch's bucket and reuses it. A bucket holds one graph per key span
  and beam parity: the step at position t reads only the first t + 1 key slots rounded up to
  ``decode.SPAN``,
  and the beam reorder alternates between two sets of key/value buffers (even steps gather from
  the first set into the second, odd steps back). Graphs share one memory pool; the least recently
  used bucket is dropped beyond ``max_buckets``.
* One decoder per process: :func:`shared_decoder` keeps the :class:`GraphDecoder` of a model and
  search settings, so ``translate``, ``eval`` and the trainer's BLEU pass capture each bucket once
  per process, not once per call.
* Whether every sentence has finished is a device flag. Every few steps the host queues a copy of
  it to pinned memory and waits (``host_sync``) on the copy queued at the previous check, so the
  GPU always has an interval of replays queued; at most two intervals of steps are wasted.

The encoder runs eagerly once per batch, at the source width of the bucket that decodes it. On
the CPU :class:`GraphDecoder` runs the same bucketed step eagerly (tested against the eager search
there). A failed capture is reported in one line and that batch shape decoded eagerly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import sdpa_kernel

from streamnmt.models import masks
from streamnmt.inference.decoding import SearchOptions, sync_interval
from streamnmt.inference.search import DECODE_ATTENTION, SPAN, StaticSearch, check_search, output_limits, search_scored
from streamnmt.inference.search import translate_ids as translate_ids_eager
from streamnmt.inference.staticcache import StaticCache
from streamnmt.errors import one_line
from streamnmt.syncstats import host_sync
from streamnmt.models.transformer import Transformer

__all__ = ["BucketKey", "GraphDecoder", "SPAN", "StaticCache", "replays_only", "shared_decoder", "source_bucket",
           "translate_ids"]
WARMUP_STEPS = 2  # eager steps on a side stream before a capture (lazy initialisations); even: see _capture
MAX_SHARED = 4  # decoders kept by shared_decoder (models x search settings)


_LOCAL = threading.local()


@contextlib.contextmanager
def replays_only() -> Iterator[None]:
    """On this thread, for the body of the ``with``: decode through buckets already captured only; a
    batch that no kept bucket covers is decoded eagerly. For decoding beside another thread's graph
    replays (the trainer's BLEU pass beside training): a capture puts the process in capture mode
    (the default CUDA generator's capture flag is process-wide in torch 2.11), which the other
    thread's replays would meet."""
    _LOCAL.replays_only = True
    try:
        yield
    finally:
        _LOCAL.replays_only = False


def source_bucket(s: int, max_positions: int) -> int:
    """Source width ``s`` rounded up to the next coarse size: 8, 12, 16, 24, 32, 48, 64, ..."""
    size = 8
    while size < s:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 8 -> 12 -> 16 -> 24 -> 32 ...
    return min(size, max_positions)


@dataclass(frozen=True)
class BucketKey:
    rows: int  # sentences (padded)
    beam: int  # 1 = greedy
    src_width: int  # source tokens (padded)
    width: int  # decoding steps the buffers hold (max steps + 1)


class _Bucket(StaticSearch):
    """The static search of one bucket and (on CUDA) its captured steps."""

    def __init__(self, model: Transformer, key: BucketKey, opts: SearchOptions, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(model, key.rows, key.beam, key.src_width, key.width, opts, dtype, device)
        self.key = key
        self.spans = list(range(SPAN, key.width, SPAN)) + [key.width]  # key slots read per step
        self.parities = (0,) if self.greedy else (0, 1)  # the beam reorder swaps two buffer sets
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (span, parity) -> captured step

    def graph(self, t: int) -> torch.cuda.CUDAGraph:
        return self.graphs[(self.span(t), t % len(self.parities))]


def _round_rows(b: int, batch_size: int) -> int:
    pow2 = 1 << (b - 1).bit_length()
    return min(pow2, batch_size) if b <= batch_size else pow2


class GraphDecoder:
    """Greedy or beam search (``opts.beam_size``) with the static step, in CUDA graphs on CUDA.

    Keep one per model and search settings (:func:`shared_decoder` does): its graphs are reused
    across batches and calls. The model must stay where it is (the graphs hold its weights'
    addresses; in-place weight updates are seen, a ``.to()`` is noticed and the graphs are dropped).
    """

    def __init__(self, model: Transformer, opts: SearchOptions = SearchOptions(), *, batch_size: int = 64,
                 max_buckets: int = 8, log: Callable[[str], None] | None = None):
        self.model, self.opts, self.batch_size, self.max_buckets = model, opts, batch_size, max_buckets
        self.log = log or (lambda message: print(message, file=sys.stderr))
        self.buckets: OrderedDict[BucketKey, _Bucket] = OrderedDict()
        self.pool = None
        self.captures = 0
        self._flags: list[Tensor] = []  # pinned host copies of the all-finished flag
        self.failed: set[BucketKey] = set()  # buckets whose capture failed: decoded eagerly
        self._weights: tuple[int, ...] = ()
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # warm-up, capture

    def search(self, src: Tensor) -> list[list[int]]:
        return self.search_scored(src)[0]  # (B, S) padded source ids -> B output id lists

    @torch.inference_mode()
    @sdpa_kernel(DECODE_ATTENTION)
    def search_scored(self, src: Tensor) -> tuple[list[list[int]], list[float] | None]:
        """(B, S) padded source ids -> (output id lists, beam scores (None for greedy))."""
        model, opts, k = self.model, self.opts, self.opts.beam_size
        check_search(model, k)
        b, s = src.shape
        # 1. bucket: as the eager search, the loop bound comes from the padded width (a host value)
        max_steps, limits = output_limits(model, src, opts)
        cap = model.shape.max_positions - 1
        s_pad = source_bucket(s, model.shape.max_positions)
        width = min(max(int(opts.max_len_a * s_pad + opts.max_len_b), 1), cap) + 1
        key = BucketKey(_round_rows(b, self.batch_size), k, s_pad, width)
        # 2. encode once (eagerly), at the source width of the bucket that will decode the batch
        # (a kept, covering one where there is one): the encoder and the cross-attention
        # projections then run at one shape per bucket, not one per coarse batch width (each new
        # shape costs a fresh process kernel loads and matrix-multiply set-up; the padding is masked)
        self._check_weights()
        cover = self._covering(key)
        s_enc = cover.src_width if cover is not None else s_pad
        wide = F.pad(src, (0, s_enc - s), value=masks.PAD)
        src_mask = masks.src_mask(wide)  # (B, 1, 1, S')
        mem = model.encode(wide, src_mask)  # (B, S', D)
        bucket = self._bucket(key, cover, mem.dtype, src.device)
        if bucket is None:  # capture failed (or replays only): this batch takes the eager path
            return search_scored(model, src, opts, k, greedy=k == 1)
        bucket.load(mem, src_mask, limits)
        # 3. replay until every sentence has finished
        self._run(bucket, max_steps, opts.sync_every or sync_interval(src.device))
        return bucket.results(b)

    # -- buckets and graphs ----------------------------------------------------------------------
    def _check_weights(self) -> None:
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self._weights:  # moved or reloaded: the graphs would read stale addresses
            self.buckets.clear()
            self._weights = weights

    def _bucket(self, key: BucketKey, cover: BucketKey | None, dtype: torch.dtype,
                device: torch.device) -> _Bucket | None:
        """The kept bucket ``cover`` (from :meth:`_covering`, after :meth:`_check_weights`), else a
        new one for ``key``, captured on CUDA; None where its capture failed."""
        if cover is not None:
            self.buckets.move_to_end(cover)
            return self.buckets[cover]
        if key in self.failed or (device.type == "cuda" and getattr(_LOCAL, "replays_only", False)):
            return None
        bucket = _Bucket(self.model, key, self.opts, dtype, device)
        if device.type == "cuda":
            try:
                self._capture(bucket, device)
            except (RuntimeError, NotImplementedError) as e:
                self.log(f"decode: CUDA graph capture failed ({one_line(e)}); decoding this batch shape eagerly")
                self.failed.add(key)
                # Needed: the failed capture's work must be finished before eager decoding starts.
                host_sync("decode.capture", lambda: torch.cuda.synchronize(device))
                return None
        self.buckets[key] = bucket
        while len(self.buckets) > self.max_buckets:
            self.buckets.popitem(last=False)
        return bucket

    def _covering(self, key: BucketKey) -> BucketKey | None:
        """The narrowest kept bucket that can decode a batch of ``key``: the same rows and beam, and
        a source width from ``key``'s to twice it (its output width follows). Translation sorts
        sentences longest first, so the first batch's bucket serves the narrower ones after it:
        a test set of 20-40 token sentences captures one bucket, not three, and its shorter batches
        attend over at most twice their own source width (padding masked)."""
        fits = [k for k in self.buckets if k.rows == key.rows and k.beam == key.beam
                and key.src_width <= k.src_width <= 2 * key.src_width and k.width >= key.width]
        return min(fits, key=lambda k: (k.src_width, k.width)) if fits else None

    def _capture(self, bucket: _Bucket, device: torch.device) -> None:
        """Warm up, then capture the step once per span and parity; all graphs share one memory pool.

        A beam step swaps the cache's two buffer sets (on the host: which tensors the next step
        reads); capturing parity 0 then parity 1 of a span, like an even number of warm-up steps,
        leaves them as they were, so every graph of parity 0 reads the same set."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # Warm-up steps run on zeroed buffers (each batch's load() resets the state anyway).
        bucket.cache.src_mask[..., 0] = True
        if self._streams is None:  # made once: each capture reuses them (and their cuBLAS workspaces)
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        side, stream = self._streams
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for span in bucket.spans:
                for _ in range(WARMUP_STEPS):
                    bucket.cache.pos.zero_()
                    bucket.t.zero_()
                    bucket.step(span)
            bucket.cache.pos.zero_()
            bucket.t.zero_()
        torch.cuda.current_stream(device).wait_stream(side)  # load() overwrites what warm-up wrote
        stream.wait_stream(side)
        # capture_begin/capture_end rather than ``with torch.cuda.graph(...)``: the context manager
        # synchronizes the device and empties the allocator's cache before every capture (to free
        # memory for it), a host wait and a round of cudaFree/cudaMalloc per graph that a bucket
        # of several graphs, captured in a process that then decodes at once, does not need.
        with torch.cuda.stream(stream):
            for span in bucket.spans:
                for parity in bucket.parities:
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self.pool)
                    try:
                        bucket.step(span)
                    finally:
                        graph.capture_end()
                    bucket.graphs[(span, parity)] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        self.captures += 1

    def _run(self, bucket: _Bucket, max_steps: int, every: int) -> None:
        """Steps 0..max_steps, stopping early once every sentence has finished."""
        on_cuda = bool(bucket.graphs)
        pending: tuple[torch.cuda.Event, Tensor] | None = None
        if on_cuda and not self._flags:
            self._flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
        flags = self._flags
        for t in range(max_steps + 1):
            if on_cuda:
                bucket.graph(t).replay()
            else:
                bucket.step(bucket.span(t))
            if (t + 1) % every or t == max_steps:
                continue
            if not on_cuda:
                # Needed: the host decides whether to run another step (free on the CPU).
                if host_sync("decode.retire", lambda: bool(bucket.all_done)):
                    return
                continue
            # Queue this check's flag copy; wait for the previous one (long done, normally), so
            # the GPU keeps an interval of replays queued while the host looks.
            flag = flags[(t + 1) // every % 2]
            flag.copy_(bucket.all_done, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            if pending is not None:
                # Needed: the host must know whether every sentence has finished to stop replaying.
                host_sync("decode.retire", pending[0])
                if bool(pending[1]):  # pinned host memory, written by the copy the event guards
                    return
            pending = (event, flag)


_SHARED: OrderedDict[tuple[int, SearchOptions, int], GraphDecoder] = OrderedDict()


def shared_decoder(model: Transformer, opts: SearchOptions, batch_size: int) -> GraphDecoder:
    """This process's :class:`GraphDecoder` for ``model`` and these settings (made on first use;
    the :data:`MAX_SHARED` most recently used are kept), so that its captured buckets serve every
    later call: a second file, the next test set, the next epoch's BLEU pass."""
    key = (id(model), opts, batch_size)
    decoder = _SHARED.get(key)
    if decoder is None or decoder.model is not model:  # an id can be reused by a new model
        decoder = _SHARED[key] = GraphDecoder(model, opts, batch_size=batch_size)
    _SHARED.move_to_end(key)
    while len(_SHARED) > MAX_SHARED:
        _SHARED.popitem(last=False)
    return decoder


def translate_ids(model: Transformer, sources: list[list[int]], opts: SearchOptions = SearchOptions(), *,
                  batch_size: int = 64, device: torch.device | str = "cpu",
                  decoder: GraphDecoder | None = None,
                  on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
                  stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """:func:`streamnmt.inference.search.translate_ids` through a :class:`GraphDecoder` when ``opts.graph``
    and ``device`` is CUDA (``decoder``, or this process's shared one for the model and settings);
    otherwise the eager search. ``on_batch`` and ``stop`` as there."""
    if not opts.graph or torch.device(device).type != "cuda":
        return translate_ids_eager(model, sources, opts, batch_size=batch_size, device=device, on_batch=on_batch,
                                   stop=stop)
    decoder = decoder or shared_decoder(model, opts, batch_size)
    return translate_ids_eager(model, sources, opts, batch_size=batch_size, device=device,
                               search_fn=decoder.search, on_batch=on_batch, stop=stop)
