"""A compile that starts warm: torch.compile's artefacts kept across runs, keyed by what makes them valid.

torch.compile caches its work on disk already: Inductor's FX graph cache and the AOTAutograd cache
(the compiled forward and backward graphs) and Triton's kernel cache, under content keys that cover
the graph, its shapes, the torch and Triton versions, the GPU and Inductor's settings. But they live
in /tmp/torchinductor_$USER (Triton's beside it, or in ~/.triton), which a fresh container or a
cleaned /tmp loses, and a run cannot tell before compiling whether they will hit. So, three parts:

1. Persistent directories, the main mechanism (chosen because it works on every torch the package
   supports, 2.6 to 2.14, covers every compile of the run, validation's shapes and recompiles
   included, and torch writes its entries itself, atomically, and checks them by its own keys: a
   stale entry misses, it is never used wrongly). Unless the user set them,
   ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point under ``$STREAMNMT_HOME/compile/``.
2. The mega-cache (``torch.compiler.save_cache_artifacts``, torch >= 2.7; feature-detected): the
   run's artefacts in one file per key, saved once after the first compiled steps and loaded
   (``load_cache_artifacts``) where the directories above do not hold them: a
   ``TORCHINDUCTOR_CACHE_DIR`` the user pointed somewhere fresh, a pruned cache, a key directory
   copied from another machine.
3. A manifest per key (``key.json``, written last): the artefacts of this model, these batch shapes
   and this environment exist. Dynamo traces at every start and only then do torch's keys exist,
   so the manifest is what tells ``--compile auto`` beforehand that the compile will be warm (it
   then costs ``engine.auto.COMPILE_S_PER_SHAPE_WARM`` instead of the cold figure).

Flow: ``recipe.resolve_compile`` builds the key (:func:`job_key`), says warm or cold, and when the
run compiles stages the cache (:func:`stage`: directories set, mega-cache loaded); ``make_step``
takes it (:func:`for_step`; a resumed run or the bench get the directories alone, without a key);
after the engine's prepare, where graph mode's warm-up has compiled every training shape,
``NMTStep.compile_ready`` saves the artefacts once (eager strategies: after their first step) and
says in one line how long the start took and whether the cache was warm. Nothing here fails a run:
a directory that cannot be written gives one warning line, and the run compiles as it would without.
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from streamnmt.fsutil import atomic_write, streamnmt_home

KEY_VERSION = 2  # bump when the key's layout or what the files hold changes (2: the package's code, buckets)
INDUCTOR_ENV, TRITON_ENV = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"
MANIFEST, ARTIFACTS = "key.json", "artifacts.bin"
Log = Callable[[str], None]

_ours: set[str] = set()  # directories this module pointed the variables at (not the user's)
_staged: CompileCache | None = None  # staged by resolve_compile for the next make_step(compile=True)


def environment(device: torch.device) -> dict[str, Any]:
    """The software and device that compiled code is valid for."""
    env: dict[str, Any] = {"torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda,
                           "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "device": device.type}
    if device.type == "cuda":
        try:
            env["gpu"] = torch.cuda.get_device_name(device)
            env["capability"] = list(torch.cuda.get_device_capability(device))
        except (RuntimeError, AssertionError):  # no usable driver: no key can promise a warm start
            env["gpu"] = None
    else:
        env["machine"] = platform.machine()
    return env


def _triton_version() -> str | None:
    from importlib import metadata

    for dist in ("triton", "pytorch-triton"):  # the name differs between torch's CUDA wheels and nightlies
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def compile_key(*, model: dict[str, Any], batch_shapes: Iterable[Iterable[int]], packed: bool, amp: str,
                attention: str, world: int, deterministic: bool, inductor: dict[str, Any],
                env: dict[str, Any], bucket_cap_mb: float = 25.0, code: str | None = None) -> dict[str, Any]:
    """What the compiled training step depends on: the model's sizes and dropout sites (``model``),
    the static batch shapes (B, S, T) and whether they are packed (segment tensors), the autocast
    dtype, the attention kernel, DDP's world size and ``--bucket-cap-mb`` (DDP splits the graph at
    its buckets), deterministic algorithms, the Inductor options the step sets, the environment,
    and the package's own code (``code``, default :func:`package_digest`: the traced step is ours)."""
    shapes = sorted(list(map(int, s)) for s in batch_shapes)
    return {"version": KEY_VERSION, "model": dict(model), "batch_shapes": shapes, "packed": bool(packed),
            "amp": amp, "attention": attention, "world": int(world), "bucket_cap_mb": float(bucket_cap_mb),
            "deterministic": bool(deterministic), "inductor": dict(inductor), "env": dict(env),
            "code": package_digest() if code is None else code}


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """sha256 of streamnmt's source files (their paths and bytes): a change to the model, the step
    or anything they call traces another graph, which an unchanged key would call warm."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def _cache_misses() -> int:
    """Compiles of this process that torch's caches did not hold (Inductor's FX graph cache and
    the AOTAutograd cache); 0 where this torch keeps no such counters."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"].get("fxgraph_cache_miss", 0)) + \
        int(counters["aot_autograd"].get("autograd_cache_miss", 0))


