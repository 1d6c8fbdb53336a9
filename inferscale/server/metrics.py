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
- per tenant (quotas): `inferscale_tenant_facts{tenant}`, `inferscale_tenant_kv_bytes{tenant}`,
  `inferscale_tenant_requests_in_flight{tenant}`.
- the KV tiers serving reads through: the connector's device tier (fact KV kept in the GPU's memory;
  off on CPU) and host-memory LRU in front of the users' stores (local files or the shared Redis
  tier), counted inside the engine's workers and carried here by vLLM's connector stats:
  `inferscale_tier_hit_rate{tier="device"|"host"}`, `inferscale_tier_hits_total`,
  `inferscale_tier_misses_total`, `inferscale_tier_evictions_total`, `inferscale_tier_bytes`,
  `inferscale_tier_budget_bytes`, `inferscale_tier_store_reads_total` (facts read from the store),
  `inferscale_connector_injected_tokens_total`, `inferscale_connector_failed_loads_total` (loads
  vLLM recomputed), `inferscale_connector_recomputed_tokens_total` (prompt tokens the connector
  computed with the engine's model: `heads:N`, and a history-first chat's conversation that vLLM's
  prefix cache did not hold), `inferscale_connector_cached_prefix_tokens_total` (a chat's
  conversation the connector read from vLLM's prefix cache instead of computing it again),
  `inferscale_connector_plain_recompute_plans_total`
  (such plans injected plainly: no model attached).
- the memory chain (`memory.chain`): `inferscale_chain_{plans,hits,link_tokens,prefilled_tokens,extensions,
  links_encoded,links_dropped,errors}_total`. A remote engine (`--engine-url`) reports none of these here: its vLLM does.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0,
           10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CHAIN_COUNTERS = (  # the memory chain's (`memory.chain.MemoryChain.stats`)
    ("plans", "whole-memory requests served from the memory chain"),
    ("hits", "chain requests that injected at least one stored link"),
    ("link_tokens", "fact tokens injected from the chain's stored links"),
    ("prefilled_tokens", "chain fact tokens prefilled as text (their links not stored yet)"),
    ("extensions", "background runs that encoded missing links (appended facts, or after an update or delete)"),
    ("links_encoded", "links encoded"),
    ("links_dropped", "links removed as no longer on their user's chain"),
    ("errors", "chain extensions that failed"))


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
        for name, key, doc, family in (
                ("inferscale_tier_hit_rate", "hit_rate", "hit rate of the KV tier serving reads through", GaugeMetricFamily),
                ("inferscale_tier_hits", "hits", "hits of the KV tier", CounterMetricFamily),
                ("inferscale_tier_misses", "misses", "misses of the KV tier", CounterMetricFamily),
                ("inferscale_tier_evictions", "evictions", "entries the KV tier evicted", CounterMetricFamily),
                ("inferscale_tier_bytes", "bytes", "bytes held by the KV tier", GaugeMetricFamily),
                ("inferscale_tier_budget_bytes", "budget", "byte budget of the KV tier", GaugeMetricFamily)):
            m = family(name, doc, labels=["tier"])
            for tier in ("device", "host"):
                m.add_metric([tier], float((tiers.get(tier) or {}).get(key, 0)))
            yield m
        tenants = v.get("tenants") or {}
        for name, key, doc in (("inferscale_tenant_facts", "facts", "facts a tenant's users hold"),
                               ("inferscale_tenant_kv_bytes", "kv_bytes", "bytes of stored KV a tenant's users hold"),
                               ("inferscale_tenant_requests_in_flight", "in_flight", "a tenant's requests in flight")):
            g = GaugeMetricFamily(name, doc, labels=["tenant"])
            for tenant, usage in sorted(tenants.items()):
                g.add_metric([tenant], float(usage.get(key, 0)))
            yield g
        for name, key, doc in (("inferscale_tier_store_reads", "store_reads", "facts the KV tier read from the store"),
                               ("inferscale_connector_injected_tokens", "injected_tokens",
                                "prompt tokens whose KV the connector injected"),
                               ("inferscale_connector_failed_loads", "failed_loads",
                                "memory loads that failed (vLLM recomputed them)"),
                               ("inferscale_connector_recomputed_tokens", "recomputed_tokens",
                                "prompt tokens the connector computed with the engine's model (heads:N, a chat's "
                                "conversation before its memory)"),
                               ("inferscale_connector_cached_prefix_tokens", "cached_prefix_tokens",
                                "prompt tokens the connector read from vLLM's prefix cache instead of computing them"),
                               ("inferscale_connector_plain_recompute_plans", "plain_recompute_plans",
                                "plans that recompute inside the memory, injected plainly (no model attached)")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(tiers.get(key, 0)))
            yield c
        chain = v.get("chain") or {}
        for key, doc in CHAIN_COUNTERS:
            c = CounterMetricFamily(f"inferscale_chain_{key}", doc)
            c.add_metric([], float(chain.get(key, 0)))
            yield c


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
