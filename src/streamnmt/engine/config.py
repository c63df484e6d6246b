"""Engine settings: which synchronisation strategy drives the steps, how often the host waits, how
many micro-batches make an optimizer step, and how ranks talk when training runs on several."""

from __future__ import annotations

from dataclasses import dataclass

from streamnmt.configbase import check, check_choice, opt

STRATEGY_NAMES = ("baseline", "event", "interval", "deep", "full", "graph")
DIST_BACKENDS = ("auto", "nccl", "gloo")
PIPELINES = ("deep", "full")  # the strategies whose stream count is a setting (--streams)
PIPELINE_STREAMS = (3, 4)
COMPILE_CHOICES = ("auto", "on", "off", "background")


@dataclass(kw_only=True)
class EngineConfig:
    sync_strategy: str = opt("auto", "how the host and the GPU streams are synchronised; auto = graph on "
                                     "CUDA, full on CPU", choices=("auto", *STRATEGY_NAMES))
    sync_interval: int = opt(10, "interval/deep/full/graph: the host blocks every this many batches")
    loss_interval: int = opt(10, "losses are copied to the host every this many batches")
    compile: str = opt("auto", "torch.compile the model (fused kernels): on, off, auto = on in graph mode "
                               "when the run is long enough to win the compile time back, or background = "
                               "a child process compiles while the run trains uncompiled, and the compiled "
                               "step takes over when it is done (one process)",
                       choices=COMPILE_CHOICES, const="on")
    streams: int | None = opt(None, "deep/full: CUDA streams of the pipeline: 4 = copy N+1, forward N, backward N, "
                                    "copy N+2 (the seed layout, default); 3 = copy, forward, backward")
    accum_steps: int = opt(1, "gradient accumulation: batches per optimizer step (the loss is normalised by "
                              "the target tokens of all of them, on all ranks)")
    dist_backend: str = opt("auto", "several processes (torchrun): torch.distributed backend; auto = nccl on "
                                    "CUDA, gloo on CPU", choices=DIST_BACKENDS)
    # 600 s is PyTorch's own timeout for NCCL (its gloo one is 30 minutes), used here for every
    # backend; the help states the number, as every other flag's does.
    dist_timeout: int = opt(600, "several processes: seconds a collective (or a wait on a replayed one) may "
                                 "wait for another rank before the run stops with an error (a dead or hung "
                                 "rank)")
    bucket_cap_mb: float = opt(25.0, "several processes: DistributedDataParallel's gradient bucket size in MB "
                                     "(PyTorch's and fairseq's default 25): larger buckets, fewer and later "
                                     "all-reduces")

    def __post_init__(self) -> None:
        check_choice(self.sync_strategy, "sync_strategy", ("auto", *STRATEGY_NAMES))
        if str(self.compile).lower() in ("true", "false"):  # config.yaml of earlier versions held a bool
            self.compile = "on" if str(self.compile).lower() == "true" else "off"
        check_choice(self.compile, "compile", COMPILE_CHOICES)
        check(self.sync_interval >= 1, "sync_interval", f"must be at least 1; got {self.sync_interval}")
        check(self.loss_interval >= 1, "loss_interval", f"must be at least 1; got {self.loss_interval}")
        if self.streams is not None:
            check(self.streams in PIPELINE_STREAMS, "streams", f"must be 3 or 4; got {self.streams}")
            check(self.sync_strategy in ("auto", *PIPELINES), "streams",
                  f"applies to the deep and full strategies only; --sync-strategy is {self.sync_strategy}")
        check(self.accum_steps >= 1, "accum_steps", f"must be at least 1; got {self.accum_steps}")
        check_choice(self.dist_backend, "dist_backend", DIST_BACKENDS)
        check(self.dist_timeout >= 5, "dist_timeout", f"must be at least 5 seconds; got {self.dist_timeout}")
        check(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be positive; got {self.bucket_cap_mb}")
