"""One runner per benchmark row: the engine's strategies and the three reference loops.

Every runner is built once (model from the same seed, optimizer, its strategy and streams, graph
capture) and then called once per repeat, interleaved with the others. A call is timm's two
stages: ``warmup`` untimed steps through the same code path, a drain, then ``steps`` timed steps
and a drain; the wall time covers the timed steps and the final drain (the work queued must be
finished to count). Each call sees the same batches: the loader is rewound to the start of epoch
0 first. Models are separate per row, not one model reset between rows: graph mode bakes the
addresses of its weights and optimizer state into its graphs, and each strategy's streams keep
their own allocator pools. Weights are not reset between repeats; timings do not depend on them.

Several processes (torchrun): every rank builds the same rows with a DDP-wrapped model and its
share of the data, runs the same steps, and waits for the others before each timed stage.

Rows:
* a strategy (``baseline`` ... ``graph``): ``strategy.run`` over the real loader, losses polled
  as the trainer does; ``full`` and ``graph`` load in worker processes, as the trainer does;
* ``resident``: the batches already on the GPU, one stream, eager steps, losses deferred, no
  transfer and no host wait: what an eager loop cannot beat;
* ``resident-graph``: the graph strategy over the same GPU-resident batches: the limit of graph mode;
* ``plain``: what most people write: a blocking ``.to(device)`` and ``loss.item()`` every step;
* ``compile-ro``: the strongest off-the-shelf alternative: the same model under
  ``torch.compile(mode="reduce-overhead")`` (forward and backward compiled and replayed as CUDA
  graphs by PyTorch's graph trees), eager clipping and fused Adam, pinned batches copied without
  blocking, losses deferred. Offered on CUDA where Triton is installed.
* ``stock-ro``: the same under reduce-overhead, but the model and loss a user writes with stock
  PyTorch modules (:mod:`streamnmt.bench.stock`: ``nn.Transformer``, ``F.cross_entropy``); only
  when named.

Measurements per timed stage: see ``streamnmt.bench`` (the package docstring).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from streamnmt.bench.config import BenchConfig
from streamnmt.dist import Dist
from streamnmt.models.attention import resolve_attention
from streamnmt.bench.flops import real_token_flops, training_flops
from streamnmt.data import Batch, BatchLoader, DataConfig, make_loader
from streamnmt.data.corpus import TokenizedCorpus
from streamnmt.engine import STATS, DeferredLosses, EngineConfig, host_sync, make_strategy
from streamnmt.engine.config import PIPELINES
from streamnmt.fsutil import atomic_path
from streamnmt.models.transformer import ModelShape, Transformer
from streamnmt.training.monitor import CpuSampler, GpuTimer, NvmlSampler, TimedStep, time_graph_replays
from streamnmt.training.step import NMTStep, example_batch, fit_compile_cache, make_step

PROFILE_WARMUP = 3      # untimed steps before a profiled window
WINDOW = "bench.window"  # profiler range around the profiled steps and their drain


def take(loader: BatchLoader, n: int) -> Iterator[Batch]:
    """The first ``n`` batches from the start of epoch 0 (into later epochs if needed)."""
    if len(loader) == 0:
        raise ValueError("the loader has no batches")
    state = loader.state_dict()
    state.update(epoch=0, position=0)
    loader.load_state_dict(state)
    got = 0
    while got < n:
        for batch in loader:
            yield batch
            got += 1
            if got == n:
                return


class Env:
    """What every runner shares: settings, model shape, data loaders, the GPU-resident batches."""

    def __init__(self, cfg: BenchConfig, device: torch.device, shape: ModelShape, data_cfg: DataConfig,
                 corpus: TokenizedCorpus, peak_flops: float | None, log: Callable[[str], None],
                 dist: Dist | None = None):
        self.cfg, self.device, self.shape, self.data_cfg, self.corpus = cfg, device, shape, data_cfg, corpus
        self.peak_flops, self.log = peak_flops, log
        self.dist = dist or Dist()  # one process unless torchrun started several
        self.cuda = device.type == "cuda"
        self._loaders: dict[int, BatchLoader] = {}
        self._staged: list[Batch] | None = None
        self._flops: dict[tuple[int, int, int], int] = {}
        self.attention = resolve_attention(cfg.attention, device, log, head_dim=shape.d_model // shape.n_heads,
                                           attention_dropout=cfg.attention_dropout)

    def loader(self, workers: int) -> BatchLoader:
        if workers not in self._loaders:
            cfg = dataclasses.replace(self.data_cfg, workers=workers)
            self._loaders[workers] = make_loader(self.corpus, cfg, train=True, seed=self.cfg.seed,
                                                 pin_memory=self.cuda, world=self.dist.world, rank=self.dist.rank)
        return self._loaders[workers]

    def staged(self) -> list[Batch]:
        """The batches every run uses, copied to the device once (the resident rows' data)."""
        if self._staged is None:
            n = max(self.cfg.warmup + self.cfg.steps, PROFILE_WARMUP + self.cfg.profile_steps)
            self._staged = [b.to(self.device, non_blocking=True) for b in take(self.loader(0), n)]
            if self.cuda:
                # Needed: set-up; the copies must be done before any timing starts.
                host_sync("bench.setup", torch.cuda.current_stream(self.device))
        return self._staged

    def flops(self, shape: tuple[int, int, int]) -> int:
        if shape not in self._flops:
            self._flops[shape] = training_flops(self.shape, *shape)
        return self._flops[shape]

    def real_flops(self, batch: Batch) -> int:
        """Training FLOPs of the batch's real tokens (the MFU column; see flops.real_token_flops)."""
        return real_token_flops(self.shape, batch.src_tokens, batch.ntokens)

    def example(self, shape: tuple[int, int, int]) -> Batch:
        """A random batch of ``shape`` as the loader makes them (packed or not), for capture/compile."""
        return example_batch(shape, self.shape, self.cfg.seed, packed=self.data_cfg.packs)

    def new_step(self, stock: bool = False) -> NMTStep:
        """A model and its step function, initialised from the benchmark's seed (same for every row).
        ``stock``: the stock-PyTorch model and loss of :mod:`streamnmt.bench.stock` instead."""
        torch.manual_seed(self.cfg.seed)
        loss_model = None
        if stock:
            from streamnmt.bench.stock import StockLossModel
            loss_model = model = StockLossModel(self.shape, self.cfg.label_smoothing).to(self.device)
        else:
            model = Transformer(self.shape).to(self.device)
            model.set_attention(self.attention)
        step = make_step(model, self.device, d_model=self.shape.d_model, lr=1.0, warmup=4000, amp=self.cfg.amp,
                         clip=1.0, label_smoothing=self.cfg.label_smoothing, compile=self.cfg.compile and not stock,
                         shapes=len(self.loader(0).shapes()),
                         ddp=self.dist.active, bucket_cap_mb=self.cfg.bucket_cap_mb, loss_model=loss_model,
                         ema=self.cfg.ema or 0.0, ema_every=self.cfg.ema_every)
        if self.dist.rank > 0:  # same weights everywhere, each rank its own dropout stream (as the trainer)
            torch.manual_seed(self.cfg.seed + 1_000_003 * self.dist.rank)
        return step

    def close(self) -> None:
        self._loaders.clear()  # worker processes end with their DataLoader iterators
        self._staged = None


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync_totals(stats: dict[str, dict[str, float]]) -> tuple[int, float]:
    return sum(int(s["count"]) for s in stats.values()), sum(s["total_ms"] for s in stats.values())


class Runner:
    """Base runner: the two stages and the measurements; subclasses supply the loop."""

    kind = "reference"
    stock = False  # the stock-PyTorch model and loss (streamnmt.bench.stock) instead of streamnmt's

    def __init__(self, name: str, env: Env):
        self.name, self.env, self.device = name, env, env.device
        self.step = TimedStep(env.new_step(self.stock))
        self.losses = DeferredLosses(self.device, env.cfg.loss_interval)
        self.timer = GpuTimer(self.device)
        self.nvml = NvmlSampler(self.device)
        self.cpu = CpuSampler()
        self.workers = 0
        self.notes: list[str] = []

    @property
    def report(self) -> dict[str, Any]:
        """What the row's engine reported (graph mode: shapes captured, capture time, pool, fallback)."""
        return {}

    # -- what each row does ------------------------------------------------------------------
    def source(self, n: int) -> Iterator[Batch]:
        """The first ``n`` batches of the benchmark's data, as this row consumes them."""
        return take(self.env.loader(self.workers), n)

    def loop(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """Train one step per batch; yield each batch after its step has been issued."""
        raise NotImplementedError

    def finish(self, site: str) -> None:
        """Wait until the work queued so far has finished and every loss has been read."""
        if self.env.cuda:
            # Needed: a run's time must include the work it queued, and runs must not overlap.
            host_sync(f"{site}.drain", torch.cuda.current_stream(self.device))
        self.losses.flush(f"{site}.losses")

    def extra_bytes(self) -> int:
        """Device memory this row holds besides its model and optimizer state."""
        return 0

    def dump_graphs(self, directory: Path) -> list[Path]:
        """The topology of the CUDA graphs this row replays, as DOT files (graph mode under --profile)."""
        return []

    # -- the two stages ------------------------------------------------------------------------
    def run_once(self, repeat: int) -> dict[str, Any]:
        cfg, env, cuda = self.env.cfg, self.env, self.env.cuda
        src = self.source(cfg.warmup + cfg.steps)
        try:
            # 1. warm-up: same code path and data, untimed; then drain and forget its syncs
            for _ in self.loop(islice(src, cfg.warmup)):
                pass
            self.finish("bench.warmup")
            # Needed (several ranks): the timed stages start together; the slowest rank's time counts.
            env.dist.agree(False, "bench.start")  # host-side barrier; a no-op for one process
            STATS.reset()
            if cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
                mem0 = torch.cuda.memory_allocated(self.device)
            # 2. timed stage: per-step GPU event pairs, samplers, wall clock
            self.step.timer = self.timer
            self.cpu.start()
            self.nvml.start()
            t0 = time.perf_counter()
            steps = tokens = padded = flops = real_flops = 0
            for batch in self.loop(islice(src, cfg.steps)):
                steps, tokens, flops = steps + 1, tokens + batch.ntokens, flops + env.flops(batch.shape)
                real_flops += env.real_flops(batch)
                padded += batch.tgt_out.numel()  # a shape: no device access
            loop_syncs = STATS.reset()
            self.finish("bench.end")
            wall = time.perf_counter() - t0
            nvml, cpu = self.nvml.stop(), self.cpu.stop()
        finally:
            self.step.timer = None
            getattr(src, "close", lambda: None)()
        # 3. read what was deferred (no waiting left: everything has been drained)
        gpu_ms = self.timer.collect("bench.gpu_timer") if self.timer.enabled else None
        end_syncs = STATS.reset()
        count, sync_ms = _sync_totals(loop_syncs)
        peak_mb = None
        if cuda:
            own = _bytes(self.step.state_tensors()) + self.extra_bytes()
            peak_mb = (own + torch.cuda.max_memory_allocated(self.device) - mem0) / 2**20
            self._release()
        return {
            "repeat": repeat, "steps": steps, "wall_s": wall, "ms_per_step": 1e3 * wall / steps,
            "tokens": tokens, "tokens_per_s": tokens / wall, "padded_tokens_per_s": padded / wall,
            "model_tflops": flops / wall / 1e12,
            "mfu_pct": 100 * real_flops / wall / env.peak_flops if env.peak_flops else None,
            "padded_mfu_pct": 100 * flops / wall / env.peak_flops if env.peak_flops else None,
            "real_share_pct": 100 * tokens / padded if padded else None,
            "gpu_ms": gpu_ms, "gpu_busy_pct": None if gpu_ms is None else 100 * gpu_ms / (1e3 * wall),
            "gpu_timed_steps": self.timer.collected if self.timer.enabled else None,
            "nvml_util_pct": nvml.get("util_mean_pct"), "nvml_util_max_pct": nvml.get("util_max_pct"),
            "nvml_mem_max_mb": nvml.get("mem_max_mb"), "nvml_samples": nvml.get("samples", 0),
            "cpu_pct": cpu["process_pct"], "workers_cpu_pct": cpu["workers_pct"], "cpu_util_pct": cpu["util_pct"],
            "system_cpu_pct": cpu["system_pct"], "sync_count": count, "sync_ms": sync_ms,
            "syncs": loop_syncs, "end_syncs": end_syncs, "peak_mem_mb": peak_mb,
        }

    def _release(self) -> None:
        # Each row's streams keep their own cached blocks; returning them between runs keeps nine
        # rows' caches from adding up. cudaFree waits for the device (idle here: just drained).
        host_sync("bench.release", torch.cuda.empty_cache)

    def profile(self, steps: int, path: Path, record: bool = True) -> Path | None:
        """Profile ``steps`` steps (after a short warm-up) and export a Chrome/Perfetto trace.
        ``record`` False (ranks other than 0): the same steps, unprofiled, nothing written."""
        src = self.source(PROFILE_WARMUP + steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.env.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            for _ in self.loop(islice(src, PROFILE_WARMUP)):
                pass
            self.finish("bench.profile_warmup")
            self.step.annotate = True
            prof = torch.profiler.profile(activities=activities) if record else contextlib.nullcontext()
            with prof:
                with torch.profiler.record_function(WINDOW):
                    for _ in self.loop(islice(src, steps)):
                        pass
                    self.finish("bench.profile")
        finally:
            self.step.annotate = False
            getattr(src, "close", lambda: None)()
        if self.env.cuda:
            self._release()
        STATS.reset()
        if not record:
            return None
        with atomic_path(path, suffix=".json") as tmp:
            prof.export_chrome_trace(str(tmp))
        return path


class StrategyRunner(Runner):
    """A row driven by one of the engine's strategies (also ``resident-graph``: graph, resident data)."""

    kind = "strategy"

    def __init__(self, name: str, env: Env, engine_name: str | None = None, resident: bool = False):
        super().__init__(name, env)
        cfg = env.cfg
        engine_name = engine_name or name
        streams = getattr(cfg, "streams", None) if engine_name in PIPELINES else None  # --streams: deep, full
        ecfg = EngineConfig(sync_strategy=engine_name, sync_interval=cfg.sync_interval,
                            loss_interval=cfg.loss_interval, compile=cfg.compile, streams=streams)
        self.strategy = make_strategy(engine_name, self.device, ecfg, log=env.log)
        if cfg.profile and hasattr(self.strategy, "keep_topology"):
            self.strategy.keep_topology = True  # graphs keep their topology for the critical path (dump_graphs)
        self.resident = resident
        if resident:
            self.kind = "reference"
        elif self.strategy.wants_workers:
            self.workers = cfg.workers  # as the trainer does for these strategies
        shapes = env.loader(self.workers).shapes()
        self.strategy.prepare(self.step, [env.example(s) for s in shapes])
        env.dist.agree_on_capture(self.report.get("capture_error"))  # all ranks captured, or all stop
        time_graph_replays(self.strategy, self.step)
        if engine_name in PIPELINES and not resident:
            self.notes.append(f"{self.strategy.n_streams} streams")
        if "fallback" in self.report:
            self.notes.append(f"ran the 'full' strategy: {self.report['fallback']}")

    @property
    def report(self) -> dict[str, Any]:
        return self.strategy.report

    def source(self, n: int) -> Iterator[Batch]:
        return iter(self.env.staged()[:n]) if self.resident else super().source(n)

    def loop(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for info in self.strategy.run(batches, self.step, self.losses):
            self.losses.poll()  # as the trainer does: never blocks
            yield info.batch

    def finish(self, site: str) -> None:
        # Needed (inside drain/flush, counted): a run's time must include the work it queued.
        self.strategy.drain(f"{site}.drain")
        self.losses.flush(f"{site}.losses")

    def dump_graphs(self, directory: Path) -> list[Path]:
        dump = getattr(self.strategy, "dump_graphs", None)
        return dump(directory) if dump is not None else []

    def extra_bytes(self) -> int:
        pool = self.report.get("pool_mb") or 0.0  # graph memory pool (activations live there)
        staged = _bytes([t for b in self.env.staged() for t in (b.src, b.tgt_in, b.tgt_out)]) if self.resident else 0
        return int(pool * 2**20) + staged


class ResidentRunner(Runner):
    """Batches pre-staged on the GPU; a plain single-stream eager loop; losses deferred."""

    def source(self, n: int) -> Iterator[Batch]:
        return iter(self.env.staged()[:n])

    def loop(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for i, b in enumerate(batches):
            loss = self.step.forward(b)
            self.step.backward(loss)
            self.step.optimizer_step()
            self.losses.push(i + 1, loss)
            self.losses.poll()  # never blocks
            yield b

    def extra_bytes(self) -> int:
        return _bytes([t for b in self.env.staged() for t in (b.src, b.tgt_in, b.tgt_out)])


class PlainRunner(Runner):
    """What most training loops look like: blocking copy in, ``loss.item()`` out, every step."""

    def loop(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for batch in batches:
            if self.env.cuda:
                # The usual blocking copy: the host waits for it (and for the stream before it).
                b = host_sync("bench.plain.copy", lambda: batch.to(self.device))
            else:
                b = batch  # already where the model is: nothing to copy or wait for
            loss = self.step.forward(b)
            self.step.backward(loss)
            self.step.optimizer_step()
            # The usual per-step logging read: the host waits for the whole step to finish.
            self.last_loss = host_sync("bench.plain.loss", lambda: loss.item())
            yield batch


class CompiledPeerRunner(Runner):
    """``torch.compile(mode="reduce-overhead")`` of the same model: see the module docstring."""

    kind = "peer"

    def __init__(self, name: str, env: Env):
        super().__init__(name, env)
        t0 = time.perf_counter()
        inner = self.step.step  # the NMTStep inside the timing wrapper: its model is the one called
        base = getattr(inner.model, "_orig_mod", inner.model)  # with --compile: not compiled twice
        inner.model = torch.compile(base, mode="reduce-overhead", dynamic=False)
        fit_compile_cache(len(env.loader(0).shapes()))  # one compiled graph per batch shape
        # Compile (and record the graph trees) for every batch shape now, not inside a timed run.
        for shape in env.loader(0).shapes():
            b = env.example(shape).to(self.device, non_blocking=True)
            torch.compiler.cudagraph_mark_step_begin()
            loss = self.step.forward(b)
            self.step.backward(loss)
            self.step.optimizer.zero_grad(set_to_none=True)
        self.compile_s = time.perf_counter() - t0
        self.notes.append(f"compiled {len(env.loader(0).shapes())} shape(s) in {self.compile_s:.0f} s")

    def loop(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        for i, batch in enumerate(batches):
            b = batch.to(self.device, non_blocking=True)  # pinned: the copy does not block
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: graph-tree outputs may be reused
            loss = self.step.forward(b)
            self.step.backward(loss)
            self.step.optimizer_step()
            self.losses.push(i + 1, loss)  # copied out of the graph's output at once
            self.losses.poll()  # never blocks
            yield batch


class StockPeerRunner(CompiledPeerRunner):
    """The ``stock-ro`` row: :class:`CompiledPeerRunner` over the stock-PyTorch model and loss."""

    stock = True


def make_runner(name: str, env: Env) -> Runner:
    if name == "compile-ro":
        return CompiledPeerRunner(name, env)
    if name == "stock-ro":
        return StockPeerRunner(name, env)
    if name == "plain":
        return PlainRunner(name, env)
    if name == "resident":
        return ResidentRunner(name, env)
    if name == "resident-graph":
        return StrategyRunner(name, env, engine_name="graph", resident=True)
    return StrategyRunner(name, env)
