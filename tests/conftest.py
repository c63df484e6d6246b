from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
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


class Forked:
    """``fn()`` in a forked child of the test process, in a session of its own, with ``env`` as its
    whole environment and its stdout and stderr (those of the processes it starts too) in files: a
    launcher (torchrun's ``main``, ``streamnmt train --nproc``'s ``cli.main``) as a fresh ``python -m``
    runs it, less the interpreter's start and torch's import, which a launcher pays before its ranks
    start theirs. Answers as much of ``subprocess.Popen`` as the tests use; its exit code is ``fn()``'s
    return value or ``SystemExit``'s code, 1 for another exception, -N for a death by signal N. Not
    for work on a GPU: a forked child cannot use the CUDA context the test process may have made."""

    def __init__(self, fn: Callable[[], int | None], env: Mapping[str, str]):
        self.returncode: int | None = None
        self._out, self._err = (tempfile.TemporaryFile("w+", encoding="utf-8") for _ in range(2))  # noqa: SIM115
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            self._child(fn, env)

    def _child(self, fn: Callable[[], int | None], env: Mapping[str, str]) -> None:
        code = 1
        try:
            os.setsid()
            os.dup2(self._out.fileno(), 1)
            os.dup2(self._err.fileno(), 2)
            sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            logging.root.handlers.clear()  # pytest's capture: log records go to stderr, as in a fresh process
            os.environ.clear()
            os.environ.update(env)
            code = fn() or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as an uncaught exception in a fresh process: its traceback, exit 1
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr once it has exited (``subprocess.TimeoutExpired`` after ``timeout``)."""
        self.wait(timeout)
        texts = []
        for f in (self._out, self._err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return texts[0], texts[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

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
