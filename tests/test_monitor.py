"""GPU/CPU monitors (no-ops without a GPU) and the plots."""

from __future__ import annotations

import time

import pytest
import torch

from streamnmt.engine import STATS
from streamnmt.training.monitor import CpuSampler, GpuTimer, NvmlSampler, TimedStep, time_graph_replays
from streamnmt.training.plots import plot_bench, plot_results, plot_timeline

RESULTS = """epoch,train_loss,val_loss,bleu,tokens_per_s,epoch_s,gpu_busy
1,5.21,4.80,,12000.5,10.2,35.0
2,4.10,3.95,3.2,12500.0,9.8,
3,3.52,3.61,7.9,12610.2,9.7,41.5
"""


def test_gpu_timer_is_a_noop_without_cuda():
    timer = GpuTimer("cpu")
    assert not timer.enabled
    for _ in range(3):
        timer.start()
        timer.stop()
    assert timer.collect() == 0.0


def test_nvml_sampler_is_a_noop_without_a_gpu():
    s = NvmlSampler("cpu")
    assert not s.available
    with s:
        time.sleep(0.01)
    assert s.result == {} and s.stop() == {}


def test_cpu_sampler_measures_this_process():
    s = CpuSampler().start()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05:
        sum(range(1000))
    r = s.stop()
    assert 10 < r["process_pct"] < 400 and r["workers_pct"] >= 0 and 0 <= r["system_pct"] <= 100
    assert r["util_pct"] == r["process_pct"] + r["workers_pct"]


def test_cpu_sampler_counts_worker_processes():
    import subprocess
    import sys

    import psutil
    s = CpuSampler().start()
    busy = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 20: sum(range(1000))"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        t = time.perf_counter()  # sampled while the child runs (a loader worker lives for the whole epoch)
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.2 and time.perf_counter() - t < 15:
            time.sleep(0.05)
        r = s.stop()
    finally:
        child.kill()
        child.wait()
    assert r["workers_pct"] > 1 and r["util_pct"] > r["process_pct"]


class _Step:
    def __init__(self):
        self.calls = []
        self.extra = 42

    def forward(self, batch):
        self.calls.append("f")
        return torch.tensor(float(batch))

    def backward(self, loss):
        self.calls.append("b")

    def optimizer_step(self):
        self.calls.append("o")


def test_timed_step_passes_through():
    inner = _Step()
    step = TimedStep(inner, GpuTimer("cpu"), annotate=True)
    loss = step.forward(3)
    step.backward(loss)
    step.optimizer_step()
    assert inner.calls == ["f", "b", "o"] and loss.item() == 3.0 and step.extra == 42

    class NoGraphs:
        report: dict = {}
    assert time_graph_replays(NoGraphs(), step) == 0


@pytest.mark.plots
def test_plot_results_from_a_hand_written_csv(tmp_path):
    (tmp_path / "results.csv").write_text(RESULTS)
    path = plot_results(tmp_path)
    assert path == tmp_path / "results.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "results.csv").write_text("epoch,train_loss,val_loss,bleu,tokens_per_s,epoch_s\n1,5,4.5,,100,1\n")
    assert plot_results(tmp_path).stat().st_size > 1000  # one epoch, no BLEU, no gpu_busy column


def test_plot_bench_and_timeline(tmp_path):
    rows = [{"name": "baseline", "ms_per_step": 40.0, "ms_min": 39.0, "ms_max": 42.0},
            {"name": "resident", "ms_per_step": 30.0, "ms_min": 30.0, "ms_max": 30.5}]
    assert plot_bench(rows, tmp_path / "bench.png").stat().st_size > 1000
    timelines = {"deep": {"ops": [(13, 0.0, 1.0, "forward"), (13, 1.2, 2.0, "backward"), (14, 3.3, 0.5, "optimizer"),
                                  (7, 0.1, 0.2, "copy HtoD")], "syncs": [(4.0, 1.0)]},
                 "graph": {"ops": [(20, 0.0, 3.0, "graph replay")], "syncs": []}}
    assert plot_timeline(timelines, tmp_path / "timeline.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="CUDA"):
        plot_timeline({"cpu": {"ops": [], "syncs": []}}, tmp_path / "none.png")


@pytest.mark.gpu
def test_gpu_timer_defers_reading_to_collect():
    timer = GpuTimer("cuda")
    STATS.reset()
    for _ in range(50):
        timer.start()
        torch.cuda._sleep(200_000)  # ~0.1 ms of GPU time per step
        timer.stop()
    assert STATS.count == 0  # nothing waited inside the loop
    total = timer.collect("test.gpu_timer")
    assert total > 0 and timer.collected == 50 and STATS.count <= 1
    assert len(timer.free) + len(timer.pending) <= 50  # pairs are reused once read


@pytest.mark.gpu
def test_nvml_sampler_samples_while_active():
    s = NvmlSampler("cuda", interval_s=0.02)
    if not s.available:
        pytest.skip("NVML not available")
    with s:
        x = torch.randn(4096, 4096, device="cuda")
        t = time.perf_counter()
        while time.perf_counter() - t < 0.3:
            x = x @ x
            x = x / x.norm()
        torch.cuda.synchronize()
    assert s.result["samples"] >= 3 and 0 <= s.result["util_mean_pct"] <= 100 and s.result["mem_max_mb"] > 0
