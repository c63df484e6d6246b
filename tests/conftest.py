from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# One intra-op thread (see single_thread) in the processes the tests start (`python -m streamnmt`,
# torchrun ranks) unless the caller chose a number; in the test process, modules that train ask
# for it (the one_thread fixture).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@contextlib.contextmanager
def single_thread():
    """One intra-op thread: tiny models gain nothing from more, and on a 2-core CI machine
    OpenMP threads spinning against loader workers or other processes make steps 10-50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def in_child(fn: Callable[[], int], timeout: float = 120.0) -> int:
    """``fn()`` in a forked child of the test process (its imports paid once, which a fresh
    ``python -m streamnmt`` pays again); its return value is the exit code (-9: killed by SIGKILL)."""
    def body() -> None:
        code = 99
        try:
            code = fn()
        except BaseException as e:  # noqa: BLE001 - reported through the exit code
            print(f"child raised {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    proc = multiprocessing.get_context("fork").Process(target=body)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("the run in a forked child hung")
    return proc.exitcode


_DRAW_RESULTS_PNG = {"on": False}


@pytest.fixture(autouse=True, scope="session")
def _results_png_built_not_drawn():
    """In the test process a run's results.png figure is built from its files as ever (every series
    read, every curve added) but neither drawn nor written unless the test is marked ``plots``: its
    layout and rendering cost as much as a tiny run's training, and few tests look at it. The
    processes the tests start (``python -m streamnmt``, torchrun ranks) draw it as ever."""
    from streamnmt.training import plots

    real_save = plots._save

    def save(fig, path, dpi=120):
        if Path(path).name == "results.png" and not _DRAW_RESULTS_PNG["on"]:
            return Path(path)
        return real_save(fig, path, dpi)

    mp = pytest.MonkeyPatch()
    mp.setattr(plots, "_save", save)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _results_png_drawn_where_marked(request):
    _DRAW_RESULTS_PNG["on"] = request.node.get_closest_marker("plots") is not None
    yield
    _DRAW_RESULTS_PNG["on"] = False


@pytest.fixture(scope="module")
def one_thread():
    with single_thread():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
