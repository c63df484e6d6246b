"""Greedy and beam search over the Transformer, batched across sentences.

Translation, evaluation and the trainer's per-epoch BLEU all turn token ids into output ids here.
The search runs a whole batch of sentences (times the beam) in lock step on the device and keeps
its bookkeeping there too: scores, histories and finished hypotheses are tensors, and the host
waits for the device only to retire finished sentences every few steps (see
:func:`~streamnmt.inference.decoding.sync_interval`) and to fetch the results; both go through the
counted ``host_sync`` (sites ``decode.*``).

There is one search, :class:`StaticSearch`: its state (tokens, scores, histories, finished
pools, the step counter) is a set of fixed-shape tensors, the decoder's keys/values live in a
preallocated :class:`~streamnmt.inference.staticcache.StaticCache`, and one step has no host sync,
so it can be captured in a CUDA graph. :func:`greedy_search` and :func:`beam_search_scored` run it
eagerly (what the CPU and ``--no-graph`` use), shrinking the batch as sentences finish;
:mod:`streamnmt.inference.graph_search` runs the same step replayed from CUDA graphs.
``SearchOptions.cached=False`` (:mod:`streamnmt.inference.decoding`) computes each step's
log-probabilities by re-running the decoder over the whole prefix instead (the slow reference that
the tests and ``scripts/bench_decode.py`` compare with).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from streamnmt.syncstats import host_sync
from streamnmt.inference.decoding import SearchOptions, sync_interval
from streamnmt.inference.staticcache import StaticCache
from streamnmt.models import masks
from streamnmt.models.transformer import Transformer

NEG_INF = float("-inf")
# A captured step reads its self-attention keys in spans of this many slots (StaticCache): one
# graph per span, so early steps do not read a long output's full width; 32 keeps the graphs of
# the usual outputs (50-100 tokens) to 2-4 per beam parity, and reading up to 31 masked slots
# costs little beside the step's matrix products.
SPAN = 32

# Each decoding step brings new attention shapes (the keys grow by one position). cuDNN's fused
# attention builds a plan for every new shape: in bf16 that made single benchmark runs several
# times slower than their median (docs/PERFORMANCE.md, "Decoding"); the other kernels need no per-shape set-up.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The attention of a cached step has one query per row. The fused kernels tile the queries in
# blocks of 64 or more rows, so a one-query call pays a whole tile for each row and head; without
# FlashAttention (fp32) the memory-efficient kernel did this at fp32 FMA speed, a large share of the
# GPU time of a beam search (docs/PERFORMANCE.md). The plain path (two batched matrix products and
# a softmax) reads the keys and values once. Dtypes not named here, and the CPU, keep DECODE_ATTENTION.
STEP_ATTENTION: dict[torch.dtype, list[SDPBackend]] = {torch.float32: [SDPBackend.MATH]}


# -- the static-cache search: state of fixed shapes, one step at a time ----------------------


class StaticSearch:
    """Greedy (``beam`` 1) or beam search over ``rows`` sentences as tensors of fixed shapes.

    The one implementation of both searches: :func:`greedy_search` / :func:`beam_search_scored`
    run it eagerly (retiring finished sentences every few steps), :mod:`streamnmt.inference.graph_search`
    captures :meth:`step` in CUDA graphs. A step has fixed shapes and no host sync: rows are never
    removed by it, a finished sentence keeps running with its result frozen, so results do not
    depend on when the host looks. ``cached=False`` re-runs the decoder over the whole prefix at
    every step instead of using the cache (the slow reference; eager only).
    """

    def __init__(self, model: Transformer, rows: int, beam: int, src_width: int, width: int, opts: SearchOptions,
                 dtype: torch.dtype, device: torch.device, *, greedy: bool | None = None, cached: bool = True,
                 exact: bool = False, keep_pools: bool = False):
        r, k, w, v = rows, beam, width, model.shape.tgt_vocab
        self.model, self.rows, self.beam, self.width = model, rows, beam, width
        # The step's attention kernels (see STEP_ATTENTION); the CPU and the uncached reference
        # (queries over the whole prefix) keep the search's own
        self.step_attention = (STEP_ATTENTION.get(dtype, DECODE_ATTENTION) if cached and device.type == "cuda"
                               else DECODE_ATTENTION)
        self.greedy = beam == 1 if greedy is None else greedy  # beam 1 runs the beam algorithm unless greedy
        self.keep_pools = keep_pools  # also keep every sentence's k finished hypotheses (n-best lists; eager)
        if self.greedy and beam != 1:
            raise ValueError(f"greedy search keeps one hypothesis; got beam {beam}")
        self.cache = StaticCache(model, r * k, src_width, w, dtype, device, exact, reorders=not self.greedy) \
            if cached else None
        dev = dict(device=device)
        self.t = torch.zeros((), dtype=torch.long, **dev)  # the step being decoded
        self.t_host = 0  # the same on the host (uncached decoding)
        self.y = torch.full((r * k,), masks.BOS, dtype=torch.long, **dev)  # (N,) newest tokens
        self.limits = torch.ones(r, dtype=torch.long, **dev)  # (R,) EOS forced from this step on
        self.done = torch.zeros(r, dtype=torch.bool, **dev)  # (R,) sentence finished
        self.all_done = torch.zeros((), dtype=torch.bool, **dev)
        self.sent = torch.arange(r, **dev)  # (R,) sentence of each row (rows are retired eagerly)
        self.cols = torch.arange(w, **dev)  # (W,)
        if self.greedy:
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
        # Length normalisation per step: on CUDA a multiplication by the float32 reciprocal (what
        # dividing a float32 tensor by a Python float does there), on the CPU a division.
        lp = torch.tensor([length_penalty(t + 1, opts.len_penalty) for t in range(w)], dtype=torch.float32)
        lp = lp.reciprocal() if device.type == "cuda" else lp
        # From pinned memory the copy is asynchronous (no host wait).
        self.lp = lp.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else lp  # (W,)

    # -- per batch -----------------------------------------------------------------------------
    def load(self, mem: Tensor, src_mask: Tensor, limits: Tensor) -> None:
        """Start a batch of ``limits.numel()`` sentences (the rest are padding, finished at once)."""
        b, k = limits.numel(), self.beam
        index = torch.arange(b * k, device=mem.device) // k  # row i -> sentence i // k
        if self.cache is not None:
            self.cache.load(self.model, mem, src_mask, index)
        else:
            self.mem, self.src_mask = mem.index_select(0, index), src_mask.index_select(0, index)
        self.t.zero_()
        self.t_host = 0
        self.y.fill_(masks.BOS)
        self.limits.fill_(1)
        self.limits[:b] = limits
        self.done.fill_(True)
        self.done[:b] = False
        self.all_done.fill_(False)
        n = self.sent.numel()  # rows, padding included
        self.result = torch.full((n, self.width), masks.PAD, dtype=torch.long, device=mem.device)  # (R, W)
        self.result_score = torch.full((n,), NEG_INF, device=mem.device)  # (R,)
        if self.keep_pools and not self.greedy:
            self.result_pool = torch.full((n, self.beam, self.width), masks.PAD, dtype=torch.long, device=mem.device)
            self.result_pool_score = torch.full((n, self.beam), NEG_INF, device=mem.device)  # best first
        if self.greedy:
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
        return min(-(-(t + 1) // SPAN) * SPAN, self.width)

    def step(self, span: int) -> None:
        """One token for every row, reading ``span`` key slots; fixed shapes, no host sync (capturable)."""
        if self.cache is not None:
            self.cache.span = span
        with sdpa_kernel(self.step_attention):
            (self._greedy_step if self.greedy else self._beam_step)()
        self.t.add_(1)
        self.t_host += 1

    def _logp(self) -> Tensor:
        """(N, V) log-probabilities of the next token of every row."""
        if self.cache is not None:
            return self.model.decode_step(self.y, self.cache.src_mask, self.cache)
        t, n = self.t_host, self.y.numel()  # uncached: the decoder over BOS and every token so far
        toks = self.out[:, :t] if self.greedy else self.hist.view(n, self.width)[:, :t]
        prefix = torch.cat([torch.full((n, 1), masks.BOS, dtype=torch.long, device=toks.device), toks], 1)
        h = self.model.decode(self.mem, self.src_mask, prefix)[:, -1]  # (N, D)
        return F.log_softmax(self.model.generator(h).float(), dim=-1)

    def _greedy_step(self) -> None:
        y = self._logp().argmax(-1).masked_fill(self.t >= self.limits, masks.EOS)  # (R,)
        self.out.index_copy_(1, self.t.view(1), y[:, None])  # tokens after a row's first EOS are cut later
        self.done |= y == masks.EOS
        self.all_done.copy_(self.done.all())
        self.y.copy_(y)

    def _beam_step(self) -> None:
        r, k, w, v = self.rows, self.beam, self.width, self.model.shape.tgt_vocab
        t = self.t
        # 1. scores of all k*V extensions; EOS forced at the sentence's length limit
        logp = self._logp().view(r, k, v)  # (R, k, V)
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
        if self.cache is not None:
            self.cache.reorder((self.row_base + origin).view(-1))
        self.y.copy_(tok.view(-1))

    # -- results and (eagerly) retiring finished sentences ---------------------------------------
    def _collect(self) -> None:
        """Write the results of the live rows (final for finished sentences) to their sentences."""
        if self.greedy:
            self.result[self.sent] = self.out
            return
        self.result[self.sent] = torch.where(self.done[:, None], self.pool_tok[:, 0], masks.PAD)
        self.result_score[self.sent] = torch.where(self.done, self.pool_score[:, 0], NEG_INF)
        if self.keep_pools:
            self.result_pool[self.sent] = torch.where(self.done[:, None, None], self.pool_tok, masks.PAD)
            self.result_pool_score[self.sent] = torch.where(self.done[:, None], self.pool_score, NEG_INF)

    def retire(self, keep: Tensor) -> None:
        """Keep only the sentence rows ``keep`` (m,), e.g. those not finished (not capturable)."""
        self._collect()
        m, k = keep.numel(), self.beam
        beams = (keep[:, None] * k + torch.arange(k, device=keep.device)).view(-1)  # (m*k,)
        self.rows, self.sent, self.limits, self.done = m, self.sent[keep], self.limits[keep], self.done[keep]
        self.y = self.y[beams]
        if self.cache is not None:
            self.cache.select(beams)
        else:
            self.mem, self.src_mask = self.mem[beams], self.src_mask[beams]
        if self.greedy:
            self.out = self.out[keep]
            return
        self.scores, self.hist, self.pool_n = self.scores[keep], self.hist[keep], self.pool_n[keep]
        self.pool_score, self.pool_tok = self.pool_score[keep], self.pool_tok[keep]
        self.row_base = torch.arange(m, device=keep.device)[:, None] * k

    def results(self, b: int) -> tuple[list[list[int]], list[float] | None]:
        """Output ids (and beam scores; None for greedy) of the first ``b`` sentences."""
        self._collect()
        if self.greedy:
            # Needed: the ids go to the tokenizer.
            return _unpad(host_sync("decode.result", lambda: self.result[:b].tolist())), None
        # Needed: the ids go to the tokenizer.
        ids, best = host_sync("decode.result", lambda: (self.result[:b].tolist(), self.result_score[:b].tolist()))
        return _unpad(ids), best

    def results_pool(self, b: int, n: int) -> list[list[tuple[list[int], float]]]:
        """The ``n`` best finished hypotheses (ids, normalised score), best first, of the first ``b``
        sentences (a sentence whose pool holds fewer has fewer)."""
        self._collect()
        # Needed: the ids go to the tokenizer.
        ids, scores = host_sync("decode.result", lambda: (self.result_pool[:b, :n].tolist(),
                                                          self.result_pool_score[:b, :n].tolist()))
        return [[(hyp, sc) for hyp, sc in zip(_unpad(rows), row_scores) if sc != NEG_INF]
                for rows, row_scores in zip(ids, scores)]


# -- search ----------------------------------------------------------------------------------


def output_limits(model: Transformer, src: Tensor, opts: SearchOptions) -> tuple[int, Tensor]:
    """(max steps, (B,) per-sentence output limits) of a padded source batch. The loop bound comes
    from the padded width (a host value), so no sync is needed for it; the per-sentence limits stay
    on the device, clamped to it."""
    s = src.size(1)
    if s > model.shape.max_positions:
        raise ValueError(f"source of {s} tokens is longer than the model's {model.shape.max_positions} positions")
    cap = model.shape.max_positions - 1  # position of the last token fed to the decoder
    max_steps = min(max(int(opts.max_len_a * s + opts.max_len_b), 1), cap)
    lens = (src != masks.PAD).sum(1)  # (B,)
    return max_steps, (lens * opts.max_len_a + opts.max_len_b).floor().long().clamp(1, max_steps)


def check_search(model: Transformer, beam: int) -> None:
    if model.training:
        raise ValueError("decoding needs model.eval(): dropout would perturb the search")
    v = model.shape.tgt_vocab
    if not 1 <= beam <= v // 2:
        raise ValueError(f"beam_size must be between 1 and half the target vocabulary ({v // 2}); got {beam}")


def _unpad(rows: list[list[int]]) -> list[list[int]]:
    """Cut each id row at its first EOS (the EOS itself dropped)."""
    return [r[:r.index(masks.EOS)] if masks.EOS in r else r for r in rows]


@torch.inference_mode()
@sdpa_kernel(DECODE_ATTENTION)
def search_scored(model: Transformer, src: Tensor, opts: SearchOptions, beam: int, greedy: bool = False
                  ) -> tuple[list[list[int]], list[float] | None]:
    """The :class:`StaticSearch` run eagerly on a (B, S) padded source batch: encode once, step,
    and every few steps retire finished sentences (the last step finishes them all)."""
    return _run_eagerly(model, src, opts, beam, greedy).results(src.size(0))


@torch.inference_mode()
@sdpa_kernel(DECODE_ATTENTION)
def nbest_search(model: Transformer, src: Tensor, opts: SearchOptions, n: int
                 ) -> list[list[tuple[list[int], float]]]:
    """(B, S) padded source ids -> for each sentence its ``n`` (at most ``opts.beam_size``) best
    finished hypotheses as (ids, score), best first: the beam search's pool of finished
    hypotheses, ranked by log-probability / length_penalty as :func:`beam_search_scored` ranks
    them (its result is each list's first entry)."""
    if not 1 <= n <= opts.beam_size:
        raise ValueError(f"n-best lists hold 1 to beam_size ({opts.beam_size}) hypotheses; got {n}")
    return _run_eagerly(model, src, opts, opts.beam_size, False, keep_pools=True).results_pool(src.size(0), n)


def _run_eagerly(model: Transformer, src: Tensor, opts: SearchOptions, beam: int, greedy: bool,
                 keep_pools: bool = False) -> StaticSearch:
    """The search of :func:`search_scored`, its state returned once every sentence has finished."""
    check_search(model, beam)
    b = src.size(0)
    max_steps, limits = output_limits(model, src, opts)
    src_mask = masks.src_mask(src)  # (B, 1, 1, S)
    mem = model.encode(src, src_mask)  # (B, S, D)
    state = StaticSearch(model, b, beam, src.size(1), max_steps + 1, opts, mem.dtype, src.device,
                         greedy=greedy, cached=opts.cached, exact=True, keep_pools=keep_pools)
    state.load(mem, src_mask, limits)
    every = opts.sync_every or sync_interval(src.device)
    for t in range(max_steps + 1):
        state.step(t + 1)  # every key so far, no padding slots
        if (t + 1) % every or t == max_steps:
            continue
        # Needed: the host must know how many sentences are left to shrink the batch (or stop).
        keep = host_sync("decode.retire", lambda: torch.nonzero(~state.done).squeeze(1))  # (m,)
        if keep.numel() == 0:
            break
        if keep.numel() < state.rows:
            state.retire(keep)
    return state


def greedy_search(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()) -> list[list[int]]:
    """(B, S) padded source ids -> B output id lists (no BOS/EOS); ``opts.beam_size`` is ignored."""
    return search_scored(model, src, opts, 1, greedy=True)[0]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length normalisation (Wu et al. 2016): ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def beam_search(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()) -> list[list[int]]:
    """(B, S) padded source ids -> B best output id lists (no BOS/EOS); see :func:`beam_search_scored`."""
    return beam_search_scored(model, src, opts)[0]


def beam_search_scored(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()
                       ) -> tuple[list[list[int]], list[float]]:
    """(B, S) padded source ids -> (B best output id lists (no BOS/EOS), their normalised scores).

    Each sentence keeps ``k`` live hypotheses and a pool of its ``k`` best finished ones, ranked by
    log-probability / length_penalty. Of the 2k best extensions at a step, those that end in EOS
    and rank among the first k enter the pool; the best k others live on. A sentence is done when
    its pool has had k entries (as in fairseq), at the latest at its length limit, where EOS is
    forced. A done sentence's pool is frozen, so the result does not depend on how soon the host
    notices and retires it.
    """
    ids, scores = search_scored(model, src, opts, opts.beam_size)
    assert scores is not None  # the beam algorithm scores its results
    return ids, scores


def search(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()) -> list[list[int]]:
    """Greedy search for beam_size 1, beam search otherwise."""
    fn = greedy_search if opts.beam_size == 1 else beam_search
    return fn(model, src, opts)


def pad_batch(seqs: list[list[int]], device: torch.device | str) -> Tensor:
    """Id lists -> (B, S) right-padded tensor on ``device``."""
    batch = torch.full((len(seqs), max(map(len, seqs))), masks.PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return batch
    # From pinned memory the copy is asynchronous: no host wait, and the encoder's kernels queue
    # behind it. The caching host allocator keeps the pinned block until the copy has completed.
    return batch.pin_memory().to(device, non_blocking=True)


def translate_ids(model: Transformer, sources: list[list[int]], opts: SearchOptions = SearchOptions(), *,
                  batch_size: int = 64, device: torch.device | str = "cpu",
                  search_fn: Callable[[Tensor], list[list[int]]] | None = None,
                  on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
                  stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """Encoder-ready source id lists -> output id lists, in the order given.

    Sentences are sorted by length (longest first, so similar lengths share a batch's padding and
    an out-of-memory error shows on the first batch), decoded ``batch_size`` at a time, and put
    back in their original order. The model must be in eval mode on ``device``. ``search_fn``
    decodes one padded batch (default: :func:`search` with ``opts``; graph decoding passes its own).
    ``on_batch(indices, outputs)`` is called with each decoded batch (indices into ``sources``), so
    that a caller can detokenize and score one batch while the device decodes the next.
    ``stop()`` is asked before each batch but the first: True ends the decoding there (a time limit);
    the sentences not decoded keep empty outputs, and ``on_batch`` has named those that were.
    """
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        if start and stop is not None and stop():
            break
        idx = order[start:start + batch_size]
        src = pad_batch([sources[i] for i in idx], device)
        hyps = search_fn(src) if search_fn is not None else search(model, src, opts)
        for i, hyp in zip(idx, hyps):
            results[i] = hyp
        if on_batch is not None:
            on_batch(idx, hyps)
    return results
