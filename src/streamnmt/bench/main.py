"""``streamnmt bench``: build every row once, run them interleaved, write the results, print the table.

The steps, in order: data (the trainer's loader over the built-in corpus or ``--data``), one
runner per row (model from the same seed, strategy, streams, graph capture: all before any
timing), ``repeats`` rounds of one timed run per row, an optional profiled pass per row, then
``bench.json`` (every per-run number, config, device, versions, date, commit), ``bench.csv``
(one summary row per row), ``bench.png`` and the console table, printed last. A row that must not
share the process (:mod:`streamnmt.bench.apart`: the compile-ro peer beside CUDA-graph rows) is
measured first by a child bench and joins the table.

Under torchrun (``--nproc N`` starts it, see :mod:`streamnmt.bench.scaling`) every rank runs the
same steps on its shard with a DDP-wrapped model; after each run the ranks' results are gathered
(host-side) and merged: the slowest rank's time, every rank's tokens. Rank 0 alone writes and prints.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from streamnmt import dist as distributed
from streamnmt.bench.apart import ChildRow, rows_apart, run_apart
from streamnmt.bench.config import BenchConfig
from streamnmt.bench.critical import analyze_steps, format_view, load_dot
from streamnmt.bench.flops import peak_flops, precision
from streamnmt.bench.provenance import git_commit
from streamnmt.bench.profile import (ALL_REDUCE, GRAPH_BRANCHES, analyze_trace, format_summary, load_trace,
                                     stream_label)
from streamnmt.bench.runners import Env, Runner, make_runner
from streamnmt.bench.scaling import merge_ranks
from streamnmt.bench.stats import CSV_FIELDS, format_table, limit_of, summarize
from streamnmt.bench.synthvocab import random_tokens
from streamnmt.config import PRESETS
from streamnmt.configbase import check, to_dict
from streamnmt.data import DataConfig, prepare_data
from streamnmt.fsutil import atomic_write
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.plots import plot_bench, plot_timeline
from streamnmt.training.runs import increment_path, write_json
from streamnmt.devices import resolve_device, seed_everything

Log = Callable[[str], None]


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gb=round(p.total_memory / 1e9, 1),
                    multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        info["name"] = platform.processor() or platform.machine() or "cpu"
    return info


def _progress(name: str, repeat: int, repeats: int, r: dict[str, Any]) -> str:
    busy = "" if r["gpu_busy_pct"] is None else f", GPU busy {r['gpu_busy_pct']:.0f}%"
    return (f"bench: {name:<15} run {repeat + 1}/{repeats}: {r['ms_per_step']:.2f} ms/step, "
            f"{r['tokens_per_s']:,.0f} tokens/s{busy}, {r['sync_count']} syncs")


def _footnotes(cfg: BenchConfig, rows: list[dict[str, Any]], peak: float | None, device_name: str,
               notes: dict[str, list[str]]) -> str:
    names = [r["name"] for r in rows]
    mfu = (f"model FLOPs of the real tokens only (3 x forward matmuls as if each pair ran alone: "
           f"padding and attention across packed pairs not counted) / wall / {peak / 1e12:.0f} TFLOP/s "
           f"({device_name}, {precision(cfg.amp)} dense peak)" if peak else
           f"n/a: no peak rate known for '{device_name}' at {precision(cfg.amp)}")
    lines = [
        f"ms/step: median of {cfg.repeats} interleaved runs of {cfg.steps} steps [min-max]; 'within noise': the "
        "medians differ by less than the larger min-max range of the two rows"
        + ("; ONE run per row (--repeats 1): no spread, so no difference is judged within noise and none is "
           "shown to hold (run --repeats 3 or more before reading the ratios)" if cfg.repeats == 1 else ""),
        "real tok/s: non-PAD target tokens per second; padded tok/s: target positions (batch x length, "
        "filler rows included) per second",
        "vs baseline: baseline ms / row ms; % of limit: limit ms / row ms, the limit being "
        + ("resident (graph rows: resident-graph)" if "resident-graph" in names else "resident"),
        f"MFU: {mfu}",
        "GPU span: sum over steps of the GPU time between CUDA events before and after each step / wall; it"
        " includes launch gaps inside a step, so it reads ~100% whenever the GPU never waits between steps,"
        " busy or not",
        "GPU kernels: GPU time covered by kernels and copies per profiled step (--profile) / ms/step: the true busy"
        " share" + ("" if cfg.profile else " (n/a: run with --profile)") + "; NVML util: mean of ~100 ms samples of"
        " NVML's utilisation (unreliable for runs under ~2 s)",
        "CPU: this process's CPU time / wall (100% = one core); CPU+workers: the same with its loader worker "
        "processes' CPU time added (the trainer's cpu_util); syncs, sync ms: "
        "counted host waits inside the timed loop (the end-of-run drain is in bench.json)",
    ]
    world = max((r.get("world", 1) for r in rows), default=1)
    if world > 1:
        lines.insert(1, f"{world} processes (DDP): ms/step is the slowest rank's; tok/s counts every rank's tokens; "
                        f"tok/s per GPU = tok/s / {world}; MFU: / ({world} x peak); GPU span, NVML, CPU, syncs: rank "
                        "0's (every rank's in bench.json)")
    for name, ns in notes.items():
        lines += [f"{name}: {n}" for n in ns]
    return "\n".join(lines)


def _profile(runners: list[Runner], cfg: BenchConfig, out: Path, log: Log, record: bool = True) -> dict[str, Any]:
    """A profiled pass per row: trace files, timeline.png, idle breakdown and kernels per stream.
    ``record`` False (ranks other than 0): the same steps, so that DDP's collectives pair up, unrecorded."""
    if not record:
        for runner in runners:
            runner.profile(cfg.profile_steps, out / f"trace_{runner.name}.json", record=False)
        return {}
    result: dict[str, Any] = {}
    timelines: dict[str, dict[str, Any]] = {}
    texts, views = [], []
    for runner in runners:
        path = runner.profile(cfg.profile_steps, out / f"trace_{runner.name}.json")
        trace = load_trace(path)
        summary = analyze_trace(trace)
        result[runner.name] = {"trace": path.name, **(summary.to_dict() if summary else {"gpu": None})}
        texts.append(format_summary(runner.name, summary))
        graphs = []
        for dot in runner.dump_graphs(out / f"graphs_{runner.name}"):
            try:
                graphs.append(load_dot(dot))
            except ValueError as e:
                log(f"bench: {e}; left out of the critical path")
        view = analyze_steps(trace, graphs)
        result[runner.name]["critical_path"] = view.to_dict() if view else None
        views.append(format_view(runner.name, view))
        if summary is not None:
            labels = {GRAPH_BRANCHES: stream_label(GRAPH_BRANCHES)}
            labels.update({st: f"{stream_label(st)} (NCCL)" for st in summary.streams.get(ALL_REDUCE, {})})
            timelines[runner.name] = {"ops": summary.ops, "syncs": summary.syncs, "labels": labels}
        log(f"bench: profiled {runner.name}: {path}")
    if timelines:
        plot_timeline(timelines, out / "timeline.png")
        log(f"bench: kernel timeline per stream: {out / 'timeline.png'}")
    else:
        log("bench: the traces hold CPU ops only: the stream timeline and the GPU idle breakdown need CUDA")
    log("\n".join(texts))
    log("bench: per step, from the profiled steps' kernel trace (graph rows: per replay, the critical path over the "
        "captured graph's edges; see streamnmt.bench.critical):\n" + "\n".join(views))
    return result


