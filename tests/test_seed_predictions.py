"""scripts/seed_predictions.py: the seeds' predictions against a bench run's summary rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "seed_predictions.py"


def row(name, ms, syncs, sync_ms, cpu, kernels, peak, noise=False):
    return {"name": name, "ms_per_step": ms, "ms_min": ms - 1, "ms_max": ms + 1, "sync_count": syncs,
            "sync_ms": sync_ms, "cpu_pct": cpu, "cpu_util_pct": cpu + 5, "kernel_busy_pct": kernels,
            "nvml_util_pct": kernels, "peak_mem_mb": peak, "speedup_noise": noise}


def test_predictions_table(tmp_path):
    record = {"date": "2026-11-23T00:00:00+00:00", "git": {"commit": "abc", "dirty": False},
              "device": {"name": "GPU"}, "config": {"steps": 100, "model": "base", "amp": "bf16", "batch_size": 32,
                                                    "max_len": 32, "repeats": 3},
              "summary": [row("baseline", 40.0, 100, 2500.0, 60, 70, 1000),
                          row("interval", 39.5, 11, 300.0, 82, 72, 1000, noise=True),
                          row("deep", 35.0, 10, 100.0, 70, 92, 2500)]}
    (tmp_path / "bench.json").write_text(json.dumps(record))
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True).stdout
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in out.splitlines() if line.startswith("| ")}
    assert "| 11 | 3.000 |" in lines[("interval", "39.50 [38.50-40.50]")]  # syncs / 100 steps, wait ms per batch
    verdict = {k: line.split("|")[4].strip().split(" ")[0] for k, line in lines.items() if len(line.split("|")) == 6}
    assert verdict[("host syncs -90 % (N -> N/10)", "interval")] == "not"  # 89 %: N -> N/10 + 1
    assert verdict[("host syncs -90 % (N -> N/10)", "deep")] == "met"
    assert verdict[("CPU wait per batch 20-30 ms -> 2-3 ms", "deep")] == "met"
    assert verdict[("CPU wait per batch 20-30 ms -> 2-3 ms", "interval")] == "not"
    assert verdict[("CPU utilisation 60-70 % -> 80-85 % (stage 1)", "interval")] == "met"
    assert verdict[("training time -3-5 % (stage 1)", "interval")] == "not"  # within noise
    assert verdict[("training time -10-15 % (stage 2)", "deep")] == "met"  # -12.5 %
    assert verdict[("GPU utilisation 70-80 % -> 90-95 % (stage 2; 85-90 % with 3 streams)", "deep")] == "met"
    assert verdict[("memory x2-3 (4 streams, a cost)", "deep")] == "met"  # x2.5
