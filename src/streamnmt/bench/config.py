"""The benchmark's settings: which rows to run, how long, on what model and data.

One dataclass, as for every other component: its fields are the ``streamnmt bench`` flags
(``batch_size`` -> ``--batch-size``), and ``__post_init__`` refuses values with a message naming
the flag. ``auto`` settings are filled from the device by :meth:`BenchConfig.resolve`, and the
resolved config is what ``bench.json`` records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from streamnmt.config import EMA_DECAY, EMA_EVERY, PRESETS, RunConfig, preset_dropout
from streamnmt.configbase import check, check_choice, opt
from streamnmt.data.config import DataConfig
from streamnmt.engine import STRATEGY_NAMES
from streamnmt.engine.config import DIST_BACKENDS, PIPELINE_STREAMS

# Reference rows: the limit of an eager loop (batches already on the GPU, no transfers, no host
# waits), the same for graph mode, and the loop most people write (blocking copy, loss.item()).
# The peer row: the strongest off-the-shelf alternative, torch.compile(mode="reduce-overhead").
REFERENCES = ("resident", "resident-graph", "plain", "compile-ro")
# The peers; stock-ro (the same compile of a model and loss written with stock PyTorch modules,
# nn.Transformer and F.cross_entropy; streamnmt.bench.stock) is not a reference row: it runs when
# named or with --strategies all.
PEERS = ("compile-ro", "stock-ro")
# Table and execution order: what users write, the peers, the engine's strategies, then the limits.
ORDER = ("plain", *PEERS, *STRATEGY_NAMES, "resident", "resident-graph")


@dataclass(kw_only=True)
class BenchConfig:
    device: str | None = opt(None, "cpu, cuda or cuda:N (default: cuda if present)")
    steps: int = opt(100, "timed steps per run")
    warmup: int = opt(20, "untimed steps before each timed run (same code path, same data each run)")
    repeats: int = opt(3, "runs of each row, interleaved (A B C A B C ...); the table shows the median")
    strategies: str = opt("all", "comma-separated rows: " + ",".join(STRATEGY_NAMES) + " and the references "
                          + ",".join(REFERENCES) + "; all = every one")
    references: bool = opt(True, "add the reference rows: resident and plain, resident-graph with graph "
                                 "on CUDA, and the compile-ro peer on CUDA with Triton")
    batch_size: int = opt(32, "sentences per batch (ignored with --max-tokens)")
    max_tokens: int = opt(0, "token budget per batch, checked as the trainer's --max-tokens; 0 = by sentences, "
                             "the default here (not the trainer's budget sized for the GPU) so that every "
                             "row times the same batches on any GPU")
    max_len: int = opt(32, "longest sentence in tokens")
    pack: bool = opt(True, "packed batches as training runs them (one shape; see the trainer's --pack); "
                           "--no-pack = length buckets")
    pack_width: int | None = opt(None, "target positions of a packed row, as the trainer's --pack-width "
                                       "(default --max-len)")
    attention: str = opt("auto", "attention of packed batches: sdpa (dense segment masks), flex "
                                 "(FlexAttention block masks), triton (Triton kernels that skip the other "
                                 "pairs' tiles); auto = as the trainer's (triton where it runs)",
                         choices=("auto", "sdpa", "flex", "triton"))
    vocab: int | None = opt(None, "source and target vocabulary: the corpus's pairs keep their lengths but "
                                  "get random token ids over this many pieces, as a real corpus's output layer "
                                  "costs; 0 = the corpus's own tokenizers; default 32000 on CUDA, 0 on CPU")
    label_smoothing: float = opt(0.1, "label smoothing of the loss (the training default)")
    dropout: float | None = opt(None, "dropout of the residual connections and embeddings (default: the "
                                      "training default of the preset, 0.3 for big and iwslt, else 0.1)")
    attention_dropout: float = opt(0.0, "dropout of the attention weights (the training default)")
    tie_embeddings: str = opt("none", "tie embeddings as the trainer's --tie-embeddings: decoder = the target "
                                      "embedding is the output projection; all = the source embedding too "
                                      "(needs one vocabulary: --vocab); the stock-ro peer stays untied",
                               choices=("none", "decoder", "all"))
    activation_dropout: float = opt(0.0, "dropout of the feed-forward's hidden activations (the training default)")
    ema: float = opt(EMA_DECAY, "the weights' moving average updated in the step, as the trainer's --ema (0 = "
                                "none)")
    ema_every: int = opt(EMA_EVERY, "update the moving average after the first step, then every N-th, as the trainer's "
                                    "--ema-every")
    pad_multiple: int = opt(8, "batch lengths are padded to a multiple of this; set it to --max-len for fixed "
                               "(batch-size x max-len) shapes")
    model: str = opt("auto", "model preset; auto = base on CUDA, tiny on CPU", choices=("auto", *PRESETS))
    amp: str = opt("auto", "mixed precision; auto = bf16 on CUDA, off on CPU",
                   choices=("auto", "bf16", "fp16", "off"))
    compile: bool = opt(False, "torch.compile each row's model (slow to start: one compilation per row)")
    sync_interval: int = opt(10, "interval/deep/full/graph: the host blocks every this many batches")
    loss_interval: int = opt(10, "losses are copied to the host every this many batches")
    streams: int | None = opt(None, "the deep and full rows: CUDA streams of the pipeline, 4 (the seed layout, "
                                    "default) or 3 (copy, forward, backward)")
    workers: int | None = opt(None, "loader worker processes for the strategies that load in workers "
                                    "(full, graph); default min(4, CPUs)")
    data: str | None = opt(None, "corpus directory; none = the built-in English->Chinese corpus")
    builtin_size: int = opt(40000, "sentence pairs in the built-in corpus's training split")
    out: str | None = opt(None, "output directory (default runs/bench/exp, exp2, ...)")
    profile: bool = opt(False, "also profile a few steps per row: Chrome/Perfetto traces, timeline.png, "
                               "GPU idle breakdown, kernels per stream, per step kernel time, span, overlap and "
                               "critical path (graph rows capture their graphs' topology for it)")
    profile_steps: int = opt(10, "steps profiled per row with --profile")
    seed: int = opt(0, "seed of every row's model initialisation and of the batch order")
    nproc: str | None = opt(None, "run the rows on N processes of this host (one per GPU, DDP; starts torchrun "
                                  "for you); a list 1,2,4 runs each world size in turn and adds a scaling table")
    dist_backend: str = opt("auto", "several processes: torch.distributed backend; auto = nccl on CUDA, gloo on "
                                    "CPU", choices=DIST_BACKENDS)
    dist_timeout: int = opt(300, "several processes: seconds a collective may wait for another rank (graph "
                                 "capture and compilation of a row happen between two collectives)")
    bucket_cap_mb: float = opt(25.0, "several processes: DistributedDataParallel's gradient bucket size in MB, "
                                     "as the trainer's --bucket-cap-mb")

    def __post_init__(self) -> None:
        RunConfig(device=self.device)  # the trainer's --device check
        check(self.steps >= 1, "steps", f"must be at least 1; got {self.steps}")
        check(self.warmup >= 0, "warmup", f"must be 0 or more; got {self.warmup}")
        check(self.repeats >= 1, "repeats", f"must be at least 1; got {self.repeats}")
        check(self.batch_size >= 1, "batch_size", f"must be a positive integer; got {self.batch_size}")
        # the batch flags, as the trainer checks them (one rule for --max-tokens, --max-len, --pack-width)
        DataConfig(batch_size=self.batch_size, max_tokens=self.max_tokens, max_len=self.max_len,
                   pack_width=self.pack_width)
        check_choice(self.attention, "attention", ("auto", "sdpa", "flex", "triton"))
        check(self.vocab is None or self.vocab == 0 or self.vocab >= 16, "vocab",
              f"must be 0 (the corpus's) or at least 16; got {self.vocab}")
        check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", f"must be in [0, 1); got {self.label_smoothing}")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            v = getattr(self, key)
            check((v is None and key == "dropout") or 0.0 <= v < 1.0, key, f"must be in [0, 1); got {v}")
        check(0.0 <= self.ema < 1.0, "ema", f"must be in [0, 1) (0 = none); got {self.ema}")
        check(self.ema_every >= 1, "ema_every", f"must be at least 1; got {self.ema_every}")
        check(self.pad_multiple >= 1, "pad_multiple", f"must be a positive integer; got {self.pad_multiple}")
        check_choice(self.model, "model", ("auto", *PRESETS))
        check_choice(self.amp, "amp", ("auto", "bf16", "fp16", "off"))
        check(self.sync_interval >= 1, "sync_interval", f"must be at least 1; got {self.sync_interval}")
        check(self.loss_interval >= 1, "loss_interval", f"must be at least 1; got {self.loss_interval}")
        check(self.streams is None or self.streams in PIPELINE_STREAMS, "streams",
              f"must be 3 or 4; got {self.streams}")
        check(self.workers is None or self.workers >= 0, "workers", f"must be 0 or more; got {self.workers}")
        check(self.builtin_size >= 100, "builtin_size", f"must be at least 100; got {self.builtin_size}")
        check(self.profile_steps >= 1, "profile_steps", f"must be at least 1; got {self.profile_steps}")
        check_choice(self.dist_backend, "dist_backend", DIST_BACKENDS)
        check(self.dist_timeout >= 5, "dist_timeout", f"must be at least 5 seconds; got {self.dist_timeout}")
        check(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be positive; got {self.bucket_cap_mb}")
        self.world_sizes()  # validates --nproc
        self.selected()  # validates --strategies

    def world_sizes(self) -> list[int]:
        """The world sizes of ``--nproc``, in the order given ([] without the flag)."""
        if self.nproc is None:
            return []
        sizes = []
        for part in str(self.nproc).split(","):
            try:
                sizes.append(int(part.strip()))
            except ValueError:
                check(False, "nproc", f"must be a number of processes or a list such as 1,2,4; got {self.nproc!r}")
        check(all(n >= 1 for n in sizes), "nproc", f"every world size must be at least 1; got {self.nproc!r}")
        check(len(set(sizes)) == len(sizes), "nproc", f"lists a world size twice: {self.nproc!r}")
        return sizes

    def selected(self) -> list[str]:
        """The rows named by ``--strategies`` (before references are added), in table order."""
        if self.strategies.strip().lower() == "all":
            return list(ORDER)
        names = [s.strip().lower() for s in self.strategies.split(",") if s.strip()]
        check(bool(names), "strategies", "must name at least one row, or 'all'")
        unknown = [n for n in names if n not in ORDER]
        check(not unknown, "strategies", f"unknown row(s) {', '.join(unknown)}; known: {', '.join(ORDER)}, all")
        return [n for n in ORDER if n in names]

    def rows(self, device: torch.device, world: int = 1) -> tuple[list[str], list[str]]:
        """(rows to run in order, notes about rows left out on this device and world size)."""
        names = set(self.selected())
        if self.references:
            names |= {"resident", "plain"}
            if "graph" in names:
                names.add("resident-graph")
        notes = []
        if self.references:
            why = peer_available(device)
            if why is None:
                names.add("compile-ro")
            elif "compile-ro" not in self.selected():
                notes.append(why)
        if "stock-ro" in names:
            why = peer_available(device, "stock-ro")
            if why is not None:
                names.discard("stock-ro")
                notes.append(why)
        for peer in PEERS:
            if peer in names and device.type != "cuda":
                names.discard(peer)
                notes.append(f"{peer} left out: reduce-overhead replays CUDA graphs, which need a CUDA device")
        if "resident-graph" in names and device.type != "cuda":
            names.discard("resident-graph")
            notes.append("resident-graph left out: CUDA graphs need a CUDA device")
        for peer in PEERS:
            if peer in names and world > 1:
                names.discard(peer)
                notes.append(f"{peer} left out on several processes: reduce-overhead's graph trees around "
                             "DistributedDataParallel are not measured here")
        return [n for n in ORDER if n in names], notes

    def resolve(self, device: torch.device) -> BenchConfig:
        """Fill the ``auto`` settings from the device."""
        cuda = device.type == "cuda"
        model = self.model if self.model != "auto" else ("base" if cuda else "tiny")
        amp = self.amp
        if amp == "auto":
            amp = "bf16" if cuda and torch.cuda.is_bf16_supported() else "off"
        workers = self.workers if self.workers is not None else min(4, _cpus())
        vocab = self.vocab if self.vocab is not None else (32000 if cuda else 0)
        # the preset's training dropout (its rate does not change a step's kernels, but the row should
        # measure, and bench.json record, the model as it trains)
        dropout = self.dropout if self.dropout is not None else preset_dropout(model)
        return dataclasses.replace(self, device=str(device), model=model, amp=amp, workers=workers, vocab=vocab,
                                   dropout=dropout)


def _cpus() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def peer_available(device: torch.device, name: str = "compile-ro") -> str | None:
    """None when the peer row ``name`` (compile-ro, stock-ro) can run on ``device``, else why not."""
    if device.type != "cuda":
        return f"{name} left out: reduce-overhead replays CUDA graphs, which need a CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"{name} left out: torch.compile needs the triton package on CUDA (pip install triton)"
    return None
