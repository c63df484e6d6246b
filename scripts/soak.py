"""Soak: train N steps per strategy on the built-in corpus and check that allocated GPU memory
and host RSS stay flat (within 1 %) between an early step and the last one. Each strategy's model,
optimizer, streams and graphs are freed before the next one starts (``start`` records what is
still allocated then, which should not grow from one strategy to the next).

    PYTHONPATH=src python3 scripts/soak.py --steps 10000 --model tiny --strategies full,graph --out soak.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os

import psutil
import torch

from streamnmt.config import PRESETS
from streamnmt.data import DataConfig, make_loader, prepare_data
from streamnmt.engine import DeferredLosses, EngineConfig, make_strategy
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.step import example_batch, make_step


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--early", type=int, default=500)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--strategies", default="baseline,event,interval,deep,full,graph")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = DataConfig(batch_size=32, max_len=32, builtin_size=40000)
    data = prepare_data(cfg, log=lambda s: None)
    d, n, h, f = PRESETS[args.model]
    shape = ModelShape(data.src_tok.vocab_size, data.tgt_tok.vocab_size, d, n, h, f, 0.1)
    proc, results = psutil.Process(), {}
    for name in args.strategies.split(","):
        start = {"gpu_allocated": torch.cuda.memory_allocated(dev), "rss": proc.memory_info().rss}
        torch.manual_seed(0)
        model = Transformer(shape).to(dev)
        step = make_step(model, dev, d_model=d, warmup=400, amp="bf16")
        strat = make_strategy(name, dev, EngineConfig(sync_strategy=name), log=print)
        loader = make_loader(data.train, dataclasses.replace(cfg, workers=4 if strat.wants_workers else 0),
                             train=True, seed=0, pin_memory=True)
        strat.prepare(step, [example_batch(s, shape, 0) for s in loader.shapes()])
        losses = DeferredLosses(dev, 10)

        def batches(loader):
            for epoch in itertools.count():
                loader.set_epoch(epoch)
                yield from loader

        marks = {}
        for info in strat.run(itertools.islice(batches(loader), args.steps), step, losses):
            losses.poll()
            if info.step in (args.early, args.steps):
                strat.drain("soak")
                marks[info.step] = {"gpu_allocated": torch.cuda.memory_allocated(dev), "rss": proc.memory_info().rss}
        losses.flush()
        a, b = marks[args.early], marks[args.steps]
        results[name] = {"start": start, "early": a, "last": b,
                         "gpu_change_pct": 100 * (b["gpu_allocated"] - a["gpu_allocated"]) / a["gpu_allocated"],
                         "rss_change_pct": 100 * (b["rss"] - a["rss"]) / a["rss"]}
        print(f"{name:<9} GPU allocated {a['gpu_allocated'] / 2**20:8.1f} -> {b['gpu_allocated'] / 2**20:8.1f} MiB "
              f"({results[name]['gpu_change_pct']:+.2f} %)   RSS {a['rss'] / 2**20:7.1f} -> {b['rss'] / 2**20:7.1f} MiB "
              f"({results[name]['rss_change_pct']:+.2f} %)  flat within 1 %: "
              f"{abs(results[name]['gpu_change_pct']) <= 1 and abs(results[name]['rss_change_pct']) <= 1}", flush=True)
        del strat, step, model, loader, losses, info
        gc.collect()
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump({"steps": args.steps, "early": args.early, "model": args.model, "results": results}, fh, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
