"""What every helper process of the data pipeline does first (loader workers, the packing planner)."""

from __future__ import annotations

import contextlib
import signal
import sys


def detach(*, ignore_sigterm: bool = True) -> None:
    """Helpers end when the trainer process dies, even by SIGKILL. (A loader worker's own watchdog
    notices a dead parent, but a worker with results still queued then blocks forever flushing its
    pipe.)

    They ignore SIGTERM and SIGINT: those ask the trainer to finish its step and save, and reach
    the helpers too when sent to the whole process group (Ctrl-C in a terminal, torchrun stopping
    its workers); a helper that died of them would fail the trainer's next batch instead.
    ``ignore_sigterm=False`` is for a multiprocessing daemon process: multiprocessing ends those
    with SIGTERM when the trainer exits, and joins them, so one that ignored it would hang the exit.
    That one gets SIGTERM's default explicitly: a fork inherits the parent's handlers, and the
    trainer's (which only asks the loop to stop) would keep it alive through the join."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_sigterm else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # a parent that forked with them blocked (see fork_blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def fork_blocked():
    """Fork helpers inside this: SIGTERM and SIGINT stay blocked in this thread meanwhile, so that a
    child gets one sent before its :func:`detach` only once its own handlers are set (else the
    parent's handlers, which the fork copies, would take it); the parent gets one sent meanwhile
    as soon as this ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
