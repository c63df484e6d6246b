"""A corpus's tokenizers trained in a child process started at the command's start.

On a corpus seen for the first time, training the tokenizers (a pass over the training split, dev
and test read through, two SentencePiece models) is most of the set-up's data phase, and it needs
the config only: neither torch nor the device. :func:`start_for`, called by ``streamnmt train``
before torch is imported, starts a child (a fresh interpreter, not a fork, that imports no torch)
running :func:`streamnmt.data.tokenizer_training.train`, the very code ``prepare_data`` runs
in-process, while this process imports, makes its CUDA context and resolves the recipe.
``prepare_data`` then waits for it (:func:`take`), says its log lines and takes the sizes the corpus
rule asked, as if it had trained the models itself. A child that failed (a bad record, a crash) or
did not finish in :data:`TIMEOUT_S` is set aside: ``prepare_data`` trains in-process as without
one, and says a bad record's error itself, the same line.

The built-in corpus (no --data) is written by the child first where it is not yet
(:func:`streamnmt.data.synthetic.write_builtin`, as ``prepare_data`` writes it). Its size is the
recipe's (:func:`streamnmt.data.config.builtin_size_for`), which needs the device: the child is given
:func:`builtin_guess`'s, made without torch. The size is part of :func:`key`, so a wrong guess's
child (it wrote another size's folder) is set aside and ``prepare_data`` writes and trains the
run's in-process; ``prepare_data`` takes the child before it looks at the built-in corpus, so that
it never writes a folder the child is writing.

Started only where ``prepare_data`` would write the built-in corpus or train tokenizers, on one
process (under torchrun rank 0 prepares the data alone) and without --weights (its checkpoint's
tokenizers may serve). A child still running when this process ends is killed (atexit); the
corpus and the models are written to temporary files and renamed, so none is left half written.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamnmt import setupclock
from streamnmt.data.config import DataConfig, builtin_dir

# A hung child, not a slow one: a large training split takes minutes to read through, and waiting
# less would only have this process do the same work again after.
TIMEOUT_S = 3600.0
BAD_INPUT = 3  # the child's exit code for an InputError: prepare_data says it, running the same code
# Where the NVIDIA driver lists the machine's GPUs: a GPU run's built-in corpus is the larger one
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass
class Result:
    """What a child did: its log lines, the sizes the corpus rule asked (and why it asked or capped a side
    apart from its size, tokenizer_training.Trained.why), the models it wrote."""

    lines: list[str]
    auto: dict[str, int]
    trained: list[str]  # paths, as tokenizer_training.sides names them
    why: dict[str, str] = field(default_factory=dict)


def key(cfg: DataConfig) -> dict[str, Any]:
    """What of ``cfg`` the training reads: a child's models serve a run whose key is the child's.
    The built-in corpus: its size and folder too."""
    from streamnmt.data.tokenizer_training import FIELDS

    values = dataclasses.asdict(cfg)
    got = {name: values[name] for name in FIELDS}
    if cfg.data is None:
        got.update(builtin_pairs=cfg.builtin_pairs, directory=str(builtin_dir(cfg)))
    return got


def corpus_dir(cfg: DataConfig) -> Path:
    """The folder whose tokenizers are trained: ``cfg.data``, or the built-in corpus's."""
    return builtin_dir(cfg) if cfg.data is None else Path(cfg.data).expanduser()


def child_argv(cfg: DataConfig, threads: int, workdir: Path) -> list[str]:
    """The child's command line: :func:`child_main` in a fresh interpreter, the package ``streamnmt.data``
    held back (its ``__init__`` imports torch), the job's data settings and the corpus's folder as JSON."""
    code = ("import sys; from streamnmt import lazyinit; lazyinit.defer('streamnmt.data'); "
            "from streamnmt.data.tokenizer_child import child_main; sys.exit(child_main(sys.argv[1:]))")
    request = {"data": dataclasses.asdict(cfg), "threads": threads, "directory": str(corpus_dir(cfg))}
    return [sys.executable, "-c", code, str(workdir), json.dumps(request)]


def child_main(argv: Sequence[str]) -> int:
    """In the child: write the built-in corpus where it is asked and not yet written, train the models
    ``prepare_data`` would, write the log lines (``log.txt``) and then the result (``result.json``:
    the sizes asked, the pairs read, the models, the seconds) to the folder ``argv[0]``."""
    from streamnmt.data.readers import find_sources
    from streamnmt.data.tokenizer_training import models_lock, to_train, train
    from streamnmt.errors import InputError
    from streamnmt.fsutil import atomic_write

    t0 = time.perf_counter()
    workdir, request = Path(argv[0]), json.loads(argv[1])
    _leave_cores(setupclock.LEFT_CORES)  # to this process's imports and the Triton kernels' children
    cfg = DataConfig(**request["data"])
    directory = Path(request["directory"])
    if cfg.data is None:
        from streamnmt.data.synthetic import SEED, write_builtin  # by name: no torch (see child_argv)

        write_builtin(directory, cfg.builtin_pairs, seed=SEED)
    with open(workdir / "log.txt", "w", encoding="utf-8") as out:
        def log(line: str) -> None:  # one write a line: the two sides' threads log at once
            out.write(line + "\n")
            out.flush()

        try:
            with models_lock(directory):
                missing = to_train(cfg, directory)
                trained = train(cfg, directory, find_sources(directory, cfg.src_lang, cfg.tgt_lang), missing, log,
                                threads=request["threads"]) if missing else None
        except InputError:
            return BAD_INPUT
    result = {"auto": trained.auto if trained else {}, "why": trained.why if trained else {},
              "pairs": trained.pairs if trained else None,
              "trained": [str(side.path) for side in missing], "seconds": round(time.perf_counter() - t0, 3)}
    atomic_write(workdir / "result.json", json.dumps(result))
    return 0


