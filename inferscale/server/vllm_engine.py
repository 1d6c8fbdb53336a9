"""vLLM's async engine with InferScale's connector, and what the server can see of it.

`build_engine(composer)` starts `AsyncLLM` from `composer.engine_kwargs()` (the connector
configured) with one stat logger of ours, `EngineStats`, which keeps the scheduler's latest
numbers (running and waiting requests, KV-cache usage, prefix-cache queries and hits) and the
connector's counters vLLM carries from the workers (`inferscale.vllm.connector_stats`: injected
tokens, failed loads, the host tier's hits / misses / evictions / bytes, store reads). vLLM's
own default loggers (stdout every few seconds, the global prometheus registry) stay off.

The engine core (the scheduler and its connector instance) runs in a process of its own whatever
`VLLM_ENABLE_V1_MULTIPROCESSING` says: `AsyncLLM` always talks to it over IPC. That flag decides
where the *worker* runs: `0` puts it inside the engine-core process (one device), `1` (vLLM's
default) in yet another process. `probe_engine` reads the connector's `pending_requests()`, the
scheduler's request table and KV usage, and the worker connector's counters through
`collective_rpc`, which runs on the worker, so it needs the worker inside the engine-core process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and vLLM's pickle-based serialization to send a function
(`VLLM_ALLOW_INSECURE_SERIALIZATION=1`): a debugging aid (`engine_probe: true` sets both before
the engine starts), off by default. Without it, `EngineStats` (the scheduler's running/waiting
counts and KV-cache usage) and `get_num_unfinished_requests()` still show leaks.

A shutdown (`shutdown_engine`) gives the engine core `ENGINE_EXIT_S` seconds to exit, and the
core gives its workers `WORKER_EXIT_S` of them (`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`, unless the
environment sets it). vLLM's defaults, 5 s each, are less than a worker in its own process takes
to leave (about 5 s on CPU): the core was force-killed while it still waited for its worker, and
their message queues' shared memory leaked. With these, a SIGTERM'd server's engine core and
workers exit on their own and unlink what they created.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any


ENGINE_EXIT_S = 30.0  # a shutdown's wait for the engine core (and, inside it, its workers) to exit
WORKER_EXIT_S = 20  # the engine core's wait for its workers (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)


def shutdown_engine(engine, timeout_s: float = ENGINE_EXIT_S) -> None:
    """Stop `engine` (an `AsyncLLM`, or a remote engine), waiting up to `timeout_s` for its
    processes to exit cleanly before anything is killed."""
    engine.shutdown(timeout=timeout_s)


class EngineStats:
    """The scheduler's latest stats, as vLLM reports them after each engine step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.connector: dict[str, float] = {}  # the connector's counters (summed deltas) and gauges
        self.updated = 0.0

    def record(self, s: Any) -> None:
        with self.lock:
            self.running = int(s.num_running_reqs)
            self.waiting = int(s.num_waiting_reqs) + int(getattr(s, "num_skipped_waiting_reqs", 0))
            self.kv_cache_usage = float(s.kv_cache_usage)
            pc = getattr(s, "prefix_cache_stats", None)
            if pc is not None and not getattr(pc, "reset", False):
                self.prefix_queries += int(pc.queries)
                self.prefix_hits += int(pc.hits)
            kc = getattr(s, "kv_connector_stats", None) or {}  # InferScaleStats.data from the workers
            for k, v in kc.items():
                if k.endswith(("_bytes", "_budget")):  # gauges: the latest value
                    self.connector[k] = v
                else:
                    self.connector[k] = self.connector.get(k, 0) + v
            self.updated = time.time()

    def snapshot(self) -> dict:
        with self.lock:
            return {"running": self.running, "waiting": self.waiting, "kv_cache_usage": self.kv_cache_usage,
                    "prefix_cache_queries": self.prefix_queries, "prefix_cache_hits": self.prefix_hits,
                    "connector": dict(self.connector)}

    def logger_factory(self):
        """A vLLM `StatLoggerFactory` feeding this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    sink.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


def build_engine(composer, *, engine_probe: bool = False, **overrides):
    """(AsyncLLM, EngineStats) for this composer's model, memory root and connector."""
    if engine_probe:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker beside the scheduler
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_EXIT_S))  # read by the engine core
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    stats = EngineStats()
    kwargs = composer.engine_kwargs(**overrides)
    kwargs.setdefault("disable_log_stats", True)  # vLLM's default loggers off; ours is added below
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[stats.logger_factory()])
    return engine, stats


def _connector_state(worker) -> dict | None:
    """Runs inside the engine-core process (on its busy-loop thread, between steps)."""
    import sys

    out: dict[str, Any] = {}
    f = sys._getframe()
    while f is not None:  # the EngineCore handling this call is up the stack
        core = f.f_locals.get("self")
        sched = getattr(core, "scheduler", None)
        conn = getattr(sched, "connector", None)
        if conn is not None and hasattr(conn, "pending_requests"):
            out.update(pending_requests=conn.pending_requests(), scheduler_requests=len(sched.requests),
                       kv_cache_usage=float(sched.kv_cache_manager.usage),
                       refused_plans=int(conn.stats.get("refused_plans", 0)))
            break
        f = f.f_back
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        w = get_kv_transfer_group()
        out.update(injected_tokens=int(w.stats.get("injected_tokens", 0)),
                   failed_loads=int(w.stats.get("failed_loads", 0)))
        host = getattr(getattr(w, "worker", None), "host", None)  # the worker half's LRU in front of the store
        if host is not None:
            out["host_tier"] = {"hits": host.stats.hits, "misses": host.stats.misses,
                                "hit_rate": host.stats.hit_rate, "bytes": host.used}
    except Exception:  # noqa: BLE001 - the worker lives elsewhere (several devices)
        pass
    return out or None


async def probe_engine(engine) -> dict | None:
    """The connector's and scheduler's state inside the engine process, or None when the probe is
    unavailable (no insecure serialization, or the engine's layout is not the one expected)."""
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
        return None
    try:
        results = await engine.collective_rpc(_connector_state)
    except Exception:  # noqa: BLE001
        return None
    for r in results or ():
        if r:
            return r
    return None


async def attach_engine_model(engine, wait_s: float = 0.0) -> str:
    """Hand the engine's model to its connector's workers (`inferscale.vllm.model_access`), so
    plans that recompute inside the memory (`heads:N`) are computed. Returns "" or why they will
    be injected plainly. A remote engine not reachable yet (a gateway starting beside its pod) is
    asked again for up to `wait_s` seconds."""
    import asyncio

    from inferscale.vllm.model_access import ATTACH, attach_reasons

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if hasattr(engine, "attach_model"):  # a stock `vllm serve` pod (`remote.RemoteEngine`)
                return await engine.attach_model()
            return attach_reasons(await engine.collective_rpc(ATTACH))
        except OSError as e:  # not listening yet
            if time.monotonic() >= deadline:
                return f"the engine could not be reached ({e})"
        except Exception as e:  # noqa: BLE001 - the engine cannot be asked: nothing is recomputed
            if type(e).__name__ not in ("ConnectError", "ConnectTimeout") or time.monotonic() >= deadline:
                return f"the engine's workers could not be reached ({type(e).__name__}: {e})"
        await asyncio.sleep(1.0)
