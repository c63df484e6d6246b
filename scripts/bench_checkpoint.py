"""How long a checkpoint save stalls the training loop: background writes against synchronous ones.

Builds the base model with a realistic vocabulary (``--vocab``, 32,000 pieces a side), gives Adam
its moments with a few training steps, and times :meth:`streamnmt.training.checkpointer.Checkpointer.save`
of the full ``last.pt`` state, as the trainer calls it (drained streams): with a background writer the
call returns once the state is staged in pinned host memory; synchronously it returns once the file is
renamed into place. While the writer writes, eager training steps run, and their time is set
against steps with no write in flight (the writer's pickling shares the host with the loop).

    python3 scripts/bench_checkpoint.py --out out/bench_checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from streamnmt.syncstats import host_sync  # noqa: E402
from streamnmt.fsutil import atomic_write  # noqa: E402
from streamnmt.models.transformer import make_model  # noqa: E402
from streamnmt.training.checkpointer import Checkpointer  # noqa: E402
from streamnmt.training.step import example_batch, make_step  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=4096, help="target positions per training step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(args.vocab, args.vocab, d_model=512, n_layers=6, n_heads=8, d_ff=2048, dropout=0.1).to(device)
    step = make_step(model, device, d_model=512, warmup=4000, amp="bf16" if device.type == "cuda" else "off")
    batch = example_batch((args.tokens // 64, 64, 64), model.shape, 0).to(device)

    def one_step() -> float:
        t0 = time.perf_counter()
        step.begin_micro(True)
        step.backward(step.forward(batch))
        step.optimizer_step()
        # Needed: each step's own time, from an idle GPU to a finished step.
        host_sync("bench.step", lambda: torch.cuda.synchronize(device) if device.type == "cuda" else None)
        return time.perf_counter() - t0

    for _ in range(5):  # Adam's moments exist, lazy initialisations are done
        one_step()
    quiet = statistics.median(one_step() for _ in range(20))

    state = lambda: {"model": model.state_dict(), "optimizer": step.optimizer.state_dict(), "step": 1}  # noqa: E731
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for background in (True, False):
            c = Checkpointer(device, background=background)
            c.save(Path(tmp) / "warm.pt", state())  # pinned buffers allocated here, as at a run's first save
            c.close()
            stalls, writes, during = [], [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                stalls.append(c.save(Path(tmp) / "last.pt", state()))
                while c.busy:  # training goes on while the writer writes
                    during.append(one_step())
                c.close()
                writes.append(time.perf_counter() - t0)
            size = (Path(tmp) / "last.pt").stat().st_size
            rows["async" if background else "sync"] = {
                "stall_ms_median": 1e3 * statistics.median(stalls), "stall_ms_max": 1e3 * max(stalls),
                "write_s_median": statistics.median(writes), "size_mb": size / 2 ** 20,
                "step_ms_quiet": 1e3 * quiet, "step_ms_during_write_median": 1e3 * statistics.median(during or [0]),
                "steps_during_write": len(during)}
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    for k, r in rows.items():
        print(f"{k:>5}: {r['size_mb']:.0f} MiB last.pt; loop waits {r['stall_ms_median']:.1f} ms median "
              f"(max {r['stall_ms_max']:.1f}); the whole write {r['write_s_median']:.2f} s; step {r['step_ms_quiet']:.1f} "
              f"ms alone, {r['step_ms_during_write_median']:.1f} ms during a write ({r['steps_during_write']} steps) "
              f"({name})")
    if args.out:
        atomic_write(args.out, json.dumps({"device": name, "vocab": args.vocab, **rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
