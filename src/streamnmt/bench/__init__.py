"""``streamnmt bench``: the synchronisation strategies side by side, in one process, measured.

Every row trains the same model (same seed) on the same batches (the trainer's loader over the
built-in corpus), is built once and run ``repeats`` times interleaved with the others; the table
shows the median and the min-max range of the runs. How each number is computed, per timed run of
``steps`` steps (after ``warmup`` untimed steps and a drain):

* **ms/step** = wall time / steps; the wall time runs from the first step's launch to the end of the
  drain after the last (all queued work finished, all losses read).
* **tokens/s** = target tokens (non-padding, ``Batch.ntokens``) of the timed batches / wall time.
* **vs baseline** = baseline's median ms / the row's median ms; **% of limit** = the limit row's
  median ms / the row's (limit: ``resident``; for ``graph`` and itself: ``resident-graph``). When the
  medians differ by less than the larger of the two min-max ranges, "within noise" is printed.
* **MFU** = model FLOPs of the timed batches (``flops.training_flops``: 3 x the forward pass's matrix
  products on the padded shapes, attention and generator included) / wall time / the device's dense
  peak for the precision in use (``flops.PEAK_TFLOPS``); n/a for unknown devices and on CPU.
* **GPU span** = sum over steps of the GPU time between a CUDA event recorded before the step's
  first kernel and one after its optimizer step (graph mode: around the replay), on the streams
  they run on (``monitor.GpuTimer``; read after the run, no wait inside the loop) / wall time. Gaps
  between steps are excluded, launch gaps inside a step are not: it reads near 100 % whenever the
  GPU never waits *between* steps, however sparse the kernels inside them (launch-bound eager).
* **GPU kernels** (with ``--profile``) = the GPU time covered by kernels and copies (union over
  streams) per profiled step, from the trace, / the row's median ms/step: the true busy share.
  The profiler slows the host, not the kernels, so kernel time is taken from the trace and wall
  time from the unprofiled runs.
* **NVML util** = mean of NVML utilisation samples (share of time any kernel ran) taken every
  ~100 ms by a thread during the run; coarse for runs shorter than a couple of seconds.
* **CPU** = this process's user+system CPU time / wall time (100 % = one core); **CPU+workers**
  adds its loader worker processes' CPU time (the trainer's ``cpu_util``); each share apart is in
  ``bench.json``.
* **syncs**, **sync ms** = host waits counted by ``host_sync`` inside the timed loop (every
  strategy's and this benchmark's blocking calls go through it); the end-of-run drain is recorded
  separately (``end_syncs``).
* **peak MB** = ``torch.cuda.max_memory_allocated`` during the run (reset before it), minus what was
  allocated at its start, plus this row's own weights, optimizer state, staged batches and graph
  pool: other rows' models, alive in the same process, are left out.

Reference rows: ``resident`` (batches pre-staged on the GPU, single-stream eager loop, deferred
losses: the limit of eager mode), ``resident-graph`` (the graph strategy on the same resident
batches: the limit of graph mode; CUDA only) and ``plain`` (blocking ``.to(device)`` and ``loss.item()``
every step, both counted: two waits per step on CUDA, one on CPU, where there is nothing to copy). See ``runners`` for each row and ``profile`` for the ``--profile`` analysis.

Several GPUs (``--nproc N``, or a list ``1,2,4`` for a scaling table): the rows run on N processes
through torchrun, DDP on each rank; ms/step is the slowest rank's, tokens/s counts all ranks' tokens,
tokens/s per GPU is that / N. See ``scaling``.
"""

from __future__ import annotations

from streamnmt.bench.config import BenchConfig
from streamnmt.bench.flops import forward_flops, peak_flops, training_flops
from streamnmt.bench.stats import NOISE, spread, within_noise


def run_bench(cfg: BenchConfig) -> int:
    """Run the benchmark described by ``cfg``; returns the exit code (the CLI's ``bench`` command)."""
    from streamnmt.bench.main import run_bench as run

    return run(cfg)


__all__ = ["BenchConfig", "NOISE", "forward_flops", "peak_flops", "run_bench", "spread", "training_flops",
           "within_noise"]
