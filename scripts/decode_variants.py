"""Decoding variants on the GPU: the cached step's attention kernels (fused vs SDPA's plain path) and
key spans (32, 16), graph-cached and eager-cached, beside the uncached reference; then where the
graph-cached search's GPU time goes with each attention path (torch.profiler, kernels by time).

Usage: PYTHONPATH=src python3 scripts/decode_variants.py SENTENCES [float32|bfloat16] [BATCH]
(docs/PERFORMANCE.md: 512 float32 256, and 1024 bfloat16 64). Base shape, random weights,
vocabulary 8,000, beam 3, bench_decode's sources."""
import sys, collections, torch
sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parent)]
from torch.nn.attention import SDPBackend
from streamnmt.inference import search as decode
from streamnmt.inference import graph_search as decode_graph
from streamnmt.inference.decoding import SearchOptions
from streamnmt.models.transformer import make_model
from bench_decode import random_sources, timed, streamnmt_run
dev = torch.device("cuda")
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 256
torch.manual_seed(0)
model = make_model(8000, 8000, dropout=0.0).to(dev, dtype).eval()
src = random_sources(int(sys.argv[1]), 8000, 0)
n = len(src)
opts = SearchOptions(beam_size=3)
EFF = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
def rate(kind, reps=3):
    t = timed(streamnmt_run(model, src, opts, kind, batch, dev), dev, reps)
    return n / t["median_s"], n / t["max_s"], n / t["min_s"]
res = {}
for att in ("fused", "math"):
    decode.STEP_ATTENTION[dtype] = EFF if att == "fused" else [SDPBackend.MATH]
    for span in (32, 16):
        decode.SPAN = decode_graph.SPAN = span
        res[f"graph {att} span {span}"] = r = rate("graph"); print(f"graph {att} span {span}", r, flush=True)
    decode.SPAN = decode_graph.SPAN = 32
    res[f"eager {att}"] = r = rate("eager"); print(f"eager {att}", r, flush=True)
res["uncached"] = rate("uncached", 2); print("uncached", res["uncached"], flush=True)
from torch.profiler import profile, ProfilerActivity
for att in ("fused", "math"):
    decode.STEP_ATTENTION[dtype] = EFF if att == "fused" else [SDPBackend.MATH]
    fn = streamnmt_run(model, src, opts, "graph", batch, dev); fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    agg = collections.Counter(); cnt = collections.Counter()
    for e in p.events():
        if e.device_type.name == "CUDA":
            agg[e.name[:90]] += e.device_time_total; cnt[e.name[:90]] += 1
    tot = sum(agg.values())
    print(f"\n== graph-cached, {att} attention, spans of {decode.SPAN}: GPU kernel time {tot/1e3:.1f} ms "
          f"over {sum(cnt.values())} kernels")
    for name, us in agg.most_common(10):
        print(f"  {us/1e3:8.1f} ms {100*us/tot:5.1f}% {cnt[name]:6d}  {name}")
print(f"\nsummary {dtype} batch {batch} beam 3, {n} sentences (sent/s median [min-max])")
for k, (m, lo, hi) in res.items():
    print(f"  {k:<22} {m:8.1f} [{lo:.1f}-{hi:.1f}]  x uncached {m/res['uncached'][0]:.2f}")
