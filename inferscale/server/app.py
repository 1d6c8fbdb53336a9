"""`create_app`: the FastAPI app over already-built components (tests inject a tiny model).

    composer = MemoryComposer(config.memory_llm_config(model_dir), embedder)
    engine, stats = build_engine(composer, engine_probe=config.engine_probe)
    app = create_app(config, composer, engine, stats, model_name="SmolLM2-135M-Instruct")
    uvicorn.run(app, host=config.host, port=config.port)

The app owns none of them: whoever built the engine shuts it down. Several apps may share one
composer and engine (each has its own admission, metrics registry and tenancy), as long as they
run on the event loop that first used the engine.

Routes: `/v1/chat/completions` (chat.py), `/v1/memories...` (memories.py), `GET /v1/models`,
`GET /health` (200 while the engine runs, 503 when it is dead; engine and admission numbers),
`GET /metrics` (Prometheus text; metrics.py). `/health` and `/metrics` need no API key. Quotas per
tenant (tenant_quotas.py): requests in flight counted around every `/v1/` request, facts and KV
bytes checked by the memory's writes; expired facts swept every `sweep_interval_s`. The API
description: in open mode `/docs`, `/redoc` and `/openapi.json` as FastAPI serves them; with API
keys only `/openapi.json`, and only with a key (the browser pages could not send one).

Every request body is limited to `max_body_bytes` before anything reads it (`_LimitBody`: 413).
Open mode (no API keys) is logged as a warning when the app is created: anyone who can reach the
address acts as any user of the single tenant.
"""

from __future__ import annotations

import asyncio

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from inferscale.server.admission import Admission
from inferscale.server.auth import Tenancy, tenant_of
from inferscale.server.errors import (
    BodyTooLarge,
    CatchErrors,
    TrackStart,
    body_too_large_message,
    error_body,
    install_error_handlers,
)
from inferscale.server.gateway import MemoryGateway
from inferscale.server.metrics import CONTENT_TYPE, ServerMetrics
from inferscale.server.settings import ServerConfig
from inferscale.server.tenant_quotas import LimitInFlight, TenantQuotas, tenant_usage
from inferscale.server.vllm_engine import EngineStats, attach_engine_model, probe_engine

log = logging.getLogger("inferscale.server")


@dataclass
class AppState:
    config: ServerConfig
    composer: Any
    gateway: MemoryGateway
    engine: Any
    engine_stats: EngineStats
    tenancy: Tenancy
    admission: Admission
    metrics: ServerMetrics
    model_name: str
    started: float

    def engine_numbers(self) -> dict:
        d = self.engine_stats.snapshot()
        try:
            d["unfinished"] = int(self.engine.get_num_unfinished_requests())
        except Exception:  # noqa: BLE001
            d["unfinished"] = -1
        return d

    def live(self) -> dict:
        c = self.engine_stats.snapshot().get("connector") or {}
        tiers = {key: c.get(key, 0) for key in ("store_reads", "injected_tokens", "failed_loads", "recomputed_tokens",
                                                "plain_recompute_plans")}
        for tier in ("device", "host"):  # the connector's tiers, in the engine's workers
            hits, misses = c.get(f"{tier}_hits", 0), c.get(f"{tier}_misses", 0)
            tiers[tier] = {"hits": hits, "misses": misses, "evictions": c.get(f"{tier}_evictions", 0),
                           "bytes": c.get(f"{tier}_bytes", 0), "budget": c.get(f"{tier}_budget", 0),
                           "hit_rate": hits / (hits + misses) if hits + misses else 0.0}
        quotas = self.gateway.quotas
        usage = tenant_usage(self.gateway.memory.usage_by_user())
        tenants = {t: {"facts": f, "kv_bytes": b, "in_flight": quotas.in_flight[t]} for t, (f, b) in usage.items()}
        for t, n in list(quotas.in_flight.items()):
            tenants.setdefault(t, {"facts": 0, "kv_bytes": 0})["in_flight"] = n
        return {"admission": {"in_flight": self.admission.in_flight, "queued": self.admission.queued},
                "engine": self.engine_numbers(), "tiers": tiers, "tenants": tenants,
                "chain": self.gateway.chain_stats()}


