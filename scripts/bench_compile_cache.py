"""The compile cache, cold and warm: the same ``--compile on`` training run twice with one fresh
STREAMNMT_HOME, and how long each took from its data being loaded to being ready to train.

Usage (GPU machine, repository root): PYTHONPATH=src python3 scripts/bench_compile_cache.py --out "$OUT"

Each run is ``python3 -m streamnmt train --compile on --max-steps 20`` (the base model and the
defaults, the built-in corpus; ``--bleu-samples 0``: BLEU decoding is not what is measured) in a
process of its own. Two figures per run:

* ``ready_s``: the trainer's own start line, ``engine: ready in X s after the data (compile cache
  warm|cold ...)``, from the data loaded to the engine prepared (graph mode: compiled and captured);
* ``to_header_s``: seen from outside, the seconds between the ``data: ready`` line and the epoch
  table's header, the last line before the first training step (lines timed as they arrive).

By default each run is stopped with SIGTERM (the trainer finishes its step, saves and exits) once
its epoch header is out: what is measured is over by then, and the first evaluation would compile
every dev batch shape besides (cold: minutes). ``--complete`` lets the runs train their 20 steps.

The target (issue #31): the second run ready to train, compiled, within 10 s of its data.
Results: OUT/compile_cache.json, each run's log in OUT/compile_cache_run<N>.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TARGET_S = 10.0
READY = re.compile(r"engine: ready in ([0-9.]+) s after the data \(compile cache ([^:)]+)")
STATE = re.compile(r"engine: compile cache (\w+)")  # eager strategies: no ready line, the state alone
CAPTURED = re.compile(r"graph mode captured (\d+) shape\(s\) in ([0-9.]+) s")


def run_once(i: int, home: Path, work: Path, out: Path, extra: list[str], timeout: float, complete: bool) -> dict:
    cmd = [sys.executable, "-m", "streamnmt", "train", "--compile", "on", "--max-steps", "20", "--bleu-samples", "0",
           "--project", str(work / "runs"), "--name", f"run{i}", "--exist-ok", *extra]
    env = dict(os.environ, STREAMNMT_HOME=str(home), PYTHONUNBUFFERED="1")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)  # the cache's own directories under STREAMNMT_HOME, as a user gets them
    t0 = time.monotonic()
    seen: dict[str, float] = {}
    res: dict = {"run": i, "cmd": " ".join(cmd[1:])}
    log = out / f"compile_cache_run{i}.log"
    with open(log, "w") as f:
        # its own process group: a run cut short takes its compile workers with it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def overdue() -> None:
            res["timed_out"] = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(timeout, overdue)
        watchdog.start()
        try:
            for line in proc.stdout:  # timed as they arrive
                now = time.monotonic() - t0
                f.write(f"[{now:8.2f}] {line}")
                if line.startswith("data: ready") and "data" not in seen:
                    seen["data"] = now
                elif (m := READY.search(line)) is not None:
                    seen["ready"] = now
                    res["ready_s"], res["cache"] = float(m.group(1)), m.group(2).strip()
                    print(f"run {i}: {line.strip()}", flush=True)
                elif (m := CAPTURED.search(line)) is not None:
                    res["shapes"], res["capture_s"] = int(m.group(1)), float(m.group(2))
                elif line.lstrip().startswith("Epoch") and "header" not in seen:
                    seen["header"] = now
                    if not complete:
                        proc.send_signal(signal.SIGTERM)  # measured: stop cleanly after the current step
                        res["stopped"] = True
                elif line.startswith(("warning: compile cache", "engine: compile")):
                    if (m := STATE.search(line)) is not None:
                        res["cache"] = m.group(1)
                    print(f"run {i}: {line.strip()}", flush=True)
            proc.wait()
        finally:
            watchdog.cancel()
    res["rc"], res["wall_s"] = proc.returncode, round(time.monotonic() - t0, 1)
    if "data" in seen and "header" in seen:
        res["to_header_s"] = round(seen["header"] - seen["data"], 1)
    res["data_loaded_at_s"] = round(seen["data"], 1) if "data" in seen else None
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="where the JSON and the logs go")
    ap.add_argument("--home", default=None, help="STREAMNMT_HOME (default: a fresh temporary directory)")
    ap.add_argument("--runs", type=int, default=2, help="runs, the first cold (a fresh home), the others warm")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take")
    ap.add_argument("--complete", action="store_true", help="let each run train its 20 steps and evaluate")
    args, extra = ap.parse_known_args()  # anything else goes to `streamnmt train`
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_compile_cache."))
    home = Path(args.home) if args.home else work / "home"
    print(f"STREAMNMT_HOME={home}; extra train flags: {' '.join(extra) or '(none)'}", flush=True)
    results = [run_once(i, home, work, out, extra, args.timeout, args.complete) for i in range(1, args.runs + 1)]
    print(f"\n{'run':>3} {'cache':>6} {'ready_s':>8} {'to_header_s':>12} {'capture_s':>10} {'wall_s':>7} {'rc':>3}")
    for r in results:
        print(f"{r['run']:>3} {r.get('cache', '-'):>6} {r.get('ready_s', '-'):>8} {r.get('to_header_s', '-'):>12} "
              f"{r.get('capture_s', '-'):>10} {r['wall_s']:>7} {r['rc']:>3}")
    warm = [r for r in results[1:] if "ready_s" in r]
    met = bool(warm) and all(r["ready_s"] <= TARGET_S and r.get("cache") == "warm" for r in warm)
    print(f"target: warm runs ready within {TARGET_S:.0f} s of their data: {'met' if met else 'NOT met'}")
    (out / "compile_cache.json").write_text(json.dumps({"runs": results, "target_s": TARGET_S, "met": met}, indent=1))
    return 0 if all(r["rc"] == 0 or (r.get("stopped") and "timed_out" not in r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
