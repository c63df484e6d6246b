"""Decoding at serving speed: a preallocated key/value cache and the search step in CUDA graphs.

The eager cached search (:mod:`streamnmt.decode`) launches about a hundred small kernels per token
and the GPU, in bf16 above all, mostly waits for them. Here the whole per-token step (decoder and
search bookkeeping) is captured once in a CUDA graph and replayed: one launch per token.

What makes the step capturable:

* :class:`StaticCache`: the decoder's self-attention keys/values live in buffers of a fixed
  width, written at a position held on the device (``index_copy_``, no ``cat``, no reallocation)
  and read through the mask ``key position <= pos``. The cross-attention keys/values of the
  encoder output are projected once per batch. It offers :class:`streamnmt.model.DecoderCache`'s
  methods, so :meth:`Transformer.decode_step` runs on it unchanged.
* The search state (tokens, scores, histories, finished pools, the step counter) is a set of
  fixed-shape tensors; the steps of ``decode.greedy_search`` / ``decode.beam_search`` are written
  again with fixed shapes. Rows are never removed: a finished sentence keeps running, its result
  frozen (as the eager search freezes it), so results do not depend on when the host looks.
* One bucket per (rows, beam, source width): rows round up to a power of two (at most the batch
  size), source widths to a multiple of 8; padding rows start finished. A bucket holds one graph
  per key span: the step at position t reads and reorders only the first t + 1 key slots rounded
  up to 16, so early steps do not pay for the full width. Graphs share one memory pool; the least
  recently used bucket is dropped beyond ``max_buckets``.
* Whether every sentence has finished is a device flag. Every few steps the host queues a copy of
  it to pinned memory and waits (``host_sync``) on the copy queued at the previous check, so the
  GPU always has an interval of replays queued; at most two intervals of steps are wasted.

The encoder runs eagerly once per batch. On the CPU :class:`GraphDecoder` runs the same static
step eagerly (tested against today's decoder there); ``streamnmt translate`` on the CPU keeps the
eager search. A failed capture is reported in one line and that batch shape decoded eagerly.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from streamnmt import masks
from streamnmt.decode import (DECODE_ATTENTION, NEG_INF, SearchOptions, _unpad, beam_search_scored, greedy_search,
                              length_penalty, sync_interval)
from streamnmt.decode import translate_ids as translate_ids_eager
from streamnmt.engine.syncstats import host_sync
from streamnmt.model import Transformer

SRC_MULTIPLE = 8  # source widths round up to this (fewer graphs; padding keys are masked)
SPAN = 16  # self-attention keys read per step round up to this (one graph per span; see StaticCache)
WARMUP_STEPS = 2  # eager steps on a side stream before a capture (lazy initialisations)


class StaticCache:
    """Fixed-width decoder cache of ``n`` rows: self-attention K/V written at the device position
    ``pos``, cross-attention K/V of a source ``src_width`` wide. Same methods as DecoderCache.

    ``span`` (a host value, fixed per captured graph) is how many leading key slots a step reads
    and reorders: the step at position t needs t + 1, so steps use the buffers' first 16, 32, ...
    slots, and the early steps of a long output do not pay for its full width.
    """

    def __init__(self, model: Transformer, n: int, src_width: int, width: int, dtype: torch.dtype,
                 device: torch.device):
        s = model.shape
        heads, dk = s.n_heads, s.d_model // s.n_heads
        kw = dict(dtype=dtype, device=device)
        self.k = [torch.zeros(n, heads, width, dk, **kw) for _ in model.decoder]  # (N, h, W, dk) per layer
        self.v = [torch.zeros(n, heads, width, dk, **kw) for _ in model.decoder]
        self.mk = [torch.zeros(n, heads, src_width, dk, **kw) for _ in model.decoder]  # (N, h, S, dk)
        self.mv = [torch.zeros(n, heads, src_width, dk, **kw) for _ in model.decoder]
        self.src_mask = torch.zeros(n, 1, 1, src_width, dtype=torch.bool, device=device)  # (N, 1, 1, S)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # positions decoded so far
        self.keys = torch.arange(width, device=device)  # (W,) position of each key slot
        self.span = width  # key slots the next step reads (must exceed pos)

    def load(self, model: Transformer, mem: Tensor, src_mask: Tensor, index: Tensor) -> None:
        """Cross-attention K/V of ``mem`` (B, S, D) for rows ``index`` (n,): row r is sentence
        index[r]; rows past n attend to one zero key. Clears the self-attention K/V."""
        n, s = index.numel(), mem.size(1)
        for i, layer in enumerate(model.decoder):
            mk, mv = layer.cross_attn.project_kv(mem)  # 2 x (B, h, S, dk)
            for dst, src in ((self.mk[i], mk), (self.mv[i], mv)):
                dst.zero_()
                dst[:n, :, :s] = src.index_select(0, index)
            self.k[i].zero_()  # masked slots are multiplied by 0: they must hold no NaN
            self.v[i].zero_()
        self.src_mask.zero_()
        self.src_mask[:n, :, :, :s] = src_mask.index_select(0, index)
        self.src_mask[n:, :, :, 0] = True  # padding rows: one visible key (see masks.py)
        self.pos.zero_()

    # -- DecoderCache's interface ------------------------------------------------------------
    def append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ks, vs = self.k[i][:, :, :self.span], self.v[i][:, :, :self.span]  # views (N, h, span, dk)
        ks.index_copy_(2, self.pos.view(1), k)  # (N, h, 1, dk) into slot pos
        vs.index_copy_(2, self.pos.view(1), v)
        return ks, vs, (self.keys[:self.span] <= self.pos)[None, None, None]  # mask (1, 1, 1, span)

    def memory(self, i: int) -> tuple[Tensor, Tensor]:
        return self.mk[i], self.mv[i]

    def advance(self) -> None:
        self.pos.add_(1)

    def reorder(self, index: Tensor) -> None:
        """Beam reordering of the self-attention K/V (the cross-attention K/V are the same for
        every hypothesis of a sentence, and hypotheses never move to another sentence)."""
        for buf in (*self.k, *self.v):
            used = buf[:, :, :self.span]
            used.copy_(used.index_select(0, index))


@dataclass(frozen=True)
class BucketKey:
    rows: int  # sentences (padded)
    beam: int  # 1 = greedy
    src_width: int  # source tokens (padded)
    width: int  # decoding steps the buffers hold (max steps + 1)


class _Bucket:
    """Static cache, search state and (on CUDA) the captured step of one bucket."""

    def __init__(self, model: Transformer, key: BucketKey, opts: SearchOptions, dtype: torch.dtype,
                 device: torch.device):
        r, k, w, v = key.rows, key.beam, key.width, model.shape.tgt_vocab
        self.key, self.model = key, model
        self.spans = list(range(SPAN, key.width, SPAN)) + [key.width]  # key slots read per step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # span -> captured step
        self.cache = StaticCache(model, r * k, key.src_width, w, dtype, device)
        dev = dict(device=device)
        self.t = torch.zeros((), dtype=torch.long, **dev)  # the step being decoded
        self.y = torch.full((r * k,), masks.BOS, dtype=torch.long, **dev)  # (N,) newest tokens
        self.limits = torch.ones(r, dtype=torch.long, **dev)  # (R,) EOS forced from this step on
        self.done = torch.zeros(r, dtype=torch.bool, **dev)  # (R,) sentence finished
        self.all_done = torch.zeros((), dtype=torch.bool, **dev)
        self.cols = torch.arange(w, **dev)  # (W,)
        if k == 1:
            self.out = torch.full((r, w), masks.PAD, dtype=torch.long, **dev)  # (R, W) tokens
            return
        self.scores = torch.zeros(r, k, **dev)  # (R, k) summed log-probs of live hypotheses
        self.hist = torch.zeros(r, k, w, dtype=torch.long, **dev)  # (R, k, W) their tokens
        self.pool_score = torch.zeros(r, k, **dev)  # (R, k) finished, normalised, best first
        self.pool_tok = torch.zeros(r, k, w, dtype=torch.long, **dev)  # (R, k, W)
        self.pool_n = torch.zeros(r, dtype=torch.long, **dev)  # (R,) hypotheses that entered the pool
        self.vocab = torch.arange(v, **dev)
        self.first_k = torch.arange(2 * k, **dev) < k  # (2k,)
        self.row_base = torch.arange(r, **dev)[:, None] * k  # (R, 1) first hypothesis row of a sentence
        # Length normalisation per step, as the eager search computes it: a float32 tensor divided
        # by a Python float divides on the CPU and multiplies by the float32 reciprocal on CUDA.
        lp = torch.tensor([length_penalty(t + 1, opts.len_penalty) for t in range(w)], dtype=torch.float32)
        lp = lp.reciprocal() if device.type == "cuda" else lp
        # From pinned memory the copy is asynchronous (no host wait).
        self.lp = lp.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else lp  # (W,)

    # -- per batch -----------------------------------------------------------------------------
    def load(self, mem: Tensor, src_mask: Tensor, limits: Tensor) -> None:
        """Start a batch of ``limits.numel()`` sentences (the rest are padding, finished at once)."""
        b, k = limits.numel(), self.key.beam
        self.cache.load(self.model, mem, src_mask, torch.arange(b * k, device=mem.device) // k)
        self.t.zero_()
        self.y.fill_(masks.BOS)
        self.limits.fill_(1)
        self.limits[:b] = limits
        self.done.fill_(True)
        self.done[:b] = False
        self.all_done.fill_(False)
        if k == 1:
            self.out.fill_(masks.PAD)
            return
        self.scores.fill_(NEG_INF)
        self.scores[:, 0] = 0.0  # the k rows start as copies: only the first may be extended at step 0
        self.hist.zero_()
        self.pool_score.fill_(NEG_INF)
        self.pool_tok.fill_(masks.PAD)
        self.pool_n.zero_()

    def span(self, t: int) -> int:
        """Key slots the step at position ``t`` reads: t + 1 rounded up to a multiple of SPAN."""
        return min(-(-(t + 1) // SPAN) * SPAN, self.key.width)

    def step(self, span: int) -> None:
        """One token for every row, reading ``span`` key slots; fixed shapes, no host sync (capturable)."""
        self.cache.span = span
        (self._greedy_step if self.key.beam == 1 else self._beam_step)()
        self.t.add_(1)

    def _greedy_step(self) -> None:
        logp = self.model.decode_step(self.y, self.cache.src_mask, self.cache)  # (R, V)
        y = logp.argmax(-1).masked_fill(self.t >= self.limits, masks.EOS)  # (R,)
        self.out.index_copy_(1, self.t.view(1), y[:, None])  # tokens after a row's first EOS are cut later
        self.done |= y == masks.EOS
        self.all_done.copy_(self.done.all())
        self.y.copy_(y)

    def _beam_step(self) -> None:
        r, k, w, v = self.key.rows, self.key.beam, self.key.width, self.model.shape.tgt_vocab
        t = self.t
        # 1. scores of all k*V extensions; EOS forced at the sentence's length limit
        logp = self.model.decode_step(self.y, self.cache.src_mask, self.cache).view(r, k, v)  # (R, k, V)
        forced = (t >= self.limits)[:, None, None] & (self.vocab != masks.EOS)  # (R, 1, V)
        cand = (self.scores[:, :, None] + logp.masked_fill(forced, NEG_INF)).view(r, k * v)
        top, idx = cand.topk(2 * k)  # (R, 2k)
        origin, tok = idx // v, idx % v  # (R, 2k) hypothesis extended, token appended
        eos = tok == masks.EOS

        # 2. EOS extensions among the first k enter the pool of sentences not yet done
        fin = eos & self.first_k & ~self.done[:, None] & (top > NEG_INF)  # (R, 2k)
        fin_tok = self.hist.gather(1, origin[:, :, None].expand(r, 2 * k, w))  # (R, 2k, W)
        fin_tok = fin_tok.masked_fill(self.cols >= t, masks.PAD).masked_fill(self.cols == t, masks.EOS)
        lp = self.lp.index_select(0, t.view(1))  # (1,)
        norm = top * lp if self.lp.is_cuda else top / lp
        merged = torch.cat([self.pool_score, torch.where(fin, norm, NEG_INF)], 1)  # (R, 3k)
        pool_score, j = merged.topk(k)  # (R, k), best first
        self.pool_tok.copy_(torch.cat([self.pool_tok, fin_tok], 1).gather(1, j[:, :, None].expand(r, k, w)))
        self.pool_score.copy_(pool_score)
        self.pool_n.add_(fin.sum(1))
        self.done |= self.pool_n >= k
        self.all_done.copy_(self.done.all())

        # 3. the best k non-EOS extensions live on; reorder the decoder state to follow them
        scores, j = top.masked_fill(eos, NEG_INF).topk(k)  # (R, k)
        origin, tok = origin.gather(1, j), tok.gather(1, j)  # (R, k)
        hist = self.hist.gather(1, origin[:, :, None].expand(r, k, w))
        self.hist.copy_(hist.index_copy_(2, t.view(1), tok[:, :, None]))  # (R, k, W), column t = tok
        self.scores.copy_(scores)
        self.cache.reorder((self.row_base + origin).view(-1))
        self.y.copy_(tok.view(-1))

    def results(self, b: int) -> tuple[list[list[int]], list[float] | None]:
        """Output ids (and beam scores) of the first ``b`` rows."""
        if self.key.beam == 1:
            # Needed: the ids go to the tokenizer.
            return _unpad(host_sync("decode.result", lambda: self.out[:b].tolist())), None
        out = torch.where(self.done[:b, None], self.pool_tok[:b, 0], masks.PAD)
        score = torch.where(self.done[:b], self.pool_score[:b, 0], NEG_INF)
        # Needed: the ids go to the tokenizer.
        ids, best = host_sync("decode.result", lambda: (out.tolist(), score.tolist()))
        return _unpad(ids), best


def _round_rows(b: int, batch_size: int) -> int:
    pow2 = 1 << (b - 1).bit_length()
    return min(pow2, batch_size) if b <= batch_size else pow2


class GraphDecoder:
    """Greedy or beam search (``opts.beam_size``) with the static step, in CUDA graphs on CUDA.

    Keep one per model and search settings: its graphs are reused across batches and calls. The
    model must stay where it is (the graphs hold its weights' addresses; in-place weight updates
    are seen, a ``.to()`` is noticed and the graphs are dropped).
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

    def search(self, src: Tensor) -> list[list[int]]:
        return self.search_scored(src)[0]  # (B, S) padded source ids -> B output id lists

    @torch.inference_mode()
    @sdpa_kernel(DECODE_ATTENTION)
    def search_scored(self, src: Tensor) -> tuple[list[list[int]], list[float] | None]:
        """(B, S) padded source ids -> (output id lists, beam scores (None for greedy))."""
        model, opts, k = self.model, self.opts, self.opts.beam_size
        if model.training:
            raise ValueError("decoding needs model.eval(): dropout would perturb the search")
        v = model.shape.tgt_vocab
        if not 1 <= k <= v // 2:
            raise ValueError(f"beam_size must be between 1 and half the target vocabulary ({v // 2}); got {k}")
        b, s = src.shape
        cap = model.shape.max_positions - 1
        if s > model.shape.max_positions:
            raise ValueError(f"source of {s} tokens is longer than the model's {model.shape.max_positions} positions")
        # 1. bucket: as the eager search, the loop bound comes from the padded width (a host value)
        max_steps = min(max(int(opts.max_len_a * s + opts.max_len_b), 1), cap)
        s_pad = min(-(-s // SRC_MULTIPLE) * SRC_MULTIPLE, model.shape.max_positions)
        width = min(max(int(opts.max_len_a * s_pad + opts.max_len_b), 1), cap) + 1
        key = BucketKey(_round_rows(b, self.batch_size), k, s_pad, width)
        # 2. encode once (eagerly); per-sentence limits on the device
        src_mask = masks.src_mask(src)  # (B, 1, 1, S)
        mem = model.encode(src, src_mask)  # (B, S, D)
        lens = (src != masks.PAD).sum(1)  # (B,)
        limits = (lens * opts.max_len_a + opts.max_len_b).floor().long().clamp(1, max_steps)  # (B,)
        bucket = self._bucket(key, mem.dtype, src.device)
        if bucket is None:  # capture failed: this batch takes the eager path
            if k == 1:
                return greedy_search(model, src, opts), None
            return beam_search_scored(model, src, opts)
        bucket.load(mem, src_mask, limits)
        # 3. replay until every sentence has finished
        self._run(bucket, max_steps, opts.sync_every or sync_interval(src.device))
        return bucket.results(b)

    # -- buckets and graphs ----------------------------------------------------------------------
    def _bucket(self, key: BucketKey, dtype: torch.dtype, device: torch.device) -> _Bucket | None:
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self._weights:  # moved or reloaded: the graphs would read stale addresses
            self.buckets.clear()
            self._weights = weights
        if key in self.buckets:
            self.buckets.move_to_end(key)
            return self.buckets[key]
        if key in self.failed:
            return None
        bucket = _Bucket(self.model, key, self.opts, dtype, device)
        if device.type == "cuda":
            try:
                self._capture(bucket, device)
            except (RuntimeError, NotImplementedError) as e:
                msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                self.log(f"decode: CUDA graph capture failed ({msg}); decoding this batch shape eagerly")
                self.failed.add(key)
                # Needed: the failed capture's work must be finished before eager decoding starts.
                host_sync("decode.capture", lambda: torch.cuda.synchronize(device))
                return None
        self.buckets[key] = bucket
        while len(self.buckets) > self.max_buckets:
            self.buckets.popitem(last=False)
        return bucket

    def _capture(self, bucket: _Bucket, device: torch.device) -> None:
        """Warm up, then capture the step once per span; all graphs share one memory pool."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # Warm-up steps run on zeroed buffers (each batch's load() resets the state anyway).
        bucket.cache.src_mask[..., 0] = True
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for span in bucket.spans:
                for _ in range(WARMUP_STEPS):
                    bucket.cache.pos.zero_()
                    bucket.t.zero_()
                    bucket.step(span)
            bucket.cache.pos.zero_()
            bucket.t.zero_()
        torch.cuda.current_stream(device).wait_stream(side)
        stream = torch.cuda.Stream(device)
        for span in bucket.spans:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                bucket.step(span)
            bucket.graphs[span] = graph
        self.captures += 1

    def _run(self, bucket: _Bucket, max_steps: int, every: int) -> None:
        """Steps 0..max_steps, stopping early once every sentence has finished."""
        on_cuda = bool(bucket.graphs)
        pending: tuple[torch.cuda.Event, Tensor] | None = None
        if on_cuda and not self._flags:
            self._flags = [torch.zeros((), dtype=torch.bool, pin_memory=True) for _ in range(2)]
        flags = self._flags
        for t in range(max_steps + 1):
            span = bucket.span(t)
            if on_cuda:
                bucket.graphs[span].replay()
            else:
                bucket.step(span)
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


def translate_ids(model: Transformer, sources: list[list[int]], opts: SearchOptions = SearchOptions(), *,
                  batch_size: int = 64, device: torch.device | str = "cpu",
                  decoder: GraphDecoder | None = None) -> list[list[int]]:
    """:func:`streamnmt.decode.translate_ids` through a :class:`GraphDecoder` when ``opts.graph``
    and ``device`` is CUDA (``decoder`` reuses one and its graphs); otherwise the eager search."""
    if not opts.graph or torch.device(device).type != "cuda":
        return translate_ids_eager(model, sources, opts, batch_size=batch_size, device=device)
    decoder = decoder or GraphDecoder(model, opts, batch_size=batch_size)
    return translate_ids_eager(model, sources, opts, batch_size=batch_size, device=device,
                               search_fn=decoder.search)
