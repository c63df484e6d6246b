"""Graph decoding against the eager cached search on a CUDA device (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from streamnmt.inference import search as decode

from streamnmt.models import masks
from streamnmt.inference.decoding import SearchOptions
from streamnmt.inference.search import pad_batch, translate_ids
from streamnmt.inference.graph_search import GraphDecoder
from streamnmt.inference.graph_search import translate_ids as translate_graph
from streamnmt.syncstats import STATS
from tests.test_decode import VOCAB, tiny_model

pytestmark = pytest.mark.gpu
N_SENTENCES = 512


def sentences(n: int = N_SENTENCES, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (k,), generator=g).tolist() + [masks.EOS] for k in lengths]


def scored(search, src_batches):
    hyps, scores = [], []
    for src in src_batches:
        h, s = search(src)
        hyps += h
        scores += s
    return hyps, scores


@pytest.mark.parametrize("beam", [1, 3])
def test_graph_equals_eager_cached_fp32_on_512_sentences(beam):
    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    srcs = sentences()
    opts = SearchOptions(beam_size=beam, len_penalty=0.6)
    gd = GraphDecoder(model, opts, batch_size=64)
    eager = translate_ids(model, srcs, opts, batch_size=64, device=dev)
    graph = translate_ids(model, srcs, opts, batch_size=64, device=dev, search_fn=gd.search)
    assert gd.captures >= 2 and all(sorted({s for s, _ in b.graphs}) == b.spans for b in gd.buckets.values())
    assert all(sorted({p for _, p in b.graphs}) == ([0] if beam == 1 else [0, 1]) for b in gd.buckets.values())
    assert graph == eager
    assert len({len(h) for h in eager}) > 5  # outputs of many lengths: some stop early, some at their limit
    if beam > 1:  # same hypotheses and scores within 1e-4, batch by batch
        batches = [pad_batch(srcs[i:i + 64], dev) for i in range(0, N_SENTENCES, 64)]
        ref_h, ref_s = scored(lambda s: decode.beam_search_scored(model, s, opts), batches)
        got_h, got_s = scored(gd.search_scored, batches)
        assert got_h == ref_h
        assert max(abs(a - b) for a, b in zip(got_s, ref_s)) <= 1e-4


@pytest.mark.parametrize("beam", [1, 3])
def test_replays_make_no_unlabelled_syncs_and_stop_early(beam):
    dev = torch.device("cuda")
    model = tiny_model(eos_bias=1.3).to(dev)  # every sentence ends well before its limit
    srcs = sentences(128)
    opts = SearchOptions(beam_size=beam, graph=True, sync_every=2)
    gd = GraphDecoder(model, opts, batch_size=128)
    first = translate_ids(model, srcs, opts, batch_size=128, device=dev, search_fn=gd.search)  # captures
    captures = gd.captures
    before = STATS.snapshot().get("decode.retire", {}).get("count", 0)
    torch.cuda.set_sync_debug_mode("error")  # any sync not made through host_sync raises
    try:
        again = translate_ids(model, srcs, opts, batch_size=128, device=dev, search_fn=gd.search)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    checks = STATS.snapshot()["decode.retire"]["count"] - before
    assert again == first and gd.captures == captures  # replayed, nothing captured again
    max_steps = int(opts.max_len_a * max(map(len, srcs)) + opts.max_len_b)
    assert 0 < checks <= (max_steps + 1) // 2 - 4  # stopped well before the loop bound (a check per 2 steps)


@pytest.mark.parametrize("beam", [1, 3])
def test_bf16_graph_decoding_runs_and_agrees_on_first_tokens(beam):
    # bf16 rounding differs between the two attention layouts, and a random model's near-ties then
    # send some outputs their own way after a few tokens; the first token rarely differs.
    dev = torch.device("cuda")
    model = tiny_model().to(dev, torch.bfloat16)
    srcs = sentences(256)
    opts = SearchOptions(beam_size=beam, graph=True)
    graph = translate_graph(model, srcs, opts, batch_size=64, device=dev)
    eager = translate_ids(model, srcs, opts, batch_size=64, device=dev)
    assert all(0 <= t < VOCAB and t != masks.EOS for h in graph for t in h)
    limits = [int(opts.max_len_a * len(s) + opts.max_len_b) for s in srcs]
    assert all(len(h) <= n for h, n in zip(graph, limits))
    if beam == 1:
        assert sum(a[:1] == b[:1] for a, b in zip(graph, eager)) >= 0.8 * len(srcs)


def test_failed_capture_says_so_once_and_decodes_eagerly(monkeypatch):
    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    srcs = sentences(64)
    opts = SearchOptions(beam_size=3, graph=True)
    lines: list[str] = []
    gd = GraphDecoder(model, opts, batch_size=16, log=lines.append)

    def fail(bucket, device):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(gd, "_capture", fail)
    got = translate_ids(model, srcs, opts, batch_size=16, device=dev, search_fn=gd.search)
    assert got == translate_ids(model, srcs, opts, batch_size=16, device=dev)
    assert len(lines) == len(gd.failed) >= 1 and not gd.buckets
    assert "capture failed (operation not permitted when stream is capturing)" in lines[0]


@pytest.mark.parametrize("beam", [1, 3])
def test_one_search_captured_equals_eager_and_no_graph(beam):
    # the same StaticSearch: replayed from graphs (swapping its two key/value buffer sets every
    # beam step) and eagerly on CUDA (--no-graph: exact spans, finished sentences retired)
    dev = torch.device("cuda")
    model = tiny_model(seed=2).to(dev)
    srcs = sentences(96, seed=5)
    opts = SearchOptions(beam_size=beam, len_penalty=1.0, max_len_b=7, graph=True)
    eager = translate_ids(model, srcs, opts, batch_size=32, device=dev)
    graph = translate_graph(model, srcs, opts, batch_size=32, device=dev)
    assert graph == eager
    assert len({len(h) for h in eager}) > 3


def test_shared_decoder_captures_each_bucket_once_per_process():
    from streamnmt.inference.graph_search import shared_decoder, source_bucket

    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    opts = SearchOptions(beam_size=3, graph=True)
    first, second = sentences(256, seed=1), sentences(256, seed=2)  # lengths 2..41 tokens
    translate_graph(model, first, opts, batch_size=64, device=dev)
    decoder = shared_decoder(model, opts, 64)
    captures = decoder.captures
    widths = {source_bucket(len(s), 64) for s in first}
    assert 0 < captures <= len(widths) + 1 <= 8  # coarse widths, not one bucket per batch
    translate_graph(model, second, opts, batch_size=64, device=dev)  # another call: the same decoder
    assert shared_decoder(model, opts, 64) is decoder and decoder.captures == captures
    other = SearchOptions(beam_size=2, graph=True)
    assert shared_decoder(model, other, 64) is not decoder  # other settings: a decoder of their own


def test_bf16_translate_and_eval_through_the_dtype_flag(tmp_path, capsys):
    from streamnmt.cli import main
    from tests.test_portable import INPUT, make_trainer, write_corpus

    corpus = write_corpus(tmp_path / "corpus")
    make_trainer(tmp_path, corpus, "--name", "g", "--epochs", "1", "--max-steps", "4").train()
    weights = str(tmp_path / "g" / "weights" / "last.pt")
    src = tmp_path / "in.txt"
    src.write_text(INPUT, encoding="utf-8")
    for dtype, name in (("auto", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")):
        assert main(["translate", "--weights", weights, "--device", "cuda", "--dtype", dtype, "--input", str(src)]) == 0
        out = capsys.readouterr()
        assert len(out.out.splitlines()) == 3 and f"on cuda, {name} (CUDA graphs)" in out.err
    assert main(["eval", "--weights", weights, "--device", "cuda", "--data", str(corpus)]) == 0
    out = capsys.readouterr().out
    assert "cuda, bf16 (CUDA graphs)" in out and "BLEU = " in out


def test_trainer_bleu_pass_decodes_a_bf16_copy(tmp_path):
    from tests.test_portable import write_corpus
    from streamnmt.cli import build_parser
    from streamnmt.config import build_job
    from streamnmt.training.trainer import Trainer

    corpus = write_corpus(tmp_path / "corpus")
    args = vars(build_parser().parse_args([
        "train", "--device", "cuda", "--model", "tiny", "--bleu-samples", "8", "--batch-size", "16", "--max-tokens", "0", "--max-len", "32",
        "--src-vocab", "40", "--tgt-vocab", "40", "--data", str(corpus), "--project", str(tmp_path), "--name", "b",
        "--epochs", "1", "--max-steps", "4", "--sync-strategy", "graph"]))
    for key in ("_run", "command"):
        args.pop(key)
    t = Trainer(build_job(args), log=lambda _: None)
    assert t.run.bleu_dtype == torch.bfloat16  # --eval-dtype auto on a GPU with bf16
    t.train()
    copy = t.evaluator.bleu_model  # the evaluator's decoding copy
    assert copy is not None and next(copy.parameters()).dtype == torch.bfloat16
    assert next(t.model.parameters()).dtype == torch.float32  # training stays in fp32


def test_fp32_steps_attend_through_the_plain_path_and_match_the_uncached_search():
    """A cached fp32 step attends through SDPA's plain path (one query per row; the fused kernels
    would pad it to a tile), bf16 keeps the fused kernels; the fp32 beam search still finds what
    the uncached reference (fused kernels over the whole prefix) finds, scores within 1e-4."""
    import dataclasses

    from torch.nn.attention import SDPBackend

    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    assert decode.StaticSearch(model, 2, 3, 8, 9, SearchOptions(), torch.float32, dev).step_attention == [
        SDPBackend.MATH]
    assert decode.StaticSearch(model, 2, 3, 8, 9, SearchOptions(), torch.bfloat16, dev).step_attention == \
        decode.DECODE_ATTENTION
    srcs = sentences(128, seed=3)
    batches = [pad_batch(srcs[i:i + 64], dev) for i in range(0, len(srcs), 64)]
    opts = SearchOptions(beam_size=3, len_penalty=0.6)
    ref_h, ref_s = scored(lambda s: decode.beam_search_scored(model, s, dataclasses.replace(opts, cached=False)),
                          batches)
    got_h, got_s = scored(lambda s: decode.beam_search_scored(model, s, opts), batches)
    same = [a == b for a, b in zip(got_h, ref_h)]
    assert sum(same) >= 0.95 * len(same)
    assert max(abs(a - b) for a, b, ok in zip(got_s, ref_s, same) if ok) <= 1e-4


def test_nbest_lists_on_cuda_start_with_the_graph_decoders_best():
    """--nbest decodes eagerly (the pools); its first entries are what graph decoding gives."""
    dev = torch.device("cuda")
    model = tiny_model().to(dev)
    srcs = sentences(128)
    opts = SearchOptions(beam_size=4, len_penalty=0.6)
    gd = GraphDecoder(model, opts, batch_size=64)
    for i in range(0, 128, 64):
        src = pad_batch(srcs[i:i + 64], dev)
        best, best_scores = gd.search_scored(src)
        lists = decode.nbest_search(model, src, opts, 4)
        assert [hyps[0][0] for hyps in lists] == best
        assert max(abs(hyps[0][1] - s) for hyps, s in zip(lists, best_scores)) <= 1e-4
        assert all([s for _, s in hyps] == sorted((s for _, s in hyps), reverse=True) for hyps in lists)
