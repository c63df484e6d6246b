from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable

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