def _leave_cores(n: int) -> None:
    """Run on all but ``n`` of this process's cores, and on half of them at least (on a small machine
    the parent soon does nothing but wait for this child). The cores left keep the parent's imports
    and the Triton kernels' build off SentencePiece's threads; the number of threads, which the
    models' bytes depend on, stays the one given: only where they run changes."""
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores[min(n, len(cores) // 2):])
    except (AttributeError, OSError):  # not Linux: the scheduler shares the cores
        pass


@dataclass
class _Pending:
    key: dict[str, Any]
    child: Any  # streamnmt.models.prebuild.Child, or a test's fake
    workdir: Path


_PENDING: _Pending | None = None


def _launch(argv: Sequence[str]) -> Any:
    from streamnmt.models.prebuild import Child  # how the Triton kernels' children start

    return Child(argv)


def start(cfg: DataConfig, threads: int, launch: Callable[[Sequence[str]], Any] = _launch) -> None:
    """Start the child for ``cfg`` (``launch``: how a command line is started, a test's fake)."""
    global _PENDING
    stop()
    workdir = Path(tempfile.mkdtemp(prefix="streamnmt-tokenizers-"))
    _PENDING = _Pending(key(cfg), launch(child_argv(cfg, threads, workdir)), workdir)


def start_for(job: Any, launch: Callable[[Sequence[str]], Any] = _launch) -> bool:
    """At the command's start (``job``: the :class:`streamnmt.config.TrainJob` as given): start the
    child where ``prepare_data`` would train tokenizers (of a --data corpus, or of the built-in corpus
    of :func:`builtin_guess`'s size) or write the built-in corpus, on one process and without
    --weights. Whether one started."""
    from streamnmt.data.tokenizer_training import run_models, spm_threads, to_train

    cfg = job.data
    if job.run.weights or os.environ.get("WORLD_SIZE", "1") != "1":
        return False
    if cfg.data is None:
        from streamnmt.data.synthetic import SEED, builtin_written

        cfg = dataclasses.replace(cfg, builtin_size=builtin_guess(job))
        directory = builtin_dir(cfg)
        missing = to_train(cfg, directory)
        if not missing and builtin_written(directory, cfg.builtin_pairs, seed=SEED):
            return False
    else:
        directory = Path(cfg.data).expanduser()
        missing = to_train(cfg, directory) if directory.is_dir() else []
        if not missing:
            return False
    start(cfg, spm_threads(run_models(cfg)), launch)
    return True


def builtin_guess(job: Any) -> int:
    """The built-in corpus's size the recipe will choose (``streamnmt.training.recipe.resolve_job``),
    guessed before torch knows the device: --builtin-size where given, else the model preset's, the
    "auto" preset being base where a CUDA device looks present (:func:`cuda_likely`)."""
    if job.data.builtin_size is not None:
        return job.data.builtin_size
    from streamnmt.data.config import builtin_size_for

    preset = job.model.model
    if preset == "auto":
        preset = "base" if cuda_likely(job.run.device) else "small"
    return builtin_size_for(preset)


def cuda_likely(device: str | None) -> bool:
    """Whether the run will be on a CUDA device, without torch: --device where given, else whether
    the NVIDIA driver lists a GPU and ``CUDA_VISIBLE_DEVICES`` does not hide them all. A wrong answer
    costs the child's work only (:func:`key` holds the size)."""
    if device is not None:
        return device.startswith("cuda")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return False
    try:
        with os.scandir(NVIDIA_GPUS) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def take(cfg: DataConfig, log: Callable[[str], None]) -> Result | None:
    """The child's models for ``cfg``, waited for (once: it is forgotten after); None where none was
    started for it or it failed (a line says why, except for bad input, which ``prepare_data`` says)."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is None:
        return None
    try:
        if pending.key != key(cfg):  # not this run's data settings: its models would not be the run's
            return None
        t0 = time.monotonic()
        with setupclock.timed("waiting for the tokenizers' training in a child process"):
            try:
                code = pending.child.wait(TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log(f"data: the tokenizers' training in a child process did not finish in {TIMEOUT_S:.0f} s; "
                    "training them here")
                return None
        if code != 0:
            if code != BAD_INPUT:
                last = pending.child.last_line()
                log(f"data: the tokenizers' training in a child process failed (exit {code}"
                    f"{': ' + last if last else ''}, after {time.monotonic() - t0:.1f} s of waiting); "
                    "training them here")
            return None
        try:
            result = json.loads((pending.workdir / "result.json").read_text(encoding="utf-8"))
            lines = (pending.workdir / "log.txt").read_text(encoding="utf-8").splitlines()
            return Result(lines, result["auto"], result["trained"], result["why"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log(f"data: the tokenizers' training in a child process left no result ({e}); training them here")
            return None
    finally:
        _stop(pending)


def _stop(pending: _Pending) -> None:
    pending.child.stop()
    shutil.rmtree(pending.workdir, ignore_errors=True)


def stop() -> None:
    """Stop a child nobody took (at exit, or when another is started)."""
    global _PENDING
    left, _PENDING = _PENDING, None
    if left is not None:
        _stop(left)


atexit.register(stop)
