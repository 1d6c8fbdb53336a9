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
`GET /metrics` (Prometheus text; metrics.py). `/health` and `/metrics` need no API key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .admission import Admission
from .auth import Tenancy, tenant_of
from .config import ServerConfig
from .engine import EngineStats, probe_engine
from .errors import install_error_handlers
from .gateway import MemoryGateway
from .metrics import CONTENT_TYPE, ServerMetrics


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
        try:
            tiers = self.composer.memory.tiers.stats()
        except Exception:  # noqa: BLE001
            tiers = {}
        return {"admission": {"in_flight": self.admission.in_flight, "queued": self.admission.queued},
                "engine": self.engine_numbers(), "tiers": tiers}


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


def create_app(config: ServerConfig, composer, engine, engine_stats: EngineStats | None = None, *,
               model_name: str | None = None, metrics: ServerMetrics | None = None) -> FastAPI:
    from . import chat, memories

    metrics = metrics or ServerMetrics()
    state = AppState(config=config, composer=composer, gateway=MemoryGateway(composer), engine=engine,
                     engine_stats=engine_stats or EngineStats(), tenancy=Tenancy(config.api_keys),
                     admission=Admission(config.max_concurrent, config.max_queued), metrics=metrics,
                     model_name=model_name or config.model_name(composer.config.model), started=time.time())
    metrics.watch(state.live)
    app = FastAPI(title="InferScale", description="OpenAI-compatible chat with per-user memory injected as KV",
                  version="0.1.0")
    app.state.inferscale = state
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(memories.router)
    app.add_middleware(_CountRequests, metrics=metrics)

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
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    from fastapi import Depends

    @app.get("/v1/models")
    async def models(tenant: str = Depends(tenant_of)):
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "inferscale"}]}

    return app