class _CountRequests:
    """Pure ASGI middleware (it never touches `receive`, so disconnect detection is unaffected):
    `inferscale_requests_total{endpoint, status}` by route template."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def _send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


class _LimitBody:
    """Pure ASGI middleware: a request body over `limit` bytes is refused with 413 before the app
    reads it. A `Content-Length` over the limit is answered at once, without reading a byte of the
    body; a body without one (chunked) is counted as it arrives and, as soon as it passes the
    limit, reading stops and `receive` raises `BodyTooLarge` (FastAPI passes it on to the 413
    handler; if nothing handles it, this middleware answers 413 itself while it still can). The
    413 says `Connection: close`, so the server drops the connection instead of reading the rest.
    The app never holds more than `limit` bytes of a body. Other messages (`http.disconnect`)
    pass through unchanged."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.strip().isdigit() and int(value) > self.limit:
                return await self._refuse(scope, receive, send)
        received = 0

        async def _receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        tracked = TrackStart(send)
        try:
            await self.app(scope, _receive, tracked)
        except BodyTooLarge:
            if tracked.started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        """413, and the connection closes after it (the rest of the body is never read)."""
        await JSONResponse(error_body(413, body_too_large_message(self.limit), code=BodyTooLarge.code),
                           status_code=413, headers=BodyTooLarge.HEADERS)(scope, receive, send)


def create_app(config: ServerConfig, composer, engine, engine_stats: EngineStats | None = None, *,
               model_name: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    from inferscale.server import chat, memories

    metrics = metrics or ServerMetrics()
    quotas = TenantQuotas(config.quotas)
    tenancy = Tenancy(config.api_keys)
    state = AppState(config=config, composer=composer, gateway=MemoryGateway(composer, quotas=quotas), engine=engine,
                     engine_stats=engine_stats or EngineStats(), tenancy=tenancy,
                     admission=Admission(config.max_concurrent, config.max_queued), metrics=metrics,
                     model_name=model_name or config.model_name(composer.config.model), started=time.time())
    metrics.watch(state.live)
    open_mode = state.tenancy.open_mode
    docs = {} if open_mode else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="InferScale", description="OpenAI-compatible chat with per-user memory injected as KV",
                  version="0.1.0", **docs)
    app.state.inferscale = state
    state.gateway.attach_extraction(engine, config.extraction_url, config.extraction_model,  # facts from added
                                    config.extraction_api_key_env)  # messages: the served model, or an endpoint
    app.router.on_startup.append(lambda: state.gateway.start_extraction(asyncio.get_running_loop()))
    app.router.on_startup.append(lambda: state.gateway.start_sweeper(config.sweep_interval_s))

    async def attach_model() -> None:  # heads:N plans are computed with the engine's own model
        reason = await attach_engine_model(engine, wait_s=600.0)  # a gateway may start before its pod
        if reason:
            log.warning("heads:N plans will be injected plainly: %s", reason)

    attaching: list[asyncio.Task] = []  # held until done; cancelled if the app stops first
    app.router.on_startup.append(lambda: attaching.append(asyncio.get_running_loop().create_task(attach_model())))
    app.router.on_shutdown.append(lambda: [t.cancel() for t in attaching])
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(memories.router)
    app.add_middleware(CatchErrors)  # innermost: an error no handler took is a JSON 500, the connection stays
    app.add_middleware(LimitInFlight, limits=quotas, tenancy=tenancy)
    app.add_middleware(_LimitBody, limit=config.max_body_bytes)
    app.add_middleware(_CountRequests, metrics=metrics)  # outermost: counts the 413s too
    calibration = getattr(composer, "calibration", None)
    if config.default_mode == "auto" and calibration is None:
        log.warning("memory.mode auto: the model is not calibrated (no calibration.json for it in %s, none shipped "
                    "for it), so memory is served as text; run `inferscale calibrate --quick --memory-root %s` "
                    "(minutes) or without --quick (the full measurement)", config.memory_root, config.memory_root)
    elif config.default_mode == "auto":
        log.info("memory.mode auto follows the %s calibration (%s): %s", calibration.source, calibration.data,
                 ", ".join(f"k<={k}: {p or 'text'}" for k, p in sorted(calibration.choices.items())))
    if open_mode:
        log.warning("open mode: no API keys, so anyone who can reach http://%s:%s can read and write every "
                    "user's memory (serve with --api-keys FILE to require keys)", config.host,
                    config.port or "<any free port>")
    else:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(tenant: str = Depends(tenant_of)):
            return JSONResponse(app.openapi())

    @app.get("/health")
    async def health():
        errored = bool(getattr(engine, "errored", False))
        body = {"status": "error" if errored else "ok", "model": state.model_name,
                "tenancy": "open" if state.tenancy.open_mode else "api-keys",
                "uptime_s": round(time.time() - state.started, 3),
                "admission": {"in_flight": state.admission.in_flight, "queued": state.admission.queued,
                              "max_concurrent": state.admission.max_concurrent,
                              "max_queued": state.admission.max_queued},
                "engine": state.engine_numbers()}
        if config.engine_probe:
            body["connector"] = await probe_engine(engine)
        return JSONResponse(body, status_code=503 if errored else 200)

    @app.get("/metrics")
    async def prometheus():  # on a read thread: the tenants' usage is read from the catalog
        return Response(await state.gateway.run(metrics.render), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(tenant: str = Depends(tenant_of)):
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "inferscale"}]}

    return app
