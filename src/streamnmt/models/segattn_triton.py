"""Attention of packed rows in Triton that computes only the position pairs near each pair's own.

A packed row holds several pairs (segment ids 1, 2, ..., 0 on padding; the mask rules are those of
:mod:`streamnmt.models.attention`). Dense-mask SDPA computes every position pair of the row, of which
about a tenth belong to one pair. Here the row is cut into tiles (:data:`TILES`), and a
query tile visits only the key tiles that hold keys of its queries' segments; within a visited tile
the segment ids mask exactly as the dense masks do. Forward and backward (FlashAttention-2's
recomputation: the forward keeps the log-sum-exp of each query row), bf16/fp16/fp32, no attention
dropout, no host synchronization (the key ranges are device tensors the kernels read), so a CUDA
graph captures it.

The ranges (:class:`streamnmt.models.segments.SegmentRanges`, built once per batch and shared by
the layers and heads) are the smallest and largest position of each segment id on the other side,
so they hold whatever the segment layout; a packer that keeps segments contiguous makes them tight.
The key tiles of padding queries in cross-attention (which see every source position) are the whole
row; on the key side, a key tile of real source positions also visits the padding queries' tiles
(``extra``), tiles its own range did not visit.

The kernels run on CUDA, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported; the tests use it). Two entries call the same kernels with the same
numerics: a plain ``torch.autograd.Function`` (:class:`_SegmentAttention`), which eager steps and the
CUDA graphs captured from them call, and a ``torch.library`` custom op with its own backward, which
``torch.compile`` keeps opaque and :func:`segment_attention` calls only while TorchDynamo traces it.
Calling a custom op imports TorchDynamo (its kernels run under ``torch._disable_dynamo``), seconds of
a run's set-up that an eager run does not need; defining one imports nothing more, so the op is
defined with the kernels: defining it inside a trace fails, and every compile site (the step, the
benchmark's compiled peer, tests) then finds it. (No ``from __future__ import annotations`` here:
the custom ops' schemas are read from their annotations.)
"""

import math
import os
from dataclasses import dataclass

import torch

from streamnmt.models.segments import SegmentRanges


@dataclass(frozen=True)
class Tiles:
    """Positions per query tile and per key tile (powers of two from 16), and the launch settings.
    32 x 32 with 2 warps: a tile spans one to three short pairs, and of the settings measured in the
    packed base-model step it was fastest with 16 x 32 x 2 warps (within noise of each other; 4 warps
    slower, docs/PERFORMANCE.md, "Triton segment kernels").
    Fixed, not autotuned: autotuning would time kernels while a CUDA graph captures."""

    query: int = 32
    key: int = 32
    warps: int = 2
    stages: int = 3

    def __post_init__(self) -> None:
        for name, n in (("query", self.query), ("key", self.key)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"attention tiles (STREAMNMT_ATTN_TILES): {name} tile of {n} positions; "
                                 f"a power of two from 16")
        if self.warps < 1 or self.warps & (self.warps - 1) or self.stages < 1:
            raise ValueError(f"attention tiles (STREAMNMT_ATTN_TILES): {self.warps} warps, {self.stages} stages; "
                             f"warps a power of two, stages at least 1")

    @classmethod
    def parse(cls, spec: str) -> "Tiles":
        """``QxK`` or ``QxK-wW-sS`` (e.g. ``64x32-w8-s2``), as the attention benchmark names variants."""
        parts = spec.split("-")
        q, k = (int(x) for x in parts[0].split("x"))
        opts = {p[0]: int(p[1:]) for p in parts[1:]}
        return cls(q, k, opts.get("w", cls.warps), opts.get("s", cls.stages))


# STREAMNMT_ATTN_TILES (``QxK[-wW-sS]``) sets them for a whole run, for tuning on a GPU
TILES = Tiles.parse(os.environ["STREAMNMT_ATTN_TILES"]) if os.environ.get("STREAMNMT_ATTN_TILES") else Tiles()


def set_tiles(tiles: Tiles) -> None:
    """The tiles of the next launches (a benchmark's sweep; kernels compile once per setting)."""
    global TILES
    TILES = tiles


try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

