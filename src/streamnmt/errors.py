"""Errors the user can act on.

Every error a user can cause by a flag, a config key or an input file is raised as one of these
two classes; the CLI turns them into one line on stderr and a non-zero exit code, never a
traceback.
"""

from __future__ import annotations


def one_line(e: BaseException, typed: bool = False, limit: int = 160) -> str:
    """``e``'s message in one line for a log line: its first line, cut at ``limit`` characters (the
    exception's type where it has no message); ``typed``: ``Type: message``."""
    text = str(e).strip()
    first = text.splitlines()[0][:limit] if text else ""
    if typed:
        return f"{type(e).__name__}: {first}"
    return first or type(e).__name__


class ConfigError(ValueError):
    """A flag or config key has a value that is not allowed (exit code 2).

    The message names the flag or key and says what is allowed, e.g.
    ``--batch-size: must be a positive integer, got 0``.
    """

    exit_code = 2


class InputError(Exception):
    """An input file is missing or malformed (exit code 1).

    The message names the file and, where there is one, the line, column, record index or byte
    offset, e.g. ``data/train.json:12:5: expected ',' or ']'``.
    """

    exit_code = 1


class NonFiniteLoss(Exception):
    """Training stopped on a non-finite loss (``--on-nan stop``); exit code 1."""

    exit_code = 1


class DeviceError(Exception):
    """The device failed under a running strategy (e.g. a CUDA event query raised); exit code 1.

    Raised instead of waiting on a device that will not answer, with one line naming the strategy,
    the batch and the device's own message.
    """

    exit_code = 1
