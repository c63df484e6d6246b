"""The Triton segment kernels built in child processes while the run starts.

On a machine's first run Triton compiles the kernels of the set-up's build check
(:func:`streamnmt.models.attention.triton_probe`: forward and backward of the three variants at the
run's head dim) in seconds, and its compiler holds the interpreter lock, so a thread would not
overlap it with anything. :func:`start_for`, called at the command's start, runs that build in
child processes (fresh interpreters, not forks of this one) where the run will check the kernels:
they fill Triton's on-disk cache while this process imports, makes its CUDA context, reads the
config, prepares the data and builds the model. Triton compiles one kernel at a time in a process,
so the build is cut into jobs (:func:`jobs_for`): each variant (:data:`VARIANTS`) times each of its
kernels (the forward, the backward's dk/dv with the variant-free delta once, its dq), and the same
again in the training's dtype where ``--amp`` names another. Each job launches its kernel alone on the
build check's input (:func:`streamnmt.models.attention.probe_kernels`), laid out as the check lays
it out, so it fills the very cache entry the check then loads. The jobs go to as many children as
the usable cores (:func:`streamnmt.setupclock.usable_cores`) allow once :data:`streamnmt.setupclock.LEFT_CORES`
are left to this process and the tokenizers' child that may run beside them: one job a child where
they allow, else fewer children taking several jobs each (:func:`group`), never fewer than
:data:`MIN_CHILDREN` (a small machine then shares its cores among them, as it did with one child a
variant).

On one process (no torchrun), the build check (:func:`streamnmt.models.attention.triton_runs`) trusts
a child still running and owes the wait (:func:`pending`); the trainer settles it
(:func:`streamnmt.models.attention.settle_triton`) just before the step first launches the kernels,
so the data and model phases run beside the compile. Under torchrun the check waits at once, as
the other ranks load the kernels from the cache rank 0's host filled. Waiting (:func:`wait`) loads
the kernels from that cache; a child that failed or did not finish in :data:`TIMEOUT_S` leaves the
build to this process, said in one line.

Started only where the build check will run: CUDA present, Triton installed, not ROCm, the job's
attention ``auto`` or ``triton`` at a head dim the kernels take, and on one process per host (the
other ranks of a torchrun check after rank 0 did, from the cache). The child itself returns at once
on a GPU ``auto`` does not pick the kernels for (compute capability under 8.0).

Children that built the kernels leave a marker file in Triton's cache folder (:func:`marker`), named
by what the cached kernels depend on: Triton's and torch's versions, the GPU, the kernels' source,
the head dim and the dtypes. A later run that finds its marker starts no child (whose interpreter,
imports and CUDA context cost a warm run's set-up seconds for nothing): its build check loads the
kernels from the cache itself. Where the cache was emptied the marker went with it; a marker whose
kernels are gone anyway only costs the build check its compile, in this process.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from streamnmt import setupclock

# ``auto`` picks the kernels only up to this head dim (see streamnmt.models.attention.auto_attention)
AUTO_TRITON_MAX_HEAD_DIM = 128
TIMEOUT_S = 180.0  # a cold build of the kernels takes seconds; this covers a loaded machine's too
# the build check's variants (streamnmt.models.attention.triton_probe): encoder, causal decoder, cross
VARIANTS = (0, 1, 2)
# a variant's jobs (streamnmt.models.segattn_triton.KERNELS): the delta kernel has no variant, so the
# first variant's dk/dv job builds it
KERNEL_JOBS = ("fwd", "dkdv", "dq")
MIN_CHILDREN = 3  # as many as variants: a small machine compiles no slower than with one child a variant


@dataclass(frozen=True)
class Request:
    """What the build check will build: on GPU ``index``, at ``head_dim``, for a run of ``--amp amp``."""

    index: int
    head_dim: int
    amp: str


def plan(job: Any, *, cuda: bool, triton: bool, hip: bool) -> Request | None:
    """The build the run's build check will ask for (``job``: a :class:`streamnmt.config.TrainJob`
    as given, before its auto settings are resolved), or None where it will not run the kernels."""
    m, device = job.model, job.run.device
    if not cuda or not triton or hip or (device is not None and not device.startswith("cuda")):
        return None
    if m.attention not in ("auto", "triton") or (m.attention == "auto" and m.attention_dropout):
        return None
    resolved = m.resolve("base" if m.model == "auto" else m.model)  # auto is base on a GPU
    head_dim = resolved.d_model // resolved.n_heads
    if head_dim < 16 or head_dim & (head_dim - 1) or (m.attention == "auto" and head_dim > AUTO_TRITON_MAX_HEAD_DIM):
        return None
    index = int(device[5:]) if device and device.startswith("cuda:") else int(os.environ.get("LOCAL_RANK", "0"))
    return Request(index, head_dim, job.optim.amp)


def triton_cache_dir() -> Path:
    """Triton's on-disk cache, by Triton's own rule: ``TRITON_CACHE_DIR``, else ``TRITON_HOME`` (or the
    home folder) / .triton / cache. Read without importing Triton."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def marker(request: Request, gpu: str, cache: Path | None = None) -> Path:
    """The file children that built ``request``'s kernels on ``gpu`` (its name and compute capability)
    leave in Triton's cache folder ``cache`` (default: the one in effect now); its name holds a hash of
    everything the cached kernels depend on."""
    import torch

    kernels = Path(__file__).with_name("segattn_triton.py")
    parts = [_version("triton"), _version("pytorch-triton"), torch.__version__, gpu, str(request.head_dim),
             request.amp, hashlib.sha1(kernels.read_bytes()).hexdigest()]
    return (cache or triton_cache_dir()) / f"streamnmt-segattn-{hashlib.sha1('|'.join(parts).encode()).hexdigest()[:20]}.built"