if triton is not None:
    # The lengths and head count are plain arguments, not specialised on (Triton otherwise compiles one
    # kernel per value class: divisible by 16, equal to 1, other), so a variant compiles once whatever
    # the batch shape, and the set-up's build check (streamnmt.models.attention.triton_probe) compiles
    # the very kernels the training step launches: on a machine's first run that compile is seconds of
    # set-up (docs/PERFORMANCE.md, "Triton segment kernels").
    _SHAPE_ARGS = ["n_q", "n_k", "n_heads"]

    @triton.jit
    def _allowed(seg_q, seg_k, offs_m, offs_n, n_k, CAUSAL: tl.constexpr, CROSS: tl.constexpr):
        """May query ``offs_m`` attend key ``offs_n``: the rules of dense_masks, (BM, BN)."""
        ok = (seg_q[:, None] == seg_k[None, :]) & (offs_n[None, :] < n_k)
        if CROSS:
            ok = ok | ((seg_q[:, None] == 0) & (offs_n[None, :] < n_k))
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None])
        return ok

    @triton.jit
    def _allowed_t(seg_q, seg_k, offs_m, offs_n, n_k, CAUSAL: tl.constexpr, CROSS: tl.constexpr):
        """:func:`_allowed` transposed, (BN, BM), built so (no transpose of a boolean tile)."""
        ok = (seg_k[:, None] == seg_q[None, :]) & (offs_n[:, None] < n_k)
        if CROSS:
            ok = ok | ((seg_q[None, :] == 0) & (offs_n[:, None] < n_k))
        if CAUSAL:
            ok = ok & (offs_n[:, None] <= offs_m[None, :])
        return ok

    @triton.jit
    def _rows(X, b, h, offs, valid, sb, sh, st, D: tl.constexpr):
        """The (len(offs), D) tile of rows ``offs`` of head ``h`` of batch row ``b`` (0 where not valid);
        ``b`` is int64, so that the offsets of large batches do not wrap."""
        return tl.load(X + b * sb + h * sh + offs[:, None] * st + tl.arange(0, D)[None, :], mask=valid[:, None],
                       other=0.0)

    @triton.jit
    def _put_rows(X, tile, b, h, offs, valid, sb, sh, st, D: tl.constexpr):
        tl.store(X + b * sb + h * sh + offs[:, None] * st + tl.arange(0, D)[None, :], tile.to(X.dtype.element_ty),
                 mask=valid[:, None])

    @triton.jit
    def _program(n_heads, B: tl.constexpr):
        """(tile index, batch row as int64, head, row x head, the tile's positions)."""
        pid, pid_bh = tl.program_id(0), tl.program_id(1)
        offs = pid * B + tl.arange(0, B)
        return (pid_bh // n_heads).to(tl.int64), pid_bh % n_heads, pid_bh, offs

    @triton.jit
    def _span(LO, HI, b, offs, valid, n_rows, n_other, B: tl.constexpr):
        """The union [lo, hi) of the tile's ranges, lo rounded down to a tile of ``B`` (hi <= lo: empty)."""
        lo = tl.min(tl.load(LO + b * n_rows + offs, mask=valid, other=n_other), axis=0)
        hi = tl.max(tl.load(HI + b * n_rows + offs, mask=valid, other=0), axis=0)
        return (lo // B) * B, hi

    @triton.jit
    def _query_tile(Q, QSEG, LO, HI, b, h, offs_m, n_q, n_k, sqb, sqh, sqt, D: tl.constexpr, BN: tl.constexpr):
        """A query tile's validity, segment ids, key span (in whole key tiles) and rows."""
        in_q = offs_m < n_q
        seg_q = tl.load(QSEG + b * n_q + offs_m, mask=in_q, other=-1)
        lo, hi = _span(LO, HI, b, offs_m, in_q, n_q, n_k, BN)
        return in_q, seg_q, lo, hi, _rows(Q, b, h, offs_m, in_q, sqb, sqh, sqt, D)

    @triton.jit
    def _key_tile(K, KSEG, b, h, start_n, n_k, skb, skh, skt, D: tl.constexpr, BN: tl.constexpr):
        """The key tile from ``start_n``: positions, validity, segment ids (-2 past the row) and rows."""
        offs_n = start_n + tl.arange(0, BN)
        in_k = offs_n < n_k
        seg_k = tl.load(KSEG + b * n_k + offs_n, mask=in_k, other=-2)
        return offs_n, in_k, seg_k, _rows(K, b, h, offs_n, in_k, skb, skh, skt, D)

    @triton.jit(do_not_specialize=_SHAPE_ARGS)
    def _fwd(Q, K, V, O, LSE, QSEG, KSEG, LO, HI, sm_scale, n_q, n_k, n_heads,
             sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, CROSS: tl.constexpr,
             PREC: tl.constexpr):
        b, h, pid_bh, offs_m = _program(n_heads, BM)
        in_q, seg_q, lo, hi, q = _query_tile(Q, QSEG, LO, HI, b, h, offs_m, n_q, n_k, sqb, sqh, sqt, D, BN)
        qk_scale = sm_scale * 1.4426950408889634  # exp2 in place of exp
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for start_n in range(lo, hi, BN):
            offs_n, in_k, seg_k, k = _key_tile(K, KSEG, b, h, start_n, n_k, skb, skh, skt, D, BN)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            s = tl.where(_allowed(seg_q, seg_k, offs_m, offs_n, n_k, CAUSAL, CROSS), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _rows(V, b, h, offs_n, in_k, svb, svh, svt, D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        _put_rows(O, acc / l_safe[:, None], b, h, offs_m, in_q, sob, soh, sot, D)
        tl.store(LSE + pid_bh * n_q + offs_m, m_safe + tl.math.log2(l_safe), mask=in_q)  # base 2

    @triton.jit(do_not_specialize=_SHAPE_ARGS)
    def _delta(O, DO, DELTA, n_q, n_heads, sob, soh, sot, sdb, sdh, sdt, D: tl.constexpr, BM: tl.constexpr):
        """rowsum(dO * O) in fp32, (B, h, Tq): the backward's correction term."""
        b, h, pid_bh, offs_m = _program(n_heads, BM)
        in_q = offs_m < n_q
        o = _rows(O, b, h, offs_m, in_q, sob, soh, sot, D).to(tl.float32)
        do = _rows(DO, b, h, offs_m, in_q, sdb, sdh, sdt, D).to(tl.float32)
        tl.store(DELTA + pid_bh * n_q + offs_m, tl.sum(o * do, axis=1), mask=in_q)

    @triton.jit
    def _dkdv_tiles(dk, dv, k, v, seg_k, offs_n, start, stop, Q, DO, LSE, DELTA, QSEG, b, h, pid_bh, n_q, n_k,
                    qk_scale, sqb, sqh, sqt, sdb, sdh, sdt,
                    D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr, CROSS: tl.constexpr,
                    PREC: tl.constexpr):
        for start_m in range(start, stop, BM):
            offs_m = start_m + tl.arange(0, BM)
            in_q = offs_m < n_q
            seg_q = tl.load(QSEG + b * n_q + offs_m, mask=in_q, other=-1)
            q = _rows(Q, b, h, offs_m, in_q, sqb, sqh, sqt, D)
            do = _rows(DO, b, h, offs_m, in_q, sdb, sdh, sdt, D)
            lse = tl.load(LSE + pid_bh * n_q + offs_m, mask=in_q, other=0.0)
            delta = tl.load(DELTA + pid_bh * n_q + offs_m, mask=in_q, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BN, BM): scores, transposed
            ok = _allowed_t(seg_q, seg_k, offs_m, offs_n, n_k, CAUSAL, CROSS) & in_q[None, :]
            pt = tl.where(ok, tl.math.exp2(st - lse[None, :]), 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)
        return dk, dv

    @triton.jit(do_not_specialize=_SHAPE_ARGS)
    def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, QSEG, KSEG, QLO, QHI, ELO, EHI, sm_scale, n_q, n_k, n_heads,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sgb, sgh, sgt,
                  D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, CROSS: tl.constexpr,
                  PREC: tl.constexpr):
        b, h, pid_bh, offs_n = _program(n_heads, BN)
        in_k = offs_n < n_k
        seg_k = tl.load(KSEG + b * n_k + offs_n, mask=in_k, other=-2)
        k = _rows(K, b, h, offs_n, in_k, skb, skh, skt, D)
        v = _rows(V, b, h, offs_n, in_k, svb, svh, svt, D)
        qk_scale = sm_scale * 1.4426950408889634
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        # the tiles of the queries of these keys' segments: [a, c) in whole tiles
        a, c = _span(QLO, QHI, b, offs_n, in_k, n_k, n_q, BM)
        c = tl.where(c > a, ((c + BM - 1) // BM) * BM, a)
        dk, dv = _dkdv_tiles(dk, dv, k, v, seg_k, offs_n, a, c, Q, DO, LSE, DELTA, QSEG, b, h, pid_bh, n_q, n_k,
                             qk_scale, sqb, sqh, sqt, sdb, sdh, sdt, D, BM, CAUSAL, CROSS, PREC)
        if CROSS:  # the padding queries' tiles, those [a, c) did not visit: before a, and from c on
            e0, e1 = _span(ELO, EHI, b, offs_n, in_k, n_k, n_q, BM)
            dk, dv = _dkdv_tiles(dk, dv, k, v, seg_k, offs_n, e0, tl.minimum(e1, a), Q, DO, LSE, DELTA, QSEG, b, h,
                                 pid_bh, n_q, n_k, qk_scale, sqb, sqh, sqt, sdb, sdh, sdt, D, BM, CAUSAL, CROSS, PREC)
            dk, dv = _dkdv_tiles(dk, dv, k, v, seg_k, offs_n, tl.maximum(e0, c), e1, Q, DO, LSE, DELTA, QSEG, b, h,
                                 pid_bh, n_q, n_k, qk_scale, sqb, sqh, sqt, sdb, sdh, sdt, D, BM, CAUSAL, CROSS, PREC)
        _put_rows(DK, dk * sm_scale, b, h, offs_n, in_k, sgb, sgh, sgt, D)
        _put_rows(DV, dv, b, h, offs_n, in_k, sgb, sgh, sgt, D)

    @triton.jit(do_not_specialize=_SHAPE_ARGS)
    def _bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, QSEG, KSEG, LO, HI, sm_scale, n_q, n_k, n_heads,
                sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sgb, sgh, sgt,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, CROSS: tl.constexpr,
                PREC: tl.constexpr):
        b, h, pid_bh, offs_m = _program(n_heads, BM)
        in_q, seg_q, lo, hi, q = _query_tile(Q, QSEG, LO, HI, b, h, offs_m, n_q, n_k, sqb, sqh, sqt, D, BN)
        do = _rows(DO, b, h, offs_m, in_q, sdb, sdh, sdt, D)
        lse = tl.load(LSE + pid_bh * n_q + offs_m, mask=in_q, other=0.0)
        delta = tl.load(DELTA + pid_bh * n_q + offs_m, mask=in_q, other=0.0)
        qk_scale = sm_scale * 1.4426950408889634
        dq = tl.zeros([BM, D], tl.float32)
        for start_n in range(lo, hi, BN):
            offs_n, in_k, seg_k, k = _key_tile(K, KSEG, b, h, start_n, n_k, skb, skh, skt, D, BN)
            v = _rows(V, b, h, offs_n, in_k, svb, svh, svt, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            ok = _allowed(seg_q, seg_k, offs_m, offs_n, n_k, CAUSAL, CROSS) & in_q[:, None]
            p = tl.where(ok, tl.math.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        _put_rows(DQ, dq * sm_scale, b, h, offs_m, in_q, sgb, sgh, sgt, D)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a (B, h, T, D) tensor whose last dimension is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _bhtd_like(x: torch.Tensor) -> torch.Tensor:
    """An empty (B, h, T, D) tensor laid out (B, T, h, D): the heads' outputs merge without a copy."""
    b, h, t, d = x.shape
    return torch.empty(b, t, h, d, dtype=x.dtype, device=x.device).transpose(1, 2)


def _precision(x: torch.Tensor) -> str:
    """fp32 multiplies exactly (no tensor cores: a path for tests, training runs bf16 or fp16); bf16 and
    fp16 natively (the setting is then ignored)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _last_dim_contiguous(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _forward(q, k, v, q_seg, k_seg, lo, hi, causal: bool, cross: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"segment_attention: q, k and v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v = _last_dim_contiguous(q, k, v)
    b, h, n_q, d = q.shape
    o = _bhtd_like(q)
    lse = torch.empty(b, h, n_q, dtype=torch.float32, device=q.device)
    _launch_fwd(q, k, v, o, lse, q_seg, k_seg, lo, hi, causal, cross)
    return o, lse


def _backward(do, q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal: bool, cross: bool):
    do, q, k, v, o = _last_dim_contiguous(do, q, k, v, o)
    lse = lse.contiguous()  # the kernels index it (B, h, Tq) without strides
    delta = torch.empty_like(lse)
    _launch_delta(o, do, delta)
    dq, dk, dv = _bhtd_like(q), _bhtd_like(k), _bhtd_like(v)
    _launch_dkdv(q, k, v, do, dk, dv, lse, delta, q_seg, k_seg, qlo, qhi, elo, ehi, causal, cross)
    _launch_dq(q, k, v, do, dq, lse, delta, q_seg, k_seg, lo, hi, causal, cross)
    return dq, dk, dv


# The launches, one kernel each, called by _forward and _backward and, alone, by launch_alone: the
# arguments a kernel is specialised on (dtypes, layouts, constexprs) come from one place.
def _launch_fwd(q, k, v, o, lse, q_seg, k_seg, lo, hi, causal: bool, cross: bool) -> None:
    b, h, n_q, d = q.shape
    t = TILES
    _fwd[(triton.cdiv(n_q, t.query), b * h)](
        q, k, v, o, lse, q_seg, k_seg, lo, hi, 1.0 / math.sqrt(d), n_q, k.size(2), h,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o), D=d, BM=t.query, BN=t.key, CAUSAL=causal,
        CROSS=cross, PREC=_precision(q), num_warps=t.warps, num_stages=t.stages)


def _launch_delta(o, do, delta) -> None:
    b, h, n_q, d = o.shape
    t = TILES
    _delta[(triton.cdiv(n_q, t.query), b * h)](o, do, delta, n_q, h, *_strides(o), *_strides(do), D=d, BM=t.query)


def _launch_dkdv(q, k, v, do, dk, dv, lse, delta, q_seg, k_seg, qlo, qhi, elo, ehi, causal: bool, cross: bool) -> None:
    b, h, n_q, d = q.shape
    n_k = k.size(2)
    t = TILES
    _bwd_dkdv[(triton.cdiv(n_k, t.key), b * h)](
        q, k, v, do, dk, dv, lse, delta, q_seg, k_seg, qlo, qhi, elo, ehi, 1.0 / math.sqrt(d), n_q, n_k, h,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
        D=d, BM=t.query, BN=t.key, CAUSAL=causal, CROSS=cross, PREC=_precision(q), num_warps=t.warps,
        num_stages=t.stages)


def _launch_dq(q, k, v, do, dq, lse, delta, q_seg, k_seg, lo, hi, causal: bool, cross: bool) -> None:
    b, h, n_q, d = q.shape
    t = TILES
    _bwd_dq[(triton.cdiv(n_q, t.query), b * h)](
        q, k, v, do, dq, lse, delta, q_seg, k_seg, lo, hi, 1.0 / math.sqrt(d), n_q, k.size(2), h,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        D=d, BM=t.query, BN=t.key, CAUSAL=causal, CROSS=cross, PREC=_precision(q), num_warps=t.warps,
        num_stages=t.stages)


# What launch_alone launches: the forward, and the backward's three kernels in _backward's order
KERNELS = ("fwd", "delta", "dkdv", "dq")


def launch_alone(kernels: tuple[str, ...], q: torch.Tensor, r: SegmentRanges) -> None:
    """Launch only ``kernels`` (names of :data:`KERNELS`) of ``r``'s variant, on ``q`` used as queries,
    keys and values, with the other arguments laid out as a forward and backward of
    :func:`segment_attention` on ``q`` lay them out: outputs as :func:`_bhtd_like`, a contiguous
    ``do`` of ``q``'s dtype, float32 ``lse`` and ``delta``. Triton specialises a kernel on its
    arguments' dtypes, constexprs and alignments, so each compiles into the cache entry that call
    would use; a process building one kernel need not run the ones before it (values do not matter:
    zeros, which fault nowhere)."""
    unknown = [name for name in kernels if name not in KERNELS]
    if unknown:
        raise ValueError(f"launch_alone: kernels {unknown}; one of {', '.join(KERNELS)}")
    q = _last_dim_contiguous(q)[0]
    b, h, n_q, _ = q.shape
    lse = torch.zeros(b, h, n_q, dtype=torch.float32, device=q.device)
    delta = torch.zeros_like(lse)
    do = torch.zeros_like(q, memory_format=torch.contiguous_format)
    out = [_bhtd_like(q).zero_() for _ in range(3)]  # o, then dk and dv (dq: the first again)
    for name in kernels:
        if name == "fwd":
            _launch_fwd(q, q, q, out[0], lse, r.q_seg, r.k_seg, r.lo, r.hi, r.causal, r.cross)
        elif name == "delta":
            _launch_delta(out[0], do, delta)
        elif name == "dkdv":
            _launch_dkdv(q, q, q, do, out[1], out[2], lse, delta, r.q_seg, r.k_seg, r.qlo, r.qhi, r.elo, r.ehi,
                         r.causal, r.cross)
        else:
            _launch_dq(q, q, q, do, out[0], lse, delta, r.q_seg, r.k_seg, r.lo, r.hi, r.causal, r.cross)


@torch.library.custom_op("streamnmt::segment_attention", mutates_args=())
def _segment_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seg: torch.Tensor,
                          k_seg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qlo: torch.Tensor,
                          qhi: torch.Tensor, elo: torch.Tensor, ehi: torch.Tensor, causal: bool,
                          cross: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, q_seg, k_seg, lo, hi, causal, cross)


@_segment_attention_op.register_fake
def _(q, k, v, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal, cross):
    b, h, n_q, _ = q.shape
    return _bhtd_like(q), q.new_empty(b, h, n_q, dtype=torch.float32)


@torch.library.custom_op("streamnmt::segment_attention_backward", mutates_args=())
def _segment_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   o: torch.Tensor, lse: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor,
                                   lo: torch.Tensor, hi: torch.Tensor, qlo: torch.Tensor, qhi: torch.Tensor,
                                   elo: torch.Tensor, ehi: torch.Tensor, causal: bool, cross: bool
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal, cross)


@_segment_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal, cross):
    return _bhtd_like(q), _bhtd_like(k), _bhtd_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal, cross = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi)
    ctx.causal, ctx.cross = causal, cross


def _backward_rule(ctx, do, _dlse):
    q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi = ctx.saved_tensors
    dq, dk, dv = _segment_attention_backward_op(do, q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi,
                                                ctx.causal, ctx.cross)
    return dq, dk, dv, *([None] * 10)


_segment_attention_op.register_autograd(_backward_rule, setup_context=_setup_context)


class _SegmentAttention(torch.autograd.Function):
    """The kernels as a plain autograd Function: what an eager step runs (and a CUDA graph captures),
    without the custom op's dispatch, which imports TorchDynamo on its first call."""

    @staticmethod
    def forward(ctx, q, k, v, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, causal: bool, cross: bool):
        o, lse = _forward(q, k, v, q_seg, k_seg, lo, hi, causal, cross)
        ctx.save_for_backward(q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi)
        ctx.causal, ctx.cross = causal, cross
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, q_seg, k_seg, lo, hi, qlo, qhi, elo, ehi, ctx.causal, ctx.cross)
        return dq, dk, dv, *([None] * 10)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: SegmentRanges) -> torch.Tensor:
    """Attention of (B, h, T, D) tensors under the segment rules of ``r``: (B, h, Tq, D), laid out
    (B, Tq, h, D). D a power of two >= 16; CUDA (or the CPU under Triton's interpreter). The custom
    op while TorchDynamo traces the call, the autograd Function otherwise (see the module docstring)."""
    if triton is None:
        raise RuntimeError("--attention triton needs Triton (it comes with torch's CUDA builds)")
    args = (q, k, v, r.q_seg, r.k_seg, r.lo, r.hi, r.qlo, r.qhi, r.elo, r.ehi, r.causal, r.cross)
    if torch.compiler.is_compiling():
        return _segment_attention_op(*args)[0]
    return _SegmentAttention.apply(*args)


def segment_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: SegmentRanges) -> torch.Tensor:
    """:func:`segment_attention` through the custom op, traced or not (the tests compare the two entries)."""
    return _segment_attention_op(q, k, v, r.q_seg, r.k_seg, r.lo, r.hi, r.qlo, r.qhi, r.elo, r.ehi, r.causal,
                                 r.cross)[0]
