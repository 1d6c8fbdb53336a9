"""Prometheus metrics of one app, in a registry of its own (never the process-global one).

- `inferscale_ttft_seconds{phase, mode}`: time to first token split into phases:
  `queue` (waiting for an admission slot), `search` (query embedding + vector search),
  `compose` (layout, plan, tokenisation), `engine` (submission -> first token: the connector's
  injection + prefill of the rest + the first decode step), and `total` (request in -> first token).
- `inferscale_prompt_tokens_total{kind}`: `injected` (memory tokens planned for injection),
  `prefilled` (prompt tokens vLLM computed), `cached` (prompt tokens vLLM did not compute:
  injected + its own prefix-cache hits).
- `inferscale_generated_tokens_total`, `inferscale_requests_total{endpoint, status}`,
  `inferscale_rejected_total{reason}` (overload, timeout, disconnect).
- gauges: `inferscale_requests_in_flight`, `inferscale_requests_queued` (admission),
  `inferscale_engine_unfinished_requests` (vLLM's frontend), `inferscale_engine_running_requests`,
  `inferscale_engine_waiting_requests`, `inferscale_engine_kv_cache_usage` (scheduler stats),
  `inferscale_engine_prefix_cache_{queries,hits}_total`.
- memory tiers (`memory.tiers.stats()` of the server's memory service):
  `inferscale_tier_hit_rate{tier}`, `inferscale_tier_hits_total{tier}`, `inferscale_tier_misses_total{tier}`,
  `inferscale_tier_bytes{tier}`, `inferscale_tier_disk_reads_total`. These count KV read through the
  service (`load_kv`); the connector reads the KV it injects inside the engine process, through a
  host-memory LRU of its own, whose hits and misses `/health` reports with the engine probe on.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
           10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Live:
    """Gauges and counters read at scrape time from the components that hold them."""

    def __init__(self, read: Callable[[], dict]) -> None:
        self._read = read

    def collect(self):
        v = self._read()
        adm = v.get("admission") or {}
        g = GaugeMetricFamily("inferscale_requests_in_flight", "chat requests holding an admission slot")
        g.add_metric([], adm.get("in_flight", 0))
        yield g
        g = GaugeMetricFamily("inferscale_requests_queued", "chat requests waiting for an admission slot")
        g.add_metric([], adm.get("queued", 0))
        yield g
        eng = v.get("engine") or {}
        for name, key, doc in (("inferscale_engine_unfinished_requests", "unfinished", "requests vLLM's frontend tracks"),
                               ("inferscale_engine_running_requests", "running", "requests the scheduler runs"),
                               ("inferscale_engine_waiting_requests", "waiting", "requests the scheduler holds back"),
                               ("inferscale_engine_kv_cache_usage", "kv_cache_usage",
                                "fraction of the paged KV cache's blocks in use")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(eng.get(key, 0)))
            yield g
        for name, key in (("inferscale_engine_prefix_cache_queries", "prefix_cache_queries"),
                          ("inferscale_engine_prefix_cache_hits", "prefix_cache_hits")):
            c = CounterMetricFamily(name, f"vLLM prefix cache {key.rsplit('_', 1)[1]} (tokens)")
            c.add_metric([], float(eng.get(key, 0)))
            yield c
        tiers = v.get("tiers") or {}
        rate = GaugeMetricFamily("inferscale_tier_hit_rate", "hit rate of a memory KV tier", labels=["tier"])
        hits = CounterMetricFamily("inferscale_tier_hits", "hits of a memory KV tier", labels=["tier"])
        misses = CounterMetricFamily("inferscale_tier_misses", "misses of a memory KV tier", labels=["tier"])
        size = GaugeMetricFamily("inferscale_tier_bytes", "bytes held by a memory KV tier", labels=["tier"])
        for tier in ("device", "host"):
            s = tiers.get(tier)
            if not isinstance(s, dict):
                continue
            rate.add_metric([tier], float(s.get("hit_rate", 0.0)))
            hits.add_metric([tier], float(s.get("hits", 0)))
            misses.add_metric([tier], float(s.get("misses", 0)))
            size.add_metric([tier], float(s.get("bytes", 0)))
        yield from (rate, hits, misses, size)
        disk = CounterMetricFamily("inferscale_tier_disk_reads", "memory KV reads that went to disk")
        disk.add_metric([], float(tiers.get("disk_reads", 0)))
        yield disk


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("inferscale_ttft_seconds", "time to first token, by phase", ["phase", "mode"],
                              buckets=BUCKETS, registry=r)
        self.prompt_tokens = Counter("inferscale_prompt_tokens", "prompt tokens by how they reached the KV cache",
                                     ["kind"], registry=r)
        self.generated_tokens = Counter("inferscale_generated_tokens", "tokens generated", registry=r)
        self.requests = Counter("inferscale_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.rejected = Counter("inferscale_rejected", "chat requests refused or cut short", ["reason"], registry=r)
        self.answers = Counter("inferscale_answers", "chat answers by memory mode and recovery policy",
                               ["mode", "policy"], registry=r)
        for kind in ("injected", "prefilled", "cached"):
            self.prompt_tokens.labels(kind)
        for reason in ("overload", "timeout", "disconnect"):
            self.rejected.labels(reason)

    def watch(self, read: Callable[[], dict]) -> None:
        """Register the live gauges; `read()` returns {"admission", "engine", "tiers"} dicts."""
        self.registry.register(_Live(read))

    def observe_first_token(self, mode: str, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.ttft.labels(phase, mode).observe(max(seconds, 0.0))

    def observe_prompt(self, injected: int, prompt: int, cached: int) -> None:
        self.prompt_tokens.labels("injected").inc(injected)
        self.prompt_tokens.labels("cached").inc(cached)
        self.prompt_tokens.labels("prefilled").inc(max(prompt - cached, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
