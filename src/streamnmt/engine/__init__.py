"""The stream/sync engine. It knows nothing of NMT: it drives a step function over batches."""

from streamnmt.engine.base import STRATEGIES, StepFunction, StepInfo, Strategy, make_strategy
from streamnmt.engine.config import STRATEGY_NAMES, EngineConfig
from streamnmt.engine.losses import DeferredLosses
from streamnmt.engine.streams import MAX_STREAMS, StreamManager
from streamnmt.engine import strategies as _strategies  # noqa: F401  (registers the seed strategies)
from streamnmt.engine import graphs as _graphs  # noqa: F401  (registers the graph strategy)
from streamnmt.syncstats import STATS, SyncStats, host_sync

__all__ = ["STRATEGY_NAMES", "EngineConfig", "DeferredLosses", "MAX_STREAMS", "StreamManager", "STRATEGIES",
           "StepFunction", "StepInfo", "Strategy", "make_strategy", "STATS", "SyncStats", "host_sync"]
