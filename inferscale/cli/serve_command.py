"""`inferscale serve`: the OpenAI-compatible server with per-user memory.

    inferscale serve                                   # packaged SmolLM2, memory under ~/.cache/inferscale/memory
    inferscale serve --model DIR --store mem --port 8000 --api-keys keys.yaml
    inferscale serve --config server.yaml              # any ServerConfig field; flags win over the file

Flags not given are not passed, so the YAML file (then `ServerConfig`'s defaults) decide them.
Everything heavy (fastapi, uvicorn, torch, vllm) is imported only when the command runs.

This entry point owns the engine: it shuts the engine down (and closes the memory) when the app
shuts down, which is how uvicorn ends on SIGTERM and SIGINT (it re-raises the signal after the
graceful shutdown, so code after `uvicorn.run` would never run), and again on any other way out.
The engine gets the time its processes need to exit cleanly (`vllm_engine.shutdown_engine`).
If the server is killed outright (SIGKILL, the OOM killer), the engine's processes die with it
(`inferscale.vllm.lifetime`).
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Callable

from inferscale.config import EngineSettings, add_flags

def _k(text: str) -> int | str:
    """`--default-k`: a count, or "all" (the whole memory)."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of facts or 'all', got {text!r}") from None


# flag -> ServerConfig field, for the server's own settings (the shared engine settings' flags come
# from their `knob`s: `config.add_flags`); type conversions are argparse's, ranges ServerConfig's
_FLAGS = (
    ("--model", "model", str, "DIR", "Hugging Face model folder or a name from `inferscale models list` "
                                     "(default: the packaged SmolLM2-135M-Instruct)"),
    ("--store", "memory_root", str, "DIR", "memory directory (alias --memory-root; default: "
                                           "~/.cache/inferscale/memory)"),
    ("--engine-url", "engine_url", str, "URL", "a `vllm serve` (loaded with the InferScale connector) to send "
                                               "composed prompts to: this server is then a gateway (default: "
                                               "vLLM in this process)"),
    ("--engine-model", "engine_model", str, "NAME", "the model name that vllm serve serves (default: --model)"),
    ("--host", "host", str, "ADDR", "address to listen on (default: 127.0.0.1)"),
    ("--port", "port", int, "N", "port to listen on (default: 8000; 0: any free port)"),
    ("--api-keys", "api_keys_file", str, "FILE", "YAML mapping API key -> tenant (default: none = open mode, "
                                                 "one tenant 'default')"),
    ("--served-model-name", "served_model_name", str, "NAME", "model name clients send (default: the folder's name)"),
    ("--max-concurrent", "max_concurrent", int, "N", "chat requests inside the engine at once (default: 16)"),
    ("--max-queued", "max_queued", int, "N", "chat requests waiting for a slot; beyond: 429 (default: 64)"),
    ("--sweep-interval", "sweep_interval_s", float, "S", "seconds between sweeps that forget expired facts completely "
     "(default: 60; 0: never, reads skip them anyway)"),
    ("--timeout", "request_timeout_s", float, "S", "per-request timeout in seconds; beyond: 504 (default: 120)"),
    ("--default-k", "default_k", _k, "N|all", "facts retrieved when a request does not say (default: 10), or all: "
                                             "the whole memory, in the order it was added"),
    ("--max-k", "max_k", int, "N", "most facts a request may ask for (default: 100)"),
    ("--default-policy", "default_policy", str, "POLICY", "recovery policy of injected memory when a request "
                                                          "does not say: none, last:N or all (default: none)"),
    ("--max-body-bytes", "max_body_bytes", int, "N", "largest request body; beyond: 413 before it is read "
                                                     "(default: 8388608 = 8 MiB)"),
    ("--max-add-items", "max_add_items", int, "N", "most facts + turns in one memory add; beyond: 413 "
                                                   "(default: 1000)"),
    ("--max-query-chars", "max_query_chars", int, "N", "longest chat question or search query in characters; "
                                                       "beyond: 400 (default: 16384)"),
    ("--max-text-chars", "max_text_chars", int, "N", "longest fact or turn text in characters; beyond: 400 "
                                                     "(default: 32768)"),
    ("--extraction-url", "extraction_url", str, "URL",
     "an OpenAI-compatible endpoint (its /v1 root) that extracts facts from added messages (default: the "
     "served model, through the same engine)"),
    ("--extraction-model", "extraction_model", str, "NAME", "the model --extraction-url serves"),
    ("--extraction-api-key-env", "extraction_api_key_env", str, "VAR",
     "the environment variable holding --extraction-url's API key (default: OPENAI_API_KEY)"),
    ("--log-level", "log_level", str, "LEVEL", "uvicorn log level (default: info)"),
)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with per-user memory injected as KV",
                       description="Serve /v1/chat/completions (the `user` field selects the memory), "
                                   "/v1/memories, /health and /metrics over vLLM with InferScale's connector.")
    d = argparse.SUPPRESS
    p.add_argument("--config", default=d, metavar="FILE", help="YAML file of ServerConfig settings")
    for flag, dest, typ, metavar, help_ in _FLAGS:
        names = [flag, "--memory-root"] if flag == "--store" else [flag]
        p.add_argument(*names, dest=dest, type=typ, default=d, metavar=metavar, help=help_)
    add_flags(p, EngineSettings)  # every shared engine setting, from its knob
    p.add_argument("--engine-probe", dest="engine_probe", action="store_true", default=d,
                   help="report the connector's pending state in /health (debugging; enables vLLM's "
                        "pickle-based IPC)")
    p.add_argument("--remember", dest="remember", action="store_true", default=d,
                   help="chats remember by default: each exchange is stored and its facts extracted in the "
                        "background (a request's memory.remember overrides)")
    from inferscale.cli import VERBOSE_HELP

    p.add_argument("--verbose", action="store_true", default=d, help=VERBOSE_HELP)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from inferscale.server.settings import ServerConfig

    values = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config", "verbose")}
    return ServerConfig.from_sources(getattr(args, "config", None), **values)


