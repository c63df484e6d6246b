"""Faults the tests inject through environment variables, read in this one place.

Each hook is off unless its variable is set (a run a user starts sets none); the tests set them on
the processes they start, so the code under test runs as a user's would up to the fault.

- ``STREAMNMT_TEST_KILL_AT_STEP=N``: the trainer kills its own process (SIGKILL) once step N and its
  checkpoints are done (kill-and-resume tests);
- ``STREAMNMT_INJECT_INF_STEP=N``: the N-th call of the training step (1-based) has a non-finite loss
  (the ``--on-nan`` policy);
- ``STREAMNMT_INJECT_INF_GRAD_FROM=N``: from the N-th call on, an infinite gradient under a finite loss;
- ``STREAMNMT_TEST_CAPTURE_FAIL_RANK=R``: graph capture "fails" on rank R (the ranks' agreement on a
  failed capture).
- ``STREAMNMT_TEST_COMPILE_CHILD_FAILS=1``: ``--compile background``'s child fails at its start (the
  run goes on uncompiled).
- ``STREAMNMT_TEST_COMPILE_BACKEND=NAME``: torch.compile's backend for the training step (``eager``:
  TorchDynamo traces, nothing is generated: the CPU tests of ``--compile background`` in seconds).
"""

from __future__ import annotations

import os

KILL_AT_STEP = "STREAMNMT_TEST_KILL_AT_STEP"
INF_LOSS_CALL = "STREAMNMT_INJECT_INF_STEP"
INF_GRAD_FROM_CALL = "STREAMNMT_INJECT_INF_GRAD_FROM"
CAPTURE_FAIL_RANK = "STREAMNMT_TEST_CAPTURE_FAIL_RANK"
COMPILE_CHILD_FAILS = "STREAMNMT_TEST_COMPILE_CHILD_FAILS"
COMPILE_BACKEND = "STREAMNMT_TEST_COMPILE_BACKEND"


def _number(name: str) -> int:
    return int(os.environ.get(name) or 0)


def kill_at_step() -> int:
    """The step after which the trainer kills its process (0: never)."""
    return _number(KILL_AT_STEP)


def inf_loss_call() -> int:
    """The call of the training step whose loss is made non-finite (0: none)."""
    return _number(INF_LOSS_CALL)


def inf_grad_from_call() -> int:
    """The call of the training step from which gradients are made infinite (0: none)."""
    return _number(INF_GRAD_FROM_CALL)


def capture_failure() -> str | None:
    """Why graph capture "fails" on this rank (``RANK``, 0 without torchrun), or None."""
    want = os.environ.get(CAPTURE_FAIL_RANK)
    if want is not None and want == os.environ.get("RANK", "0"):
        return f"injected by {CAPTURE_FAIL_RANK}"
    return None


def compile_child_fails() -> bool:
    """``--compile background``'s child process fails before it compiles."""
    return _number(COMPILE_CHILD_FAILS) > 0


def compile_backend() -> str | None:
    """torch.compile's backend for the training step (None: torch's default, Inductor)."""
    return os.environ.get(COMPILE_BACKEND) or None