def gpu_of(index: int) -> str:
    """``request.index``'s GPU as :func:`marker` names it (initialises CUDA, as the run does anyway)."""
    import torch

    return f"{torch.cuda.get_device_name(index)} sm{''.join(map(str, torch.cuda.get_device_capability(index)))}"


def mark_built(request: Request, gpu: str, cache: Path | None = None) -> None:
    """Leave the marker (after the children's build); a cache folder it cannot write leaves none."""
    path = marker(request, gpu, cache)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{gpu} head_dim {request.head_dim} amp {request.amp}\n")
        os.replace(tmp, path)
    except OSError:
        pass


def built_before(request: Request) -> bool:
    """A child built ``request``'s kernels into this cache before (its marker is there)."""
    try:
        return marker(request, gpu_of(request.index)).exists()
    except Exception:  # no GPU to name after all, an unreadable source: start the child as before
        return False


def _shared_gpu(index: int) -> bool:
    """GPU ``index`` takes several processes' contexts (compute mode Default, or not known: NVML
    missing); under Exclusive Process a child's context would keep the run's own off the GPU."""
    try:
        import pynvml
    except ImportError:
        return True
    try:
        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [v.strip() for v in visible.split(",")] if visible else None
            if ids is not None and not all(i.isdigit() for i in ids):
                return True  # UUIDs or MIG names: not mapped here; the mode is then not known
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(ids[index]) if ids else index)
            return pynvml.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_DEFAULT
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML driver, an index out of range: not known
        return True


def jobs_for(request: Request) -> list[str]:
    """The build's jobs (:func:`streamnmt.models.attention.parse_jobs`), kernel by kernel and within a
    kernel variant by variant, so that :func:`group`'s round robin gives each child a mix: every kernel
    of the build check once, then those of the training's dtype where ``--amp`` names one other than
    the check's (bf16 wherever the children build: compute capability 8.0 or newer)."""
    suffixes = [""] + ([f":{request.amp}"] if request.amp in ("fp16", "off") else [])
    return [f"{v}:{'delta+dkdv' if kernel == 'dkdv' and v == VARIANTS[0] else kernel}{suffix}"
            for suffix in suffixes for kernel in KERNEL_JOBS for v in VARIANTS]


def group(jobs: Sequence[str], cores: int) -> list[list[str]]:
    """``jobs`` dealt round robin to the children ``cores`` allow: all but ``LEFT_CORES`` of them
    (this process's imports and data and the tokenizers' child run beside the build), at most one
    child a job, at least :data:`MIN_CHILDREN`."""
    n = max(MIN_CHILDREN, min(len(jobs), cores - setupclock.LEFT_CORES))
    return [list(jobs[i::n]) for i in range(n) if jobs[i::n]]


def child_argv(request: Request, jobs: Sequence[str]) -> list[str]:
    """A child's command line: :func:`streamnmt.models.attention.build_in_child` of ``jobs`` in a
    fresh interpreter."""
    code = "import sys; from streamnmt.models.attention import build_in_child; sys.exit(build_in_child(sys.argv[1:]))"
    return [sys.executable, "-c", code, str(request.index), str(request.head_dim), request.amp, ",".join(jobs)]


