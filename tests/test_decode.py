"""Greedy and beam search: cached = uncached = naive one-sentence references, batching, retiring, limits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from streamnmt.inference import search as decode

from streamnmt.models import masks
from streamnmt.inference.decoding import SearchOptions, sync_interval
from streamnmt.inference.search import beam_search, greedy_search, pad_batch, translate_ids
from streamnmt.inference.staticcache import StaticCache
from streamnmt.syncstats import STATS
from streamnmt.models.transformer import Transformer, make_model

VOCAB = 40


pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = (3, 7, 12, 5, 9, 1, 15, 4)


def tiny_model(seed: int = 0, eos_bias: float = -0.5, max_positions: int = 64) -> Transformer:
    torch.manual_seed(seed)
    model = make_model(VOCAB, VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_positions=max_positions)
    with torch.no_grad():
        # Xavier embeddings (the tests' EOS biases were chosen for them), not the training init.
        for emb in (model.src_embed, model.tgt_embed):
            torch.nn.init.xavier_uniform_(emb.weight)
        # Random weights rarely pick EOS; this bias makes some sentences finish early and others
        # run to their length limit, so retiring finished sentences is exercised.
        model.generator.bias[masks.EOS] = eos_bias
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model()


@pytest.fixture(scope="module")
def sources() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() + [masks.EOS] for n in LENGTHS]


def limit(n_src: int, opts: SearchOptions, max_positions: int = 64) -> int:
    return min(max(int(opts.max_len_a * n_src + opts.max_len_b), 1), max_positions - 1)


# -- independent references: one sentence, full decoder re-run, Python lists -----------------

def _next_logp(model: Transformer, mem, mask, prefix: list[int]) -> torch.Tensor:
    h = model.decode(mem, mask, torch.tensor([[masks.BOS] + prefix]))[0, -1]
    return F.log_softmax(model.generator(h), -1)  # (V,)


@torch.no_grad()
def naive_greedy(model: Transformer, src: list[int], opts: SearchOptions) -> list[int]:
    s = torch.tensor([src])
    mask = masks.src_mask(s)
    mem = model.encode(s, mask)
    out: list[int] = []
    for _ in range(limit(len(src), opts)):
        w = int(_next_logp(model, mem, mask, out).argmax())
        if w == masks.EOS:
            break
        out.append(w)
    return out


@torch.no_grad()
def naive_beam(model: Transformer, src: list[int], opts: SearchOptions) -> list[int]:
    """Beam search as documented in decode.beam_search, written plainly for one sentence."""
    k, big = opts.beam_size, limit(len(src), opts)
    s = torch.tensor([src])
    mask = masks.src_mask(s)
    mem = model.encode(s, mask)
    live: list[tuple[list[int], float]] = [([], 0.0)]
    pool: list[tuple[float, list[int]]] = []
    finished = 0
    for t in range(big + 1):
        cands = []
        for toks, score in live:
            logp = _next_logp(model, mem, mask, toks).tolist()
            for w in range(VOCAB):
                if t < big or w == masks.EOS:  # EOS forced at the limit
                    cands.append((score + logp[w], toks, w))
        cands = sorted(cands, key=lambda c: -c[0])[:2 * k]
        for rank, (score, toks, w) in enumerate(cands):
            if w == masks.EOS and rank < k:
                pool.append((score / ((5 + t + 1) / 6) ** opts.len_penalty, toks))
                finished += 1
        if finished >= k:
            break
        live = [(toks + [w], score) for score, toks, w in cands if w != masks.EOS][:k]
    return max(pool, key=lambda p: p[0])[1]


# -- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("beam", [1, 3, 4])
def test_cached_equals_uncached(model, sources, beam):
    opts = SearchOptions(beam_size=beam, max_len_b=5)
    cached = translate_ids(model, sources, opts, batch_size=5)
    uncached = translate_ids(model, sources, SearchOptions(beam_size=beam, max_len_b=5, cached=False), batch_size=5)
    assert cached == uncached
    # the bias did its job: some sentences stop early, some run to their limit
    lengths = [len(h) for h in cached]
    limits = [limit(len(s), opts) for s in sources]
    assert any(n < lim for n, lim in zip(lengths, limits))
    assert len(set(lengths)) > 2


def test_greedy_matches_naive_reference(model, sources):
    opts = SearchOptions(beam_size=1, max_len_b=5)
    assert translate_ids(model, sources, opts, batch_size=3) == [naive_greedy(model, s, opts) for s in sources]


@pytest.mark.parametrize("beam,alpha", [(3, 0.6), (4, 0.0), (2, 1.0), (3, 2.0)])
def test_beam_matches_naive_reference(model, sources, beam, alpha):
    opts = SearchOptions(beam_size=beam, len_penalty=alpha, max_len_b=5)
    assert translate_ids(model, sources, opts, batch_size=3) == [naive_beam(model, s, opts) for s in sources]


def test_beam_size_one_equals_greedy(model, sources):
    opts = SearchOptions(beam_size=1, max_len_b=5)
    src = pad_batch(sources, "cpu")
    assert beam_search(model, src, opts) == greedy_search(model, src, opts)


def test_finished_sentences_are_retired(model, sources, monkeypatch):
    sizes: list[int] = []
    select = StaticCache.select
    monkeypatch.setattr(StaticCache, "select", lambda self, index: (sizes.append(len(index)),
                                                                           select(self, index))[1])
    beam_search(model, pad_batch(sources, "cpu"), SearchOptions(beam_size=3, max_len_b=5, sync_every=1))
    full = 3 * len(sources)
    assert sizes and all(n % 3 == 0 for n in sizes)  # whole sentences (their 3 hypotheses) leave
    assert sizes[0] < full  # the batch shrank as sentences finished ...
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1  # ... step by step


@pytest.mark.parametrize("beam,alpha", [(1, 0.6), (3, 2.0)])
def test_result_independent_of_sync_interval_and_syncs_bounded(model, sources, beam, alpha):
    # alpha 2 favours long hypotheses: a done sentence whose pool were not frozen would pick up
    # later, longer ones and its result would depend on when the host retires it
    src = pad_batch(sources, "cpu")
    results = []
    for every in (1, 3, 1000):
        before = STATS.snapshot().get("decode.retire", {}).get("count", 0)
        opts = SearchOptions(beam_size=beam, len_penalty=alpha, max_len_b=5, sync_every=every)
        results.append(decode.search(model, src, opts))
        syncs = STATS.snapshot().get("decode.retire", {}).get("count", 0) - before
        max_steps = limit(src.size(1), SearchOptions(max_len_b=5))
        assert syncs <= math.ceil(max_steps / every)
    assert results[0] == results[1] == results[2]


def test_order_restored(model, sources):
    opts = SearchOptions(beam_size=3, max_len_b=5)
    forward = translate_ids(model, sources, opts, batch_size=3)
    backward = translate_ids(model, sources[::-1], opts, batch_size=3)
    assert backward == forward[::-1]
    alone = [translate_ids(model, [s], opts)[0] for s in sources]
    assert forward == alone


@pytest.mark.parametrize("beam", [1, 3])
def test_length_limit_relative_to_source_and_capped(beam):
    model = tiny_model(eos_bias=-1e4, max_positions=16)  # never EOS: every output runs to its limit
    srcs = [[5] * n + [masks.EOS] for n in (1, 4, 12)]
    opts = SearchOptions(beam_size=beam, max_len_a=1.0, max_len_b=2)
    out = translate_ids(model, srcs, opts)
    assert [len(h) for h in out] == [4, 7, 15]  # 1.0 * (n + 1) + 2, capped at max_positions - 1
    assert all(masks.EOS not in h for h in out)


def test_length_penalty():
    assert decode.length_penalty(3, 0.0) == 1.0
    assert decode.length_penalty(7, 1.0) == pytest.approx(2.0)
    assert decode.length_penalty(7, 0.6) == pytest.approx(2.0 ** 0.6)


def test_refuses_training_mode_and_oversized_beam():
    model = tiny_model().train()
    src = pad_batch([[5, masks.EOS]], "cpu")
    with pytest.raises(ValueError, match="eval"):
        greedy_search(model, src)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model.eval(), src, SearchOptions(beam_size=VOCAB))


@pytest.mark.gpu
@pytest.mark.parametrize("beam", [1, 3])
def test_gpu_cached_equals_uncached_without_unlabelled_syncs(beam):
    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randint(4, VOCAB, (n,), generator=g).tolist() + [masks.EOS] for n in LENGTHS]
    torch.cuda.set_sync_debug_mode("error")  # any sync not made through host_sync raises
    try:
        before = STATS.snapshot().get("decode.retire", {}).get("count", 0)
        cached = translate_ids(model, srcs, SearchOptions(beam_size=beam, max_len_b=5), device=dev)
        retires = STATS.snapshot()["decode.retire"]["count"] - before
        uncached = translate_ids(model, srcs, SearchOptions(beam_size=beam, max_len_b=5, cached=False), device=dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cached == uncached
    assert retires <= math.ceil(limit(max(LENGTHS) + 1, SearchOptions(max_len_b=5)) / sync_interval(dev))


# -- graph decoding's static step (run eagerly on the CPU) -------------------------------------

@pytest.mark.parametrize("beam,alpha", [(1, 0.6), (3, 0.6), (4, 0.0), (2, 1.0), (3, 2.0)])
def test_graph_decoder_cpu_fallback_equals_todays_decoder(model, sources, beam, alpha):
    from streamnmt.inference.graph_search import GraphDecoder

    opts = SearchOptions(beam_size=beam, len_penalty=alpha, max_len_b=5)
    gd = GraphDecoder(model, opts, batch_size=3)  # 8 sentences: the last batch has a padding row
    assert translate_ids(model, sources, opts, batch_size=3, search_fn=gd.search) == \
        translate_ids(model, sources, opts, batch_size=3)
    if beam > 1:
        src = pad_batch(sources, "cpu")
        (ref, ref_scores), (got, scores) = decode.beam_search_scored(model, src, opts), gd.search_scored(src)
        assert got == ref
        assert scores == pytest.approx(ref_scores, abs=1e-4)
        assert all(math.isfinite(x) for x in scores)


def test_static_cache_step_equals_growing_cache_step(model, sources):
    from streamnmt.inference.graph_search import StaticCache

    src = pad_batch(sources, "cpu")
    with torch.no_grad():
        mask = masks.src_mask(src)
        mem = model.encode(src, mask)
        grow = model.init_cache(mem)
        static = StaticCache(model, src.size(0) + 2, src.size(1) + 5, 12, torch.float32, torch.device("cpu"))
        static.load(model, mem, mask, torch.arange(src.size(0)))
        g = torch.Generator().manual_seed(3)
        for t in range(12):
            y = torch.randint(4, VOCAB, (src.size(0),), generator=g)
            ref = model.decode_step(y, mask, grow)
            got = model.decode_step(torch.cat([y, y[:2]]), static.src_mask, static)[:src.size(0)]
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
            assert int(static.pos) == grow.pos == t + 1


def test_graph_decoder_stops_when_all_finished_and_reuses_buckets(model, sources, monkeypatch):
    from streamnmt.inference import graph_search as decode_graph
    from streamnmt.inference.graph_search import GraphDecoder

    for module in (decode, decode_graph):
        monkeypatch.setattr(module, "SPAN", 16)  # spans short enough for these short outputs to cross
    calls = []
    gd = GraphDecoder(model, SearchOptions(beam_size=3, max_len_b=5, sync_every=1), batch_size=8, max_buckets=2)
    src = pad_batch(sources, "cpu")
    gd.search(src)
    bucket = next(iter(gd.buckets.values()))
    step = bucket.step
    bucket.step = lambda span: (calls.append(span), step(span))[1]
    gd.search(src)
    max_steps = limit(src.size(1), SearchOptions(max_len_b=5))
    assert 0 < len(calls) < max_steps + 1  # stopped before the loop bound: every sentence had finished
    assert calls == [bucket.span(t) for t in range(len(calls))] and calls[0] == 16 < calls[-1]  # keys read grow
    assert len(gd.buckets) == 1  # the same shape reused its bucket
    for n in (1, 2, 3):  # other row counts and widths: new buckets, at most max_buckets kept
        gd.search(pad_batch([s + [5] * 9 * n for s in sources[:n]], "cpu"))
    assert len(gd.buckets) == 2


def test_a_wider_bucket_serves_narrower_batches_up_to_half_its_width(model):
    """Longest first, as translation sorts: the first batch's bucket decodes the narrower batches
    after it (source width down to half its own), with the results of their own buckets."""
    from streamnmt.inference.graph_search import GraphDecoder, source_bucket

    opts = SearchOptions(beam_size=3, max_len_b=5)
    g = torch.Generator().manual_seed(7)
    batches = [[torch.randint(4, VOCAB, (n,), generator=g).tolist() + [masks.EOS] for _ in range(4)]
               for n in (30, 20, 15, 10)]  # source buckets 32, 24, 16, 12
    assert [source_bucket(len(b[0]), 64) for b in batches] == [32, 24, 16, 12]
    shared = GraphDecoder(model, opts, batch_size=4)
    widths = []  # the encoder runs at the width of the bucket that decodes the batch: one shape per bucket
    hook = model.encoder[0].register_forward_pre_hook(lambda _, args: widths.append(args[0].size(1)))
    try:
        got = [shared.search(pad_batch(b, "cpu")) for b in batches]
    finally:
        hook.remove()
    assert [k.src_width for k in shared.buckets] == [32, 12]  # 24 and 16 ran in 32's; 12 in its own
    assert widths == [32, 32, 32, 12]
    own = [GraphDecoder(model, opts, batch_size=4).search(pad_batch(b, "cpu")) for b in batches]
    assert got == own
