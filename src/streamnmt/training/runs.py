"""Run directories and the CSV logs inside them, as the original trainer laid them out.

``--project runs/train --name exp`` gives ``runs/train/exp``, then ``exp2``, ``exp3``... (YOLOv5's
``increment_path``); ``--exist-ok`` reuses the directory. Inside: ``config.yaml``,
``weights/{best,last}.pt``, ``results.csv`` (one row per epoch), ``steps.csv`` (one row per
optimizer step, losses written with ``repr`` so two runs compare exactly), ``sync_stats.json``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Any

from streamnmt.errors import ConfigError
from streamnmt.fsutil import atomic_write


def check_project(project: str | Path) -> None:
    """Refuse a ``--project`` the run could not make its folder in, before the set-up spends its
    seconds on data and model (the folder itself is made only once everything is valid, so that a
    bad input leaves nothing behind). The nearest existing folder of the path must be a writable folder."""
    path = Path(project).absolute()
    nearest = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if nearest is None:
        return
    if not nearest.is_dir():
        raise ConfigError(f"--project: {nearest} is not a folder (a run is written to {path}/NAME)")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"--project: cannot write in {nearest} (a run is written to {path}/NAME)")


def check_weights_kept(project: str | Path, name: str, exist_ok: bool, weights: str | None) -> None:
    """``--exist-ok`` reuses ``project/name`` and removes the earlier run's weights files there
    (:data:`EARLIER_WEIGHTS`) before the new run writes its own: a ``--weights`` among them (a fine-tune
    from the earlier run's best.pt into the same folder) would be deleted once loaded."""
    if not (exist_ok and weights):
        return
    folder = (Path(project) / name / "weights").resolve()
    given = Path(weights).resolve()
    if given.parent == folder and is_earlier_weights(given.name):
        raise ConfigError(f"--weights: {weights} is in the folder --exist-ok reuses ({folder.parent}), whose "
                          "earlier weights files are removed before the run starts: copy it elsewhere or "
                          "give another --name")


# The files a new run in a reused (--exist-ok) folder removes: an earlier run's, not this one's.
EARLIER_WEIGHTS = ("best.pt", "best.safetensors", "ema.pt", "last.pt")


def is_earlier_weights(filename: str) -> bool:
    return filename in EARLIER_WEIGHTS or re.fullmatch(r"step_.*\.pt", filename) is not None


def increment_path(project: str | Path, name: str, exist_ok: bool = False) -> Path:
    """``project/name`` if free (or exist_ok), else the next free ``project/name{2,3,...}``."""
    path = Path(project) / name
    if exist_ok or not path.exists():
        return path
    taken = {p.name for p in Path(project).iterdir()}
    pattern = re.compile(rf"^{re.escape(name)}(\d+)$")
    n = max([int(m.group(1)) for t in taken if (m := pattern.match(t))] + [1]) + 1
    while f"{name}{n}" in taken:
        n += 1
    return Path(project) / f"{name}{n}"


class CsvLog:
    """Append rows to a CSV file, writing the header once; flushed per row so a kill loses nothing."""

    def __init__(self, path: Path, columns: list[str], truncate_after: int | None = None):
        self.path, self.columns = path, columns
        exists = path.exists() and path.stat().st_size > 0
        if exists and truncate_after is not None:
            self._truncate(truncate_after)
        if exists:
            self._match_header()
        self.f = open(path, "a", newline="", encoding="utf-8")
        self.w = csv.writer(self.f)
        if not exists:
            self.w.writerow(columns)
            self.f.flush()

    def _truncate(self, last_key: int) -> None:
        """Keep the header and rows whose first column is <= ``last_key`` (a resumed run rewrites
        what came after its checkpoint)."""
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        keep = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= last_key]
        atomic_write(self.path, "".join(",".join(r) + "\r\n" for r in keep))

    def _match_header(self) -> None:
        """A file of an earlier version (other columns) is rewritten under today's header, its
        values kept by column name, so that appended rows line up with the header."""
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        if rows and rows[0] != self.columns:
            old = [dict(zip(rows[0], r)) for r in rows[1:] if r]
            atomic_write(self.path, "".join(",".join(r) + "\r\n" for r in
                                            [self.columns, *([d.get(c, "") for c in self.columns] for d in old)]))

    def write(self, row: dict[str, Any]) -> None:
        self.w.writerow([_fmt(row.get(c, "")) for c in self.columns])
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return "" if v is None else str(v)


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_json(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
