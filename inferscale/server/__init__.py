"""The OpenAI-compatible server: FastAPI + uvicorn in front of vLLM's async engine with
InferScale's connector. `inferscale serve` runs it; `create_app` builds it from components.

One concept per module: `config` (ServerConfig), `auth` (API keys -> tenants, tenant-scoped user
ids), `schemas` (request bodies), `errors` (OpenAI-style errors), `admission` (bounded
concurrency + queue), `gateway` (the memory service in worker threads), `engine` (AsyncLLM and
its stats), `metrics` (Prometheus), `chat` and `memories` (the routes), `app` (`create_app`),
`cli` (`inferscale serve`). Importing this package imports nothing heavy.
"""


def __getattr__(name):
    if name == "create_app":
        from inferscale.server.app import create_app

        return create_app
    if name == "ServerConfig":
        from inferscale.server.settings import ServerConfig

        return ServerConfig
    raise AttributeError(name)


__all__ = ["ServerConfig", "create_app"]
