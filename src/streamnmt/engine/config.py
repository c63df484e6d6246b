"""Engine settings: which synchronisation strategy drives the steps, and how often the host waits."""

from __future__ import annotations

from dataclasses import dataclass

from streamnmt.configbase import check, check_choice, opt

STRATEGY_NAMES = ("baseline", "event", "interval", "deep", "full", "graph")


@dataclass(kw_only=True)
class EngineConfig:
    sync_strategy: str = opt("full", "how the host and the GPU streams are synchronised",
                             choices=STRATEGY_NAMES)
    sync_interval: int = opt(10, "interval/deep/full/graph: the host blocks every this many batches")
    loss_interval: int = opt(10, "losses are copied to the host every this many batches")
    compile: bool = opt(False, "torch.compile the model (fused kernels)")

    def __post_init__(self) -> None:
        check_choice(self.sync_strategy, "sync_strategy", STRATEGY_NAMES)
        check(self.sync_interval >= 1, "sync_interval", f"must be at least 1; got {self.sync_interval}")
        check(self.loss_interval >= 1, "loss_interval", f"must be at least 1; got {self.loss_interval}")
