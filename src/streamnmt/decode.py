"""Greedy and beam search over the Transformer, batched across sentences.

Translation, evaluation and the trainer's per-epoch BLEU all turn token ids into output ids here.
The search runs a whole batch of sentences (times the beam) in lock step on the device and keeps
its bookkeeping there too: scores, histories and finished hypotheses are tensors, and the host
waits for the device only to retire finished sentences every few steps (see :func:`sync_interval`)
and to fetch the results; both go through the counted ``host_sync`` (sites ``decode.*``).

How the decoder is run is one small interface, :class:`Stepper` (one new position for every live
row, and row re-selection), with two implementations:

* :class:`CachedStepper`: incremental decoding through the model's :class:`DecoderCache`. The
  encoder runs once; cross-attention keys/values are projected once per sentence; each step costs
  one position. This is the one to use.
* :class:`FullStepper`: the reference. It re-runs the full decoder over the whole prefix at every
  step. It is slower, and the tests and ``scripts/bench_decode.py`` compare it with the cached one.

Both search functions use either stepper unchanged, so cached and uncached decoding differ only in
how the next-token log-probabilities are computed. :mod:`streamnmt.decode_graph` runs the same
searches with fixed shapes on a preallocated cache, one CUDA graph replay per token; this module is
the eager reference it is tested against, and what the CPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from streamnmt import masks
from streamnmt.engine.syncstats import host_sync
from streamnmt.model import Transformer

NEG_INF = float("-inf")

# Each decoding step brings new attention shapes (the keys grow by one position). cuDNN's fused
# attention builds a plan for every new shape: in bf16 on an H100 that made single benchmark runs
# 3 to 15 times slower than their median; the other kernels need no per-shape set-up.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """How to search; the user-facing configs (translate.py) validate these and build one."""

    beam_size: int = 3  # 1 = greedy
    len_penalty: float = 0.6  # GNMT alpha: score / ((5 + len) / 6) ** alpha; 0 = raw log-prob
    max_len_a: float = 1.5  # output limit = max_len_a * source tokens + max_len_b ...
    max_len_b: int = 10  # ... capped by the model's max_positions - 1
    cached: bool = True  # False = FullStepper (re-run the decoder over the prefix each step)
    sync_every: int = 0  # check for finished sentences every N steps; 0 = auto (sync_interval)
    graph: bool = False  # on CUDA, decode through CUDA graphs (decode_graph.translate_ids); CPU: ignored


def sync_interval(device: torch.device) -> int:
    """Steps between checks for finished sentences when SearchOptions.sync_every is 0.

    Each check is a host-device sync, and it retires finished sentences from the batch. On the CPU
    a "sync" costs nothing and smaller batches do less work, so we check every step. On a GPU,
    decoding steps are small and launch-bound: a row of a finished sentence left in the batch for
    a few more steps costs almost nothing, while each sync makes the host wait for the GPU before
    it queues the next step. So we check every 4th step, which wastes at most 3 steps per sentence.
    Measured (scripts/bench_decode.py, H100, base model, beam 3, batch 64 and 256, 2026-11-22):
    intervals 1, 2, 4, 8 and 16 gave the same sentences/s within the run-to-run spread, so the
    choice rests on the argument above, not on a measured gain.
    """
    return 1 if device.type == "cpu" else 4


# -- steppers: how the next-token log-probabilities are computed ---------------------------


class Stepper(Protocol):
    def step(self, y: Tensor) -> Tensor:
        """(N,) ids of the newest position -> (N, V) log-probabilities of the next token."""

    def select(self, index: Tensor) -> None:
        """Keep/reorder live rows (beam reordering, retiring finished sentences)."""


class CachedStepper:
    """Incremental decoding: each step runs one position against cached keys/values."""

    def __init__(self, model: Transformer, mem: Tensor, src_mask: Tensor, index: Tensor):
        self.model = model
        self.cache = model.init_cache(mem)  # cross-attention K/V, projected once per sentence
        self.src_mask = src_mask  # (B, 1, 1, S)
        self.select(index)  # one row per sentence -> one per hypothesis

    def step(self, y: Tensor) -> Tensor:
        return self.model.decode_step(y, self.src_mask, self.cache)  # (N, V)

    def select(self, index: Tensor) -> None:
        self.cache.select(index)
        self.src_mask = self.src_mask.index_select(0, index)


class FullStepper:
    """Reference decoding: re-runs the whole decoder over the prefix at every step (no cache)."""

    def __init__(self, model: Transformer, mem: Tensor, src_mask: Tensor, index: Tensor):
        self.model = model
        self.mem, self.src_mask = mem, src_mask  # (B, S, D), (B, 1, 1, S)
        self.prefix = torch.empty(mem.size(0), 0, dtype=torch.long, device=mem.device)  # (B, t)
        self.select(index)

    def step(self, y: Tensor) -> Tensor:
        self.prefix = torch.cat([self.prefix, y[:, None]], dim=1)  # (N, t+1), BOS first
        h = self.model.decode(self.mem, self.src_mask, self.prefix)[:, -1]  # (N, D)
        return F.log_softmax(self.model.generator(h).float(), dim=-1)  # (N, V)

    def select(self, index: Tensor) -> None:
        self.mem = self.mem.index_select(0, index)
        self.src_mask = self.src_mask.index_select(0, index)
        self.prefix = self.prefix.index_select(0, index)


# -- search ----------------------------------------------------------------------------------


def _start(model: Transformer, src: Tensor, opts: SearchOptions, beam: int
           ) -> tuple[Stepper, Tensor, int, int]:
    """Encode once; return (stepper, per-sentence output limits (B,), max steps, sync interval)."""
    if model.training:
        raise ValueError("decoding needs model.eval(): dropout would perturb the search")
    b, s = src.shape
    cap = model.shape.max_positions - 1  # position of the last token fed to the decoder
    if s > model.shape.max_positions:
        raise ValueError(f"source of {s} tokens is longer than the model's {model.shape.max_positions} positions")
    src_mask = masks.src_mask(src)  # (B, 1, 1, S)
    mem = model.encode(src, src_mask)  # (B, S, D)
    # The loop bound comes from the padded width (a host value), so no sync is needed for it;
    # per-sentence limits stay on the device and are clamped to it.
    max_steps = min(max(int(opts.max_len_a * s + opts.max_len_b), 1), cap)
    lens = (src != masks.PAD).sum(1)  # (B,)
    limits = (lens * opts.max_len_a + opts.max_len_b).floor().long().clamp(1, max_steps)  # (B,)
    index = torch.arange(b * beam, device=src.device) // beam  # (B * beam,) row i -> sentence i // beam
    stepper_cls = CachedStepper if opts.cached else FullStepper
    every = opts.sync_every or sync_interval(src.device)
    return stepper_cls(model, mem, src_mask, index), limits, max_steps, every


def _unpad(rows: list[list[int]]) -> list[list[int]]:
    """Cut each id row at its first EOS (the EOS itself dropped)."""
    return [r[:r.index(masks.EOS)] if masks.EOS in r else r for r in rows]


@torch.inference_mode()
@sdpa_kernel(DECODE_ATTENTION)
def greedy_search(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()) -> list[list[int]]:
    """(B, S) padded source ids -> B output id lists (no BOS/EOS); ``opts.beam_size`` is ignored."""
    stepper, limits, max_steps, every = _start(model, src, opts, beam=1)
    b, dev = src.size(0), src.device
    rows = torch.arange(b, device=dev)  # (n,) sentence of each live row
    out = torch.full((b, max_steps + 1), masks.PAD, dtype=torch.long, device=dev)  # (B, T)
    y = torch.full((b,), masks.BOS, dtype=torch.long, device=dev)  # (n,)
    finished = torch.zeros(b, dtype=torch.bool, device=dev)  # (n,)
    for t in range(max_steps + 1):
        # 1. next token; EOS forced at the sentence's length limit
        y = stepper.step(y).argmax(-1).masked_fill(t >= limits, masks.EOS)  # (n,)
        out[rows, t] = y  # tokens after a row's first EOS are cut by _unpad
        finished |= y == masks.EOS
        # 2. every few steps, retire finished sentences (the last step finishes them all)
        if (t + 1) % every or t == max_steps:
            continue
        # Needed: the host must know how many sentences are left to shrink the batch (or stop).
        keep = host_sync("decode.retire", lambda: torch.nonzero(~finished).squeeze(1))  # (m,)
        if keep.numel() == 0:
            break
        if keep.numel() < rows.numel():
            rows, y, finished, limits = rows[keep], y[keep], finished[keep], limits[keep]
            stepper.select(keep)
    return _unpad(host_sync("decode.result", lambda: out.tolist()))  # needed: the ids go to the tokenizer


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length normalisation (Wu et al. 2016): ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def beam_search(model: Transformer, src: Tensor, opts: SearchOptions = SearchOptions()) -> list[list[int]]:
    """(B, S) padded source ids -> B best output id lists (no BOS/EOS); see :func:`beam_search_scored`."""
    return beam_search_scored(model, src, opts)[0]


@torch.inference_mode()
@sdpa_kernel(DECODE_ATTENTION)
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
    k, v = opts.beam_size, model.shape.tgt_vocab
    if not 1 <= k <= v // 2:
        raise ValueError(f"beam_size must be between 1 and half the target vocabulary ({v // 2}); got {k}")
    stepper, limits, max_steps, every = _start(model, src, opts, beam=k)
    b, dev, width = src.size(0), src.device, max_steps + 1
    rows = torch.arange(b, device=dev)  # (n,) sentence of each live row
    out = torch.full((b, width), masks.PAD, dtype=torch.long, device=dev)  # (B, T)
    out_score = torch.full((b,), NEG_INF, device=dev)  # (B,) score of each result
    y = torch.full((b * k,), masks.BOS, dtype=torch.long, device=dev)  # (n*k,)
    scores = torch.full((b, k), NEG_INF, device=dev)  # (n, k) summed log-probs of live hypotheses
    scores[:, 0] = 0.0  # the k rows start as copies: only the first may be extended at step 0
    hist = torch.empty(b, k, 0, dtype=torch.long, device=dev)  # (n, k, t) their tokens
    pool_score = torch.full((b, k), NEG_INF, device=dev)  # (n, k) finished, normalised, best first
    pool_tok = torch.full((b, k, width), masks.PAD, dtype=torch.long, device=dev)  # (n, k, T)
    pool_n = torch.zeros(b, dtype=torch.long, device=dev)  # (n,) hypotheses that entered the pool
    done = torch.zeros(b, dtype=torch.bool, device=dev)  # (n,)
    vocab = torch.arange(v, device=dev)
    first_k = torch.arange(2 * k, device=dev) < k  # (2k,)
    for t in range(max_steps + 1):
        n = rows.numel()  # a shape, known to the host
        # 1. scores of all k*V extensions; EOS forced at the sentence's length limit
        logp = stepper.step(y).view(n, k, v)  # (n, k, V)
        forced = (t >= limits)[:, None, None] & (vocab != masks.EOS)  # (n, 1, V)
        cand = (scores[:, :, None] + logp.masked_fill(forced, NEG_INF)).view(n, k * v)
        top, idx = cand.topk(2 * k)  # (n, 2k)
        origin, tok = idx // v, idx % v  # (n, 2k) hypothesis extended, token appended
        eos = tok == masks.EOS

        # 2. EOS extensions among the first k enter the pool of sentences not yet done
        fin = eos & first_k & ~done[:, None] & (top > NEG_INF)  # (n, 2k)
        fin_tok = torch.full((n, 2 * k, width), masks.PAD, dtype=torch.long, device=dev)
        fin_tok[:, :, :t] = hist.gather(1, origin[:, :, None].expand(n, 2 * k, t))
        fin_tok[:, :, t] = masks.EOS  # (n, 2k, T)
        merged = torch.cat([pool_score, torch.where(fin, top / length_penalty(t + 1, opts.len_penalty), NEG_INF)], 1)
        pool_score, j = merged.topk(k)  # (n, k), best first
        pool_tok = torch.cat([pool_tok, fin_tok], 1).gather(1, j[:, :, None].expand(n, k, width))
        pool_n = pool_n + fin.sum(1)
        done = done | (pool_n >= k)

        # 3. the best k non-EOS extensions live on; reorder the decoder state to follow them
        scores, j = top.masked_fill(eos, NEG_INF).topk(k)  # (n, k)
        origin, tok = origin.gather(1, j), tok.gather(1, j)  # (n, k)
        hist = torch.cat([hist.gather(1, origin[:, :, None].expand(n, k, t)), tok[:, :, None]], 2)  # (n, k, t+1)
        stepper.select((torch.arange(n, device=dev)[:, None] * k + origin).view(-1))
        y = tok.view(-1)  # (n*k,)

        # 4. every few steps, retire done sentences (the last step finishes them all)
        if (t + 1) % every and t < max_steps:
            continue
        out[rows] = torch.where(done[:, None], pool_tok[:, 0], out[rows])  # (n, T) results so far
        out_score[rows] = torch.where(done, pool_score[:, 0], out_score[rows])
        if t == max_steps:
            break
        # Needed: the host must know how many sentences are left to shrink the batch (or stop).
        keep = host_sync("decode.retire", lambda: torch.nonzero(~done).squeeze(1))  # (m,)
        if keep.numel() == 0:
            break
        if keep.numel() < n:
            rows, limits, done, pool_n = rows[keep], limits[keep], done[keep], pool_n[keep]
            scores, hist, pool_score, pool_tok = scores[keep], hist[keep], pool_score[keep], pool_tok[keep]
            beams = (keep[:, None] * k + torch.arange(k, device=dev)).view(-1)  # (m*k,)
            y = y[beams]
            stepper.select(beams)
    # Needed: the ids go to the tokenizer.
    ids, best = host_sync("decode.result", lambda: (out.tolist(), out_score.tolist()))
    return _unpad(ids), best


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
                  search_fn: Callable[[Tensor], list[list[int]]] | None = None) -> list[list[int]]:
    """Encoder-ready source id lists -> output id lists, in the order given.

    Sentences are sorted by length (longest first, so similar lengths share a batch's padding and
    an out-of-memory error shows on the first batch), decoded ``batch_size`` at a time, and put
    back in their original order. The model must be in eval mode on ``device``. ``search_fn``
    decodes one padded batch (default: :func:`search` with ``opts``; graph decoding passes its own).
    """
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        src = pad_batch([sources[i] for i in idx], device)
        hyps = search_fn(src) if search_fn is not None else search(model, src, opts)
        for i, hyp in zip(idx, hyps):
            results[i] = hyp
    return results
