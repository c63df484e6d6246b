"""Data-parallel training on several processes: torch.distributed set-up and the few collectives
the trainer needs beside DistributedDataParallel's own.

A run on N processes is started by ``torchrun`` (``torchrun --nproc-per-node N -m streamnmt train``
or ``streamnmt train --nproc N``, which execs torchrun), which sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``. :func:`init` reads them, checks the set-up (one GPU per local rank, a backend the
device can use), makes the process group (NCCL on CUDA, gloo on CPU) with a timeout, so a dead or
hung rank ends the run instead of hanging it, and a second, gloo, group for host-side agreement:
the stop flag after a signal, the epoch-end wait for rank 0's evaluation, gathering RNG states
for a checkpoint. Those block the host on the other ranks (not on the GPU); they go through
``host_sync`` all the same, so every wait of the loop is counted.

Under torchrun the process group is joined and the model wrapped in DDP at any world size, even
1, so that one GPU (or one CPU process with gloo) runs the same code path as N. Without torchrun
(no ``WORLD_SIZE``) everything here is a no-op and the trainer runs as one process.

The rank logic the trainer needs lives here, not as rank checks through it: :func:`parallelize`
(DDP, built lazily by the step under the stream its forwards run on), :func:`prepare_once` (rank
0 prepares the data, the others wait, then every rank checks that it has rank 0's tokenizers and
cache entries), :meth:`Dist.agree_on_capture` (graph capture succeeds or fails for all ranks
together), :func:`wait_event` (a host wait on replayed GPU work, collectives included, that ends
in :class:`PeerLost` instead of hanging) and :class:`NullLog`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from streamnmt.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used, so that the CLI starts fast
    import torch

CONTROL_TIMEOUT_S = 3 * 3600  # the epoch-end wait covers rank 0's validation and BLEU
POLL_S = 50e-6  # how often a polling host wait asks whether an event has completed


class PeerLost(Exception):
    """A collective failed: another rank died, hung or lost its connection. Exit code 3 tells the
    launcher (:func:`run_torchrun`) that this rank is a bystander, so it names the rank that failed
    first for its own reason, not the peer that noticed first."""

    exit_code = 3


class CaptureFailed(Exception):
    """Graph capture failed on a rank; every rank stops with the same line (exit code 1)."""

    exit_code = 1


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device | None = None  # this rank's device (None: the caller resolves --device)
    control: Any = field(default=None, repr=False)  # gloo group for host-side waits on rank 0 (long)
    # gloo group for host-side exchanges the ranks reach together (a stop, RNG states, capture
    # outcomes): a rank that hangs there is lost after --dist-timeout, not CONTROL_TIMEOUT_S
    lockstep: Any = field(default=None, repr=False)

    timeout_s: float = 600.0  # --dist-timeout: how long a wait on another rank may take

    @property
    def active(self) -> bool:
        """In a process group (under torchrun, even of one process): DDP, collectives, agreement."""
        return self.world > 1 or self.backend is not None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def reduce_sum_(self, t: torch.Tensor) -> None:
        """In-place sum across ranks, queued on the current stream (no host wait with NCCL)."""
        import torch.distributed as dist
        dist.all_reduce(t)

    def agree(self, flag: bool, site: str = "dist.stop", long_wait: bool = False) -> bool:
        """True on every rank if ``flag`` is True on any (e.g. a signal reached one rank). The ranks
        come together within --dist-timeout, unless ``long_wait`` (some rank works alone first)."""
        return self.agree_any((flag,), site, long_wait)[0]

    def agree_any(self, flags: tuple[bool, ...], site: str = "dist.stop", long_wait: bool = False) -> tuple[bool, ...]:
        """:meth:`agree` for several flags in one host-side all-reduce: each True on every rank if
        it is True on any. A flag only rank 0 sets (others pass False) gives rank 0's answer."""
        if not self.active:
            return tuple(flags)
        import torch
        import torch.distributed as dist

        from streamnmt.syncstats import host_sync
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        # Needed: all ranks must stop (and evaluate) after the same step; host-side (gloo), not a GPU wait.
        group = self.control if long_wait or self.lockstep is None else self.lockstep
        host_sync(site, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
        return tuple(bool(v) for v in t.tolist())

    def broadcast(self, obj: Any, site: str = "dist.broadcast") -> Any:
        """Rank 0's ``obj`` on every rank (the others wait for rank 0 to get there)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        from streamnmt.syncstats import host_sync
        box = [obj]
        # Needed: the other ranks wait for rank 0's value (run directory, evaluation results).
        host_sync(site, lambda: dist.broadcast_object_list(box, src=0, group=self.control))
        return box[0]

    def gather(self, obj: Any, site: str = "dist.gather", long_wait: bool = False) -> list[Any]:
        """Every rank's ``obj``, on every rank, in rank order (within --dist-timeout, unless ``long_wait``)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        from streamnmt.syncstats import host_sync
        out: list[Any] = [None] * self.world
        # Needed: rank 0's checkpoint holds every rank's RNG state (exact resume).
        group = self.control if long_wait or self.lockstep is None else self.lockstep
        host_sync(site, lambda: dist.all_gather_object(out, obj, group=group))
        return out

    def barrier(self, site: str = "dist.barrier") -> None:
        """Every rank waits here until all have arrived (host-side, gloo)."""
        if self.active:
            import torch.distributed as dist

            from streamnmt.syncstats import host_sync
            # Needed: the ranks that read what rank 0 writes wait until it is written.
            host_sync(site, lambda: dist.barrier(group=self.control))

    def agree_on_capture(self, error: str | None) -> None:
        """Graph capture succeeded or failed for all ranks together: each rank passes its own
        capture error (None: captured, or graph mode unavailable alike everywhere). If any rank
        failed, every rank raises the same :class:`CaptureFailed` line naming the first such rank,
        so no rank trains eagerly while the others replay. One process: nothing to agree on."""
        if not self.active:
            return
        errors = self.gather(error, "dist.capture")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, why = failed[0]
            raise CaptureFailed(f"graph capture failed on rank {rank} of {self.world} ({why}); every rank stops "
                                f"(run with --sync-strategy full to train without graphs)")

    def kill_launcher(self) -> None:
        """Test hook: SIGKILL the launcher (torchrun) and this process, as ``kill -9`` would."""
        if self.main:
            with contextlib.suppress(ProcessLookupError):
                os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) outside torchrun (an empty or
    non-numeric value left in a plain command's environment counts as not set)."""
    def number(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name) or default)
        except ValueError:
            return default

    return number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0)


