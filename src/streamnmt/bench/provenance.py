"""Where a benchmark ran from: the commit of the source tree, for its results file."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> dict[str, Any] | None:
    """The commit of the source tree this module runs from, if it is a git checkout."""
    here = str(Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}