def run_bench(cfg: BenchConfig, log: Log = print) -> int:
    """``streamnmt bench``: in this process, as one rank of torchrun's, or (``--nproc``) through torchrun."""
    sizes = cfg.world_sizes()
    if sizes:
        from streamnmt.bench.scaling import run_sizes
        return run_sizes(cfg, sizes, log)
    d = distributed.init(cfg.dist_backend, cfg.device, cfg.dist_timeout)
    try:
        code = _run(cfg, d, log if d.main else distributed.quiet)  # other ranks: errors only
    except Exception as e:
        if d.active and distributed.is_collective_error(e):
            raise distributed.peer_lost(d, e) from None
        raise  # the process group stays up: the error's frames may hold graphs that captured NCCL work
    # The rows' CUDA graphs (captured NCCL collectives among them) go before the process group:
    # destroying it under them hangs every rank (docs/PERFORMANCE.md, "Several GPUs (DDP)").
    gc.collect()
    d.close()
    return code


def _run(cfg: BenchConfig, d: distributed.Dist, log: Log) -> int:
    device = d.device or resolve_device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # streams, events and graphs default to this rank's GPU
    cfg = cfg.resolve(device)
    names, skipped = cfg.rows(device, d.world)
    seed_everything(cfg.seed)

    # 1. data: the trainer's loader over the same corpus for every row (rank 0 prepares it first)
    data_cfg = DataConfig(data=cfg.data, batch_size=cfg.batch_size, max_tokens=cfg.max_tokens, max_len=cfg.max_len,
                          pad_multiple=cfg.pad_multiple, builtin_size=cfg.builtin_size, pack=cfg.pack,
                          pack_width=cfg.pack_width)
    if not d.main:
        d.agree(False, "dist.setup", long_wait=True)  # Needed: rank 0 writes the tokenizers and cache; the others read them
    bundle = prepare_data(data_cfg, log=log)
    if d.main:
        d.agree(False, "dist.setup", long_wait=True)
    dm, n, h, ff = PRESETS[cfg.model]
    train = random_tokens(bundle.train, cfg.vocab, cfg.seed) if cfg.vocab else bundle.train
    vocab = (cfg.vocab, cfg.vocab) if cfg.vocab else (bundle.src_tok.vocab_size, bundle.tgt_tok.vocab_size)
    check(cfg.tie_embeddings != "all" or vocab[0] == vocab[1], "tie_embeddings",
          f"'all' needs one vocabulary for both sides; the corpus's tokenizers have {vocab[0]} source and "
          f"{vocab[1]} target pieces (set --vocab)")
    shape = ModelShape(*vocab, dm, n, h, ff, dropout=cfg.dropout, max_positions=max(1024, cfg.max_len + 8),
                       tie_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attention_dropout,
                       activation_dropout=cfg.activation_dropout)
    with torch.device("meta"):  # the parameter count without memory (a tied tensor counts once)
        n_params = sum(p.numel() for p in Transformer(shape).parameters())
    info = device_info(device)
    peak = peak_flops(info["name"], cfg.amp) if device.type == "cuda" else None
    env = Env(cfg, device, shape, data_cfg, train, peak, log, dist=d)
    sampler = env.loader(0).sampler  # built before anything is written: a bad --pack-width stops here
    empty = sampler.empty_rank() if d.active else None
    check(empty is None, "nproc", f"{d.world} processes leave rank {empty} without a single pair "
                                  f"({len(bundle.train)} pairs in batches of {cfg.batch_size} per rank); use fewer "
                                  "processes or a smaller --batch-size")
    out = Path(cfg.out) if cfg.out else increment_path("runs/bench", "exp")
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    ranks = f"; {d.world} processes ({d.backend}, DDP)" if d.active else ""
    log(f"bench: {info['name']}, model {cfg.model} ({n}+{n} layers, d_model {dm}, {n_params / 1e6:.2f}M parameters), "
        f"amp {cfg.amp}{ranks}, batch "
        f"{cfg.batch_size}{' per rank' if d.active else ''} x max-len {cfg.max_len} (pad multiple "
        f"{cfg.pad_multiple}), rows {', '.join(names)}; "
        f"{cfg.repeats} x ({cfg.warmup} warm-up + {cfg.steps} timed steps) each; out {out}")
    for note in skipped:
        log(f"bench: {note}")
    shapes = env.loader(0).shapes()
    log(f"bench: {len(shapes)} batch shape(s) "
        f"{'(packed: ' + ' x '.join(map(str, shapes[0])) + ' rows x source x target)' if cfg.pack else '(length buckets)'}; "
        f"padding "
        f"{100 * (1 - env.loader(0).num_tokens()['tgt_fill']):.1f} % of the target positions; vocabulary "
        f"{shape.tgt_vocab}{' (random ids)' if cfg.vocab else ''}; attention {env.attention}; label smoothing "
        f"{cfg.label_smoothing}; dropout {cfg.dropout} (attention {cfg.attention_dropout}, activation "
        f"{cfg.activation_dropout}); EMA {cfg.ema or 'none'}"
        + (f" every {cfg.ema_every} steps" if cfg.ema and cfg.ema_every > 1 else "")
        + (f"; tied embeddings: {cfg.tie_embeddings}" if cfg.tie_embeddings != "none" else ""))

    try:
        # 2. rows that cannot share this process (bench.apart) run first, each in a child bench
        apart: dict[str, ChildRow] = {}
        for name in rows_apart(names, torchrun=d.active):
            got = run_apart(name, cfg, out, log)
            if isinstance(got, str):
                log(f"bench: {got}")
                skipped.append(got)
                names.remove(name)
            else:
                apart[name] = got
        # 3. every other row built once: model from the same seed, strategy and streams, graph capture
        runners, ready_s = [], {name: row.ready_s for name, row in apart.items()}
        for name in names:
            if name in apart:
                continue
            t0 = time.perf_counter()
            runners.append(make_runner(name, env))
            ready_s[name] = time.perf_counter() - t0  # graph capture and compilation included
            log(f"bench: {name} ready in {ready_s[name]:.1f} s")

        # 4. timed runs, interleaved: A B C, A B C, ...
        runs: dict[str, list[dict[str, Any]]] = {name: list(apart[name].runs) if name in apart else []
                                                 for name in names}
        for repeat in range(cfg.repeats):
            for runner in runners:
                result = runner.run_once(repeat)
                if d.active:  # every rank's numbers: the slowest rank's time, all ranks' tokens
                    result = merge_ranks(d.gather(result, "bench.gather"), env.peak_flops)
                runs[runner.name].append(result)
                log(_progress(runner.name, repeat, cfg.repeats, result))

        # 5. optional profiled pass (a child profiles its own row)
        profiles = _profile(runners, cfg, out, log, record=d.main) if cfg.profile else {}
        profiles.update({name: row.profile for name, row in apart.items() if row.profile})
    finally:
        env.close()
    if not d.main:
        return 0  # rank 0 alone writes and prints

    # 6. summary and files; the table last
    rows = summarize(runs)
    measured = sorted([*runners, *apart.values()], key=lambda r: names.index(r.name))
    notes = {r.name: r.notes + ([f"loads in {r.workers} worker processes"] if r.workers else [])
             for r in measured}
    notes = {k: v for k, v in notes.items() if v}
    for row in rows:
        row["note"] = "; ".join(notes.get(row["name"], []))
        busy = profiles.get(row["name"], {}).get("busy_ms")
        row["kernel_busy_pct"] = None if busy is None else 100 * busy / cfg.profile_steps / row["ms_per_step"]
    record = {
        "config": to_dict(cfg), "rows": names, "left_out": skipped, "device": info,
        "world": d.world, "dist_backend": d.backend,
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git_commit(),
        "model": {**dataclasses.asdict(shape), "params": sum(p.numel() for p in runners[0].step.params)},
        "data": {"shapes": env.loader(0).shapes(), "batches_per_epoch": len(env.loader(0)),
                 "train_pairs": len(bundle.train)},
        "peak_tflops": peak / 1e12 if peak else None, "precision": precision(cfg.amp),
        "limits": {name: limit_of(name, names) for name in names},
        "runners": {r.name: {"kind": r.kind, "workers": r.workers, "ready_s": ready_s[r.name], "report": r.report, "notes": r.notes,
                             "runs": runs[r.name]} for r in measured},
        "summary": rows, "profile": profiles,
    }
    write_json(out / "bench.json", record)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out / "bench.csv", buf.getvalue())
    plot_bench(rows, out / "bench.png", title=f"{info['name']}: {cfg.model}, {cfg.amp}, batch {cfg.batch_size}"
               f" x {cfg.max_len}" + (f" x {d.world} processes" if d.active else ""))
    log(f"bench: wrote bench.json, bench.csv, bench.png to {out}")
    log(format_table(rows) + "\n" + _footnotes(cfg, rows, peak, info["name"], notes))
    return 0