def run(args: argparse.Namespace) -> int:
    import os

    from inferscale.cli import engine_environment

    cfg = config_from_args(args)  # every bad setting fails here, before anything loads
    engine_environment(getattr(args, "verbose", False))  # before vLLM is imported
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    import uvicorn

    from inferscale.cli.memory_commands import LazyEmbedder
    from inferscale.models import resolve_model
    from inferscale.server.app import create_app
    from inferscale.server.vllm_engine import build_engine, shutdown_engine
    from inferscale.serving.composer import MemoryComposer

    model_dir = str(resolve_model(cfg.model))
    composer = MemoryComposer(cfg.memory_llm_config(model_dir), embedder=LazyEmbedder(cfg.query_weights))
    # load the embedder and its query network now (made into the cache on first use), not on the first request
    composer.memory.embedder.embed_query("warm-up")
    if cfg.engine_url:  # a gateway: the engine is a stock `vllm serve` with the connector
        from inferscale.server.remote import RemoteEngine
        from inferscale.server.vllm_engine import EngineStats

        engine, stats = RemoteEngine(cfg.engine_url, cfg.engine_model or model_dir), EngineStats()
        if not cfg.kv_store:
            import logging

            logging.getLogger("inferscale.server").warning(
                "--engine-url without --kv-store: the vLLM server's connector must read this memory directory "
                "(%s) as its memory_root, or every memory request is prefilled as text", cfg.memory_root)
    else:
        engine, stats = build_engine(composer, engine_probe=cfg.engine_probe)
    closed = False
    app = None

    def close() -> None:
        nonlocal closed
        if not closed:
            closed = True
            shutdown_engine(engine)  # the engine core and its workers exit on their own, in time
            if app is not None:
                app.state.inferscale.gateway.close()
            composer.close()

    try:
        app = create_app(cfg, composer, engine, stats)
        close_on_shutdown(app, close)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    finally:
        close()
    return 0


def close_on_shutdown(app, close: Callable[[], None]) -> None:
    """Call `close()` when `app`'s lifespan ends (uvicorn's shutdown, after the open requests are
    done), around whatever lifespan the app already has."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            try:
                yield state
            finally:
                close()

    app.router.lifespan_context = lifespan
