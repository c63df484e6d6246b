"""Which torch device a command runs on, and its random seeds.

Training, translation, evaluation and the benchmark all turn a ``--device`` value into a
``torch.device`` the same way. It lives in its own module, below all of them, so that none of
those commands has to import another to get it.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def resolve_device(name: str | None) -> torch.device:
    """``name`` (cpu, cuda, cuda:N; validated by the configs) or, when None, cuda if present."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators (every device's) from one seed."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