def init(backend: str, device: str | None, timeout_s: int) -> Dist:
    """Join the process group torchrun describes; a no-op for one process.

    Args:
        backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl`` or ``gloo`` (``--dist-backend``).
        device: the ``--device`` flag (None: CUDA if present); each rank takes ``cuda:LOCAL_RANK``.
        timeout_s: ``--dist-timeout``: how long a collective waits for a missing rank.
    """
    import torch

    rank, world, local = world_from_env()
    if "WORLD_SIZE" not in os.environ:
        return Dist()
    cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigError("--dist-backend (config key 'dist_backend'): nccl needs CUDA devices but the run is on "
                          "the CPU (--device cpu or no GPU); use --dist-backend gloo or auto")
    dev = torch.device("cpu")
    if cuda:
        n = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local_world > n:
            raise ConfigError(f"--nproc: {local_world} processes on this host but only {n} CUDA device(s); "
                              f"use --nproc {n} or fewer (one GPU per process)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    die_with_parent()  # torchrun
    import torch.distributed as dist
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    lockstep = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    import socket

    from streamnmt.syncstats import host_sync
    peers: list[Any] = [None] * world
    # Needed: every rank's node, host and pid, to name the host a failed collective lost (once, host-side).
    host_sync("dist.init", lambda: dist.all_gather_object(peers, (_node(), socket.gethostname(), os.getpid()),
                                                         group=lockstep))
    _PEERS[:] = peers
    return Dist(rank=rank, world=world, local_rank=local, backend=backend, device=dev, control=control,
                lockstep=lockstep, timeout_s=float(timeout_s))


def parallelize(model: torch.nn.Module, device: torch.device, bucket_cap_mb: float = 25.0) -> torch.nn.Module:
    """``model`` in DistributedDataParallel over the default process group (any world size). The
    trainer and the benchmark ask for it with ``make_step(ddp=dist.active)``; the step calls this
    lazily, at its first forward or :meth:`streamnmt.training.step.NMTStep.parallel`.

    Call it under the stream the forwards will run on (the strategy's compute or capture stream):
    DDP ties its gradient hooks to the stream it was built under, and a mismatch makes autograd
    add cross-stream waits (and a warning) on every backward. Gradients are views into DDP's
    buckets (``gradient_as_bucket_view``: no copy between them, a faster captured step: docs/PERFORMANCE.md,
    "Several GPUs (DDP)"); buffers are not broadcast each forward (the model's are constants), so a
    forward launches no collective. ``bucket_cap_mb``: ``--bucket-cap-mb`` (DDP's own default 25).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP
    # torch >= 2.13 renames the switch; older versions know only broadcast_buffers.
    no_sync_bufs = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                    else {"broadcast_buffers": False})
    ids = {"device_ids": [device.index]} if device.type == "cuda" else {}
    return DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb, **ids, **no_sync_bufs)


def wait_event(event: Any, timeout_s: float, what: str = "the GPU") -> None:
    """Block the host until ``event`` has completed, polling ``event.query()``; raise
    :class:`PeerLost` after ``timeout_s``. For waits on replayed CUDA graphs: their captured
    collectives are not watched by NCCL's watchdog, so a dead peer would otherwise leave the host
    in ``event.synchronize()`` forever. Callers count the wait with ``host_sync``."""
    if event.query():
        return
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            rank, world, _ = world_from_env()
            raise PeerLost(f"rank {rank} of {world}: {what} did not finish its queued work within --dist-timeout "
                           f"{timeout_s:g} s; another rank died or stopped responding ({lost_peers(rank)}; the "
                           f"checkpoints written so far are whole)")
        time.sleep(POLL_S)


SHUTDOWN_TIMEOUT_S = 300  # the ranks' grace after a signal before torchrun kills them (`train --nproc`)


def run_torchrun(n: int, argv: list[str]) -> int:
    """Run torchrun (``torch.distributed.run``'s own entry point, ``--standalone``) in this process:
    N processes of ``argv`` (e.g. ``["-m", "streamnmt", "train", ...]``) on this host. A stop by
    SIGTERM/SIGINT, which torchrun forwards to the ranks, returns 0; a failed rank prints one line
    naming it and returns 2 when it exited 2 (a bad flag), else 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun SIGKILLs the ranks 30 s after passing a SIGTERM on (its default): a stop agreed at the
    # next --sync-interval boundary and rank 0's save can take longer on a large model, and were then
    # lost. Read by recent launchers (torch 2.13's; older ones keep 30 s); a value in the environment wins.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    try:  # as `torchrun --standalone --nproc-per-node N ARGV`
        torchrun(["--standalone", f"--nproc-per-node={n}", *argv])
    except SignalException as e:  # torchrun passed the signal on; the ranks finished their step and saved
        print(f"streamnmt: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 0
    except ChildFailedError as e:
        rank, first = first_failure(e.failures)
        how = (f"killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 and
               -first.exitcode in signal.valid_signals() else f"exit code {first.exitcode}")
        print(f"streamnmt: error: rank {rank} failed ({how}); see its error above", file=sys.stderr)
        return 2 if first.exitcode == 2 else 1
    return 0


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank to blame among torchrun's ``{rank: ProcessFailure}``: the earliest failure that was
    not a bystander's, else the earliest of all. Bystanders: a :class:`PeerLost` rank (a peer
    notices a killed rank before torchrun does), and a rank ended by SIGTERM where another rank
    failed otherwise (torchrun stops the survivors of a failed rank with SIGTERM). The failure
    timestamps have one-second resolution, so the kind of failure decides before the time."""
    def bystander(f: Any) -> int:
        return 2 if f.exitcode == PeerLost.exit_code else 1 if f.exitcode == -signal.SIGTERM else 0

    rank = min(failures, key=lambda r: (bystander(failures[r]), failures[r].timestamp, r))
    return rank, failures[rank]


def die_with_parent() -> None:
    """This process ends when the one that started it dies, even by SIGKILL (no orphan rank keeps
    training after torchrun, no orphan compile child after its run): Linux's PR_SET_PDEATHSIG."""
    if sys.platform.startswith("linux"):
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def peer_lost(d: Dist, e: BaseException) -> PeerLost:
    """The one-line error for a failed collective on rank ``d.rank``."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return PeerLost(f"rank {d.rank} of {d.world}: a collective failed, another rank died or stopped "
                    f"responding ({lost_peers(d.rank)}); the checkpoints written so far are whole ({first})")


# Every rank's (node, host name, pid), gathered once at init: which host a failed collective lost.
_PEERS: list[tuple[str, str, int]] = []


def several_hosts(world: int) -> bool:
    """The ranks run on more than one host: their nodes as gathered at init (torchrun's launcher index,
    else the host name), else (no group made by :func:`init`) torchrun's LOCAL_WORLD_SIZE, one host
    where it is not set."""
    if _PEERS:
        return len({node for node, _, _ in _PEERS}) > 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world


def _node() -> str:
    """This rank's node: torchrun's GROUP_RANK (its launcher's index), else the host name."""
    import socket
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def lost_peers(rank: int) -> str:
    """Who is gone, as this rank can tell: a rank of its own node whose process has ended, else the
    other node where there is one (its launcher cannot say: it died with it), else the launcher's word."""
    if not _PEERS or rank >= len(_PEERS):
        return "the launcher names it"
    import psutil
    mine = _PEERS[rank][0]
    def ended(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    here = [r for r, (node, _, pid) in enumerate(_PEERS) if node == mine and r != rank and ended(pid)]
    if here:
        return f"rank {', '.join(map(str, here))} of this host ended"
    others: dict[str, list[int]] = {}
    for r, (node, _, _) in enumerate(_PEERS):
        if node != mine:
            others.setdefault(node, []).append(r)
    if len(others) == 1:
        (node, ranks), = others.items()
        return f"lost host: node {node} ({_PEERS[ranks[0]][1]}, rank {', '.join(map(str, ranks))})"
    if others:
        return f"a rank of another host: nodes {', '.join(sorted(others))}; their launchers name it"
    return "the launcher names it"


def is_collective_error(e: BaseException) -> bool:
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    text = str(e).lower()
    return isinstance(e, kinds) or any(s in text for s in ("connection closed by peer", "connection reset",
                                                           "gloo", "nccl", "processgroup", "timed out",
                                                           "timeout", "pair closure"))


class NullLog:
    """Stands in for a CSV log on ranks other than 0 (rank 0 alone writes the run directory)."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def quiet(_: str) -> None:
    """The log of ranks other than 0: they print nothing but errors."""