def model_facts(shape: Any, max_len: int) -> dict[str, Any]:
    """The model part of the key from a ``ModelShape`` (or anything with its fields)."""
    def p(value: float | None) -> float:  # None: the residual dropout's probability (older checkpoints)
        return shape.dropout if value is None else value

    return {"src_vocab": shape.src_vocab, "tgt_vocab": shape.tgt_vocab, "d_model": shape.d_model,
            "n_layers": shape.n_layers, "n_heads": shape.n_heads, "d_ff": shape.d_ff,
            "tie_embeddings": shape.tie_embeddings, "dropout": shape.dropout,
            "attention_dropout": p(shape.attention_dropout), "activation_dropout": p(shape.activation_dropout),
            "max_len": max_len}


def job_key(job: Any, batch_shapes: Iterable[Iterable[int]], device: torch.device, world: int,
            inductor: dict[str, Any]) -> dict[str, Any] | None:
    """The key of a resolved ``TrainJob``'s step (None where the tokenizers, whose vocabulary sizes
    the embeddings take, cannot be read: the run is then taken as cold)."""
    vocab = tokenizer_vocab(job.data)
    if vocab is None:
        return None
    m = job.model
    model = {"src_vocab": vocab[0], "tgt_vocab": vocab[1], "d_model": m.d_model, "n_layers": m.n_layers,
             "n_heads": m.n_heads, "d_ff": m.d_ff, "tie_embeddings": m.tie_embeddings, "dropout": m.dropout,
             "attention_dropout": m.attention_dropout, "activation_dropout": m.activation_dropout,
             "max_len": job.data.max_len}
    return compile_key(model=model, batch_shapes=batch_shapes, packed=job.data.packs, amp=job.optim.amp,
                       attention=m.attention, world=world, deterministic=job.run.deterministic,
                       inductor=inductor, env=environment(device), bucket_cap_mb=job.engine.bucket_cap_mb)


def tokenizer_vocab(cfg: Any) -> tuple[int, int] | None:
    """The vocabulary sizes of the tokenizers ``prepare_data`` used (found where it finds them; they
    exist once it has run). make_step checks them against the model it is given (:func:`for_step`)."""
    from streamnmt.data.prepare import builtin_dir
    from streamnmt.data.tokenizer import Tokenizer
    from streamnmt.data.tokenizer_training import sides

    directory = builtin_dir(cfg) if cfg.data is None else Path(cfg.data).expanduser()
    paths = [side.path for side in sides(cfg, directory)]
    paths = paths * 2 if len(paths) == 1 else paths  # a shared model serves both sides
    try:
        src, tgt = (Tokenizer(Path(p)).vocab_size for p in paths)
    except Exception:  # noqa: BLE001 - a missing or unreadable file: no key, never a failed run
        return None
    return src, tgt


