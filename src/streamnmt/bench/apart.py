"""Rows measured in a process of their own, then joined to the table.

The compile-ro peer runs ``torch.compile(mode="reduce-overhead")``, whose CUDA graph trees manage
CUDA graphs, their memory pool and the generator states of dropout themselves. In a bench process
that also replays graph mode's captured step, the first replay of that step after the trees have
run ended in a segmentation fault (the packed base-model shape, docs/PERFORMANCE.md
section 9; not at 32 x 32). So when compile-ro shares a run with a row that replays CUDA graphs
(:data:`APART`), compile-ro runs first, in a child ``streamnmt bench`` of the same settings
(``OUT/compile-ro/``: its own bench.json and log), and its timed runs join this run's table: that
row is then measured before the others rather than interleaved with them, which its note says. A
child that fails leaves its row out, with one line saying why; the rest of the run goes on.
The stock-ro peer (the same compile of a stock-PyTorch model) runs apart from those rows and from
compile-ro alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamnmt.bench.config import BenchConfig
from streamnmt.bench.scaling import config_argv

# row -> the rows it must not share a process with
APART: dict[str, frozenset[str]] = {"compile-ro": frozenset({"graph", "resident-graph"}),
                                    # reduce-overhead's graph trees: not two compiled peers in one process
                                    "stock-ro": frozenset({"graph", "resident-graph", "compile-ro"})}
CHILD = "STREAMNMT_BENCH_CHILD"  # set in a child's environment: a child never splits again


@dataclass
class ChildRow:
    """A row measured by a child bench: what ``bench.main`` records of an in-process runner."""

    name: str
    kind: str
    workers: int
    report: Any
    runs: list[dict[str, Any]]
    ready_s: float
    notes: list[str] = field(default_factory=list)
    profile: dict[str, Any] | None = None


def rows_apart(names: list[str], torchrun: bool = False) -> list[str]:
    """The rows of ``names`` to measure in a process of their own: none inside a child, and none
    in a rank of torchrun's (a child would inherit the rank's rendezvous settings; on several
    ranks compile-ro is left out anyway)."""
    if torchrun or os.environ.get(CHILD):
        return []
    return [n for n in names if APART.get(n, frozenset()) & (set(names) - {n})]


def run_apart(name: str, cfg: BenchConfig, out: Path, log: Callable[[str], None]) -> ChildRow | str:
    """Row ``name`` measured by a child ``streamnmt bench`` with the settings of ``cfg`` into
    ``out/name``: its :class:`ChildRow`, or why it could not be measured."""
    where = out / name
    where.mkdir(parents=True, exist_ok=True)
    argv = config_argv(dataclasses.replace(cfg, strategies=name, references=False, nproc=None, out=str(where)))
    log(f"bench: {name} runs first, in a process of its own (a row that replays CUDA graphs shares this run); "
        f"log: {where / 'bench.log'}")
    with open(where / "bench.log", "w", encoding="utf-8") as f:
        code = subprocess.run([sys.executable, "-m", "streamnmt", "bench", *argv], stdout=f,
                              stderr=subprocess.STDOUT, env=dict(os.environ, **{CHILD: "1"})).returncode
    try:
        record = json.loads((where / "bench.json").read_text(encoding="utf-8")) if code == 0 else None
        r = record["runners"][name] if record else None
    except (OSError, ValueError, KeyError):
        r = None
    if r is None:
        return f"{name} left out: its own process ended with exit code {code} (see {where / 'bench.log'})"
    profile = (record.get("profile") or {}).get(name)
    if profile and profile.get("trace"):
        profile = {**profile, "trace": f"{name}/{profile['trace']}"}
    note = "measured in a process of its own, before the other rows (not interleaved with them)"
    return ChildRow(name, r["kind"], r["workers"], r["report"], r["runs"], r["ready_s"], [*r["notes"], note],
                    profile)
