"""The connector's counters, as vLLM carries connector stats from the workers to the stat loggers.

Each worker's `InferScaleConnector.get_kv_connector_stats()` hands over what happened since its
last call (a delta); vLLM aggregates the workers' deltas into `SchedulerStats.kv_connector_stats`
(this class's `data`), which the server's stat logger (`inferscale.server.vllm_engine.EngineStats`)
adds up into the `/metrics` counters. So the connector's host tier (the one KV cache serving
reads through) and its store reads are visible without any probe into the engine process.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = ("injected_tokens", "failed_loads", "host_hits", "host_misses", "host_evictions", "device_hits",
            "device_misses", "device_evictions", "store_reads", "recomputed_tokens", "cached_prefix_tokens",
            "plain_recompute_plans")
GAUGES = ("host_bytes", "host_budget", "device_bytes", "device_budget")  # latest value (summed over workers)


@dataclass
class InferScaleStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "InferScaleStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS + GAUGES)


class StatsDelta:
    """Turns a worker's running totals into the deltas vLLM wants per call."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: dict[str, int], gauges: dict[str, int]) -> InferScaleStats | None:
        delta = {k: totals[k] - self._last.get(k, 0) for k in COUNTERS}
        self._last = {k: totals[k] for k in COUNTERS}
        if not any(delta.values()):
            return None
        return InferScaleStats(data={**delta, **gauges})
