"""Eval's first call in a fresh process, variant by variant: load the checkpoint, ``bleu_on_pairs``
twice (the first call is what ``streamnmt eval`` prints), then bench_decode's warm graph-cached rate;
bf16, batch 64, beam 3, on the test set and checkpoint that ``scripts/bench_eval.py --dir DIR`` made.

Usage: PYTHONPATH=src python3 scripts/eval_first_call.py DIR/random.pt DIR/data REPEATS VARIANT...
A variant is a comma-separated list (empty: as committed) of span=N (key spans), bf16att=math|flash
(the step's attention in bf16), env:NAME=VALUE (an environment variable of the process)."""
import sys, json, time, statistics, subprocess, os
if len(sys.argv) > 3 and sys.argv[1] == "--inner":
    ckpt, data, variant = sys.argv[2], sys.argv[3], sys.argv[4]
    sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parent)]
    import torch
    from torch.nn.attention import SDPBackend
    from streamnmt.inference import search as decode
    from streamnmt.inference import graph_search as decode_graph
    for kv in filter(None, variant.split(",")):
        if kv.startswith("env:"): continue
        k, v = kv.split("=")
        if k == "span": decode.SPAN = decode_graph.SPAN = int(v)
        if k == "bf16att": decode.STEP_ATTENTION[torch.bfloat16] = [getattr(SDPBackend, v.upper())]
        if k == "fp32att": decode.STEP_ATTENTION[torch.float32] = [getattr(SDPBackend, v.upper())]
    from streamnmt.inference.translate import load_for_inference
    from streamnmt.inference.scoring import bleu_on_pairs, encode_sources
    from streamnmt.inference.decoding import SearchOptions
    from bench_decode import timed, streamnmt_run
    dev = torch.device("cuda")
    model, st, tt, _ = load_for_inference(ckpt, dev, dtype=torch.bfloat16)
    pairs = [(p["en"], p["ch"]) for p in json.loads(open(f"{data}/test.json").read())]
    out = {}
    for name in ("first", "second"):
        r = bleu_on_pairs(model, st, tt, pairs, device=dev, beam_size=3, batch_size=64, tgt_lang="ch",
                          options=SearchOptions(graph=True))
        out[name] = len(pairs) / r["seconds"]
    sources, _ = encode_sources(st, [s for s, _ in pairs], model.shape.max_positions)
    t = timed(streamnmt_run(model, sources, SearchOptions(beam_size=3, graph=True), "graph", 64, dev), dev, 3)
    out["bench"] = len(sources) / t["median_s"]
    print(json.dumps(out))
    sys.exit(0)
ckpt, data, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
variants = sys.argv[4:]
rows = {}
for rep in range(reps):
    for v in variants:
        env = dict(os.environ)
        for kv in filter(None, v.split(",")):
            if kv.startswith("env:"):
                k, val = kv[4:].split("=")
                env[k] = val
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--inner", ckpt, data, v], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if r.returncode:
            print(v, "FAILED", r.stderr[-1500:], flush=True); continue
        d = json.loads(r.stdout.strip().splitlines()[-1]); d["wall"] = wall; rows.setdefault(v, []).append(d)
        print(v, d, flush=True)
print(f"\n{'variant':<34}{'first (eval) sent/s':>22}{'second':>10}{'bench':>10}{'first/bench':>13}")
for v, ds in rows.items():
    f = [d["first"] for d in ds]; b = [d["bench"] for d in ds]; s2 = [d["second"] for d in ds]
    print(f"{v or 'current':<34}{statistics.median(f):>10.1f} [{min(f):.0f}-{max(f):.0f}]{statistics.median(s2):>10.1f}"
          f"{statistics.median(b):>10.1f}{100*statistics.median(f)/statistics.median(b):>12.1f}%  process {statistics.median([d['wall'] for d in ds]):.2f} s")