def key_digest(facts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def mega_cache() -> bool:
    """torch.compiler's save/load of all compile artefacts in one blob exists (torch >= 2.7)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def _torch_default_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        return os.path.abspath(default_cache_dir())
    except ImportError:  # torch without the helper: its rule, restated
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + user))


def user_set(var: str) -> bool:
    """The user chose this directory (torch itself sets ``TORCHINDUCTOR_CACHE_DIR`` to its default
    when it first reads it, and ``TRITON_CACHE_DIR`` under it: neither counts, nor do ours)."""
    value = os.environ.get(var)
    if not value:
        return False
    value = os.path.abspath(value)
    return not any(value == d or value.startswith(d + os.sep) for d in (*_ours, _torch_default_dir()))


class CompileCache:
    """One run's compile cache: its key (``facts``; None = the directories alone), whether the key's
    artefacts were there at the start (``warm``), and the one save."""

    def __init__(self, facts: dict[str, Any] | None, root: Path | None = None, t0: float | None = None,
                 since: str = "the data"):
        self.facts = facts
        self.root = Path(os.path.abspath(root if root is not None else streamnmt_home() / "compile"))
        # resolve_compile makes it once the data is loaded: the ready line counts from here
        self.t0, self.since = (time.perf_counter() if t0 is None else t0), since
        self.digest = key_digest(facts) if facts is not None else None
        self.dir = self.root / "keys" / self.digest[:16] if self.digest else None
        self.disabled = False  # the directories cannot be written: torch's defaults are used
        self.loaded = self.saved = False
        self.unsaid: str | None = None  # a warning that found no log yet (make_step has none)
        self._warned = False
        self.warm = self._manifest_matches() and (self._artifacts_file() is not None or not self._needs_load())

    # -- where things are ---------------------------------------------------------------------
    def dirs(self) -> dict[str, str]:
        """The inductor and Triton cache directories this run uses (the user's where set)."""
        return {var: os.environ[var] if user_set(var) else str(self.root / sub)
                for var, sub in ((INDUCTOR_ENV, "inductor"), (TRITON_ENV, "triton"))}

    def _manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / MANIFEST).read_text(encoding="utf-8")) if self.dir else None
        except (OSError, ValueError):
            return None

    def _manifest_matches(self) -> bool:
        manifest = self._manifest()
        return manifest is not None and manifest.get("key") == json.loads(json.dumps(self.facts, default=str))

    def _artifacts_file(self) -> Path | None:
        path = self.dir / ARTIFACTS if self.dir else None
        return path if path is not None and mega_cache() and path.is_file() else None

    def _needs_load(self) -> bool:
        """The directories in use do not hold this key's artefacts (other ones wrote them, or gone)."""
        manifest = self._manifest() or {}
        return any(manifest.get("dirs", {}).get(var) != path or not Path(path).is_dir()
                   for var, path in self.dirs().items())

    # -- set-up, save, report -----------------------------------------------------------------
    def stage(self, log: Log | None) -> CompileCache:
        """Point the cache directories here (unless the user set them), and load the mega-cache
        where they do not hold this key's artefacts. Before the first compile of the process."""
        for var, path in self.dirs().items():
            if user_set(var):
                continue
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):  # writable (mkdir of an existing one says nothing)
                    pass
            except OSError as e:
                self.disabled = True
                self._warn(log, f"{path}: {e.strerror or e}")
                return self
            os.environ[var] = path
            _ours.add(os.path.abspath(path))
        if self.warm and self._needs_load() and (blob := self._artifacts_file()) is not None:
            try:
                torch.compiler.load_cache_artifacts(blob.read_bytes())
                self.loaded = True
            except Exception as e:  # noqa: BLE001 - a torch that cannot read it compiles cold
                self.warm = False
                self._warn(log, f"{blob} not loaded ({type(e).__name__}: {str(e)[:120]})")
        return self

    def save(self, log: Log | None) -> None:
        """Once per run, after the first compiled steps: the mega-cache (torch >= 2.7), then the
        manifest, each written atomically. A warm run whose directories held everything writes
        nothing; one whose compile still missed torch's caches (the saved artefacts were stale)
        writes them afresh."""
        if self.saved or self.facts is None or self.disabled:
            return
        self.saved = True
        stale = self.warm and _cache_misses() > 0
        if (self.warm and not self.loaded and not stale) or _rank() != 0:  # rank 0 writes for all
            return
        assert self.dir is not None
        try:
            blob = None
            if mega_cache() and (not self.loaded or stale):  # a loaded blob that served is on disk already
                artefacts = torch.compiler.save_cache_artifacts()
                blob = artefacts[0] if artefacts else None
            if blob:
                atomic_write(self.dir / ARTIFACTS, blob)
            manifest = {"key": self.facts, "dirs": self.dirs(), "artifacts": bool(blob) or (self.loaded and not stale),
                        "saved": time.strftime("%Y-%m-%d %H:%M:%S")}
            atomic_write(self.dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
        except Exception as e:  # noqa: BLE001 - OSError, or a torch that cannot serialise: never fatal
            self._warn(log, f"{self.dir}: not saved ({e.strerror if isinstance(e, OSError) else e})")

    def state(self) -> str:
        if self.disabled:
            return "off (not writable)"
        if self.facts is None:
            return "unkeyed"
        return "warm" if self.warm else "cold"

    def ready_line(self, compiled: bool) -> str:
        where = self.dirs()[INDUCTOR_ENV] if not self.disabled else "torch's defaults"
        key = f", key {self.digest[:16]}" if self.digest else ""
        if not compiled:  # eager strategies compile at each batch shape's first step
            return f"engine: compile cache {self.state()} ({where}{key}); each batch shape compiles at its first step"
        return (f"engine: ready in {time.perf_counter() - self.t0:.1f} s after {self.since} "
                f"(compile cache {self.state()}: {where}{key})")

    def say_pending(self, log: Log) -> None:
        if self.unsaid is not None:
            log(self.unsaid)
            self.unsaid = None

    def _warn(self, log: Log | None, what: str) -> None:
        if self._warned:  # one line per run
            return
        self._warned = True
        line = f"warning: compile cache: {what}; the run goes on without it"
        if log is None:
            self.unsaid = line
        else:
            log(line)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def stage(cache: CompileCache | None, log: Log | None) -> None:
    """Stage ``cache`` (directories, mega-cache) for the next ``make_step(compile=True)``; None clears."""
    global _staged
    _staged = cache.stage(log) if cache is not None else None


def take_staged() -> CompileCache | None:
    """The cache resolve_compile staged for a step that does not compile here (``--compile
    background``: its child compiles under the key), cleared; None where none was staged."""
    global _staged
    cache, _staged = _staged, None
    return cache


def for_step(model: Any) -> CompileCache:
    """The compile cache of a step about to compile ``model``: the one resolve_compile staged, its
    vocabulary sizes checked against the model's (the key then follows the model); where none was
    staged (a resumed run, the bench) or it was staged for another model, the directories alone."""
    cache = take_staged()
    shape = getattr(model, "shape", None)
    if cache is not None and cache.facts is not None and shape is not None:
        want = model_facts(shape, cache.facts["model"].get("max_len"))
        have = cache.facts["model"]
        if any(have.get(k) != want[k] for k in ("d_model", "n_layers", "n_heads", "d_ff")):
            cache = None  # staged for another model
        elif want != have:  # the tokenizers' sizes were not the model's: key the artefacts by the model
            rekeyed = CompileCache({**cache.facts, "model": want}, cache.root, cache.t0)
            rekeyed.disabled, rekeyed._warned, rekeyed.unsaid = cache.disabled, cache._warned, cache.unsaid
            cache = rekeyed if rekeyed.disabled else rekeyed.stage(None)
    return cache if cache is not None else CompileCache(None, since="the model").stage(None)