class Child:
    """A started child: the process and the file its output goes to (a pipe could fill and stall it)."""

    def __init__(self, argv: Sequence[str]):
        import site

        import streamnmt

        env = dict(os.environ)
        src = str(Path(streamnmt.__file__).resolve().parent.parent)  # the child imports this very package
        installed = {str(Path(p).resolve()) for p in [*site.getsitepackages(), site.getusersitepackages()]}
        if src not in installed:  # a source tree: first on the path (site-packages stays after the stdlib)
            env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        self.output: IO[bytes] = tempfile.TemporaryFile()
        self.process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=self.output,
                                        stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Kill the child if it still runs (Triton writes its cache files whole: nothing is left half written)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.output.close()

    def last_line(self) -> str:
        if self.output.closed:
            return ""
        self.output.seek(0)
        lines = self.output.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else ""


@dataclass
class _Pending:
    request: Request
    children: list[Any]  # Child, or what a test puts in its place: one per group of jobs
    cache: Path  # the Triton cache folder they fill (the run may point TRITON_CACHE_DIR elsewhere later)


_PENDING: _Pending | None = None


def start(request: Request, launch: Callable[[Sequence[str]], Any] = Child, cores: int | None = None) -> None:
    """Start the children for ``request``, its jobs grouped by the cores (:func:`group`; ``cores``:
    default :func:`streamnmt.setupclock.usable_cores`; ``launch``: how a command line is started, a test's fake)."""
    global _PENDING
    stop()
    groups = group(jobs_for(request), setupclock.usable_cores() if cores is None else cores)
    _PENDING = _Pending(request, [launch(child_argv(request, jobs)) for jobs in groups], triton_cache_dir())


def pending(index: int, head_dim: int) -> Path | None:
    """The Triton cache folder children fill with the kernels for GPU ``index`` at ``head_dim``, where
    they were started and nobody waited for them yet; else None."""
    if _PENDING is not None and (_PENDING.request.index, _PENDING.request.head_dim) == (index, head_dim):
        return _PENDING.cache
    return None


@contextlib.contextmanager
def triton_cache(path: Path | None) -> Iterator[None]:
    """Triton's cache folder set to ``path`` inside (None: as it is): the build check loads the
    kernels from the folder the children filled, though a compiling run has since pointed
    ``TRITON_CACHE_DIR`` at its compile cache (:mod:`streamnmt.training.compile_cache`). Triton reads
    the variable at each compile; the loaded kernels stay in this process's memory after."""
    before = os.environ.get("TRITON_CACHE_DIR")
    if path is None or (before is not None and Path(before) == path):
        yield
        return
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = before


def start_for(job: Any, launch: Callable[[Sequence[str]], Any] = Child) -> Request | None:
    """At the command's start: start the child where the run's build check will build the kernels
    (:func:`plan`), on the first process of a host only, unless one built them into Triton's cache
    before (:func:`built_before`); the request, or None where none started."""
    import importlib.util

    import torch

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    request = plan(job, cuda=torch.cuda.is_available(), triton=importlib.util.find_spec("triton") is not None,
                   hip=torch.version.hip is not None)
    if request is None or built_before(request) or not _shared_gpu(request.index):
        return None
    start(request, launch)
    return request


def wait(index: int, head_dim: int, timeout: float = TIMEOUT_S,
         mark: Callable[[Request], None] | None = None) -> str | None:
    """Wait for the children building the kernels for GPU ``index`` at ``head_dim``, if they were
    started: None where they built them (or none was started for them), else one line saying why this
    process builds them itself. Where all built, the marker is left (``mark``: how, a test's fake;
    default :func:`mark_built` for this GPU). Once: the children are forgotten after."""
    global _PENDING
    if not pending(index, head_dim):
        return None
    assert _PENDING is not None
    request, children, cache = _PENDING.request, _PENDING.children, _PENDING.cache
    _PENDING = None
    t0 = time.monotonic()
    try:
        for child in children:
            try:
                code = child.wait(max(0.0, timeout - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                return f"the Triton kernels' build in a child process did not finish in {timeout:.0f} s; building them here"
            if code != 0:
                last = child.last_line()
                return (f"the Triton kernels' build in a child process failed (exit {code}{': ' + last if last else ''}, "
                        f"after {time.monotonic() - t0:.1f} s of waiting); building them here")
    finally:
        for child in children:  # on a failure or a timeout the others are not left compiling beside the run
            child.stop()
    if mark is not None:
        mark(request)
    else:
        _mark_this_gpu(request, cache)  # a later run starts none (marker)
    return None


def _mark_this_gpu(request: Request, cache: Path) -> None:
    try:
        mark_built(request, gpu_of(request.index), cache)
    except Exception:  # no GPU to name it by: no marker, and the next run starts the children again
        pass


def stop() -> None:
    """Stop a child nobody waited for (at exit, or when another is started)."""
    global _PENDING
    left, _PENDING = _PENDING, None
    for child in left.children if left is not None else ():
        child.stop()


atexit.register(stop)
