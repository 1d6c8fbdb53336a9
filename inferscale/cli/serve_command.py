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

def _cpus(text: str) -> str | list[int]:
    """`--kv-load-cpus`: "auto", or CPU ids separated by commas."""
    if text == "auto":
        return text
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'auto' or CPU ids separated by commas, got {text!r}") from None


def _k(text: str) -> int | str:
    """`--default-k`: a count, or "all" (the whole memory)."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of facts or 'all', got {text!r}") from None


# flag -> ServerConfig field (type conversions are argparse's; ranges are ServerConfig's)
_FLAGS = (
    ("--model", "model", str, "DIR", "Hugging Face model folder or a name from `inferscale models list` "
                                     "(default: the packaged SmolLM2-135M-Instruct)"),
    ("--store", "memory_root", str, "DIR", "memory directory (alias --memory-root; default: "
                                           "~/.cache/inferscale/memory)"),
    ("--catalog", "catalog", str, "URL", "postgresql://... catalog shared by replicas (default: SQLite in the "
                                         "memory directory)"),
    ("--kv-store", "kv_store", str, "URL", "redis://... KV tier shared by replicas (default: files in the memory "
                                           "directory)"),
    ("--plan-secret-file", "plan_secret_file", str, "FILE",
     "the secret memory plans are signed with (default: plan-secret in the memory directory, made at first "
     "start); a gateway (--engine-url) and its vLLM pods name the same file"),
    ("--kv-load", "kv_load", str, "sync|layerwise|background",
     "how the connector writes memory KV: every layer before the forward pass (default: sync), each layer "
     "right before its attention (layerwise: copies overlap compute on a GPU), or on a writer thread beside "
     "the forward pass, on the CPUs it does not use (background, CPU)"),
    ("--kv-load-cpus", "kv_load_cpus", _cpus, "auto|ID,ID,...",
     "background loads: the writer thread's CPUs (default: auto, those the forward pass is not bound to)"),
    ("--kv-write-threads", "kv_write_threads", int, "N",
     "threads a load's layers are written on (default: torch's intra-op threads)"),
    ("--kv-write", "kv_write", str, "auto|plain|backend",
     "how memory KV goes into the paged cache: straight in the layout learned from the backend's write, full "
     "blocks in streaming stores (default: auto), the same with plain stores (plain), or through the "
     "attention backend's own write (backend); all three write the same bits"),
    ("--device-cache-bytes", "device_cache_bytes", int, "N",
     "the connector's device tier of fact KV (default: 2 GiB on CUDA, off on CPU)"),
    ("--host-cache-bytes", "host_cache_bytes", int, "N",
     "the connector's host-memory tier of fact KV in front of the stores (default: 1073741824 = 1 GiB)"),
    ("--encode-mode", "encode_mode", str, "one-pass|per-fact",
     "how an ingest's facts are encoded: packed as prefix trees (default: one-pass) or one by one"),
    ("--encoder-device", "encoder_device", str, "auto|cpu|cuda[:N]", "where facts are encoded (default: cpu)"),
    ("--index", "index", str, "auto|faiss|exact", "the per-user vector index (default: auto, faiss where installed)"),
    ("--chat-layout", "chat_layout", str, "auto|history-first|memory-first",
     "where a chat's memory goes: inside the new user turn, after the system prompt and the earlier turns, which "
     "vLLM's prefix cache then reuses from turn to turn (history-first), or before the whole chat (memory-first); "
     "auto (default): history-first served as text, memory-first injected"),
    ("--chain-budget", "chain_budget", int, "TOKENS",
     "the most fact tokens a user's memory chain holds (the whole memory, k all, served exactly from KV encoded "
     "jointly); beyond them, the most relevant facts are retrieved (default: 3072)"),
    ("--chain-rest-k", "chain_rest_k", int, "N",
     "facts retrieved beyond the chain's budget, served as text after it (default: 10)"),
    ("--tolerance", "tolerance", float, "FRACTION",
     "memory.mode auto: decide the calibration's kept answers within this tolerance of text, in points of its "
     "correctness measure as a fraction (0.05: 5 points; default: the calibration's own)"),
    ("--chain-repeat", "chain_repeat", int, "N",
     "the N facts most relevant to the new message repeated as text after the whole memory (k all), next to "
     "the message: still exact, a few dozen tokens prefilled (default: 0, none)"),
    ("--block-size", "block_size", int, "N", "vLLM's KV block size in tokens (default: 32)"),
    ("--dtype", "dtype", str, "float32|bfloat16|float16", "the engine's compute dtype (default: float32)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "N", "vLLM's token budget per step "
                                                                     "(default: vLLM's)"),
    ("--query-weights", "query_weights", str, "auto|int8|float32",
     "the search query's embedding network: int8 weights (ONNX Runtime on the CPU: about 2x faster per query, "
     "vectors a median 0.005 off in cosine, the same evidence recall on LoCoMo) or float32; auto (default): int8 "
     "where the embedder runs in ONNX Runtime. Facts are always embedded in float32"),
    ("--engine-url", "engine_url", str, "URL", "a `vllm serve` (loaded with the InferScale connector) to send "
                                               "composed prompts to: this server is then a gateway (default: "
                                               "vLLM in this process)"),
    ("--engine-model", "engine_model", str, "NAME", "the model name that vllm serve serves (default: --model)"),
    ("--host", "host", str, "ADDR", "address to listen on (default: 127.0.0.1)"),
    ("--port", "port", int, "N", "port to listen on (default: 8000; 0: any free port)"),
    ("--api-keys", "api_keys_file", str, "FILE", "YAML mapping API key -> tenant (default: none = open mode, "
                                                 "one tenant 'default')"),
    ("--served-model-name", "served_model_name", str, "NAME", "model name clients send (default: the folder's name)"),
    ("--w", "w", int, "N", "context-window turns (or facts, see --context) each fact is encoded after (default: 5)"),
    ("--kv-dtype", "kv_dtype", str, "DTYPE", "how new memory stores keep KV: bfloat16 (default), float32, float16, "
                                              "int8 or float8_e4m3 (per-channel scales; float8_e4m3's 3 mantissa "
                                              "bits lose the answers of models whose keys have large outlier "
                                              "channels, as Qwen2.5's: int8 keeps them at the same size)"),
    ("--context", "context", str, "turns|facts|conversation", "what each fact is encoded after: its w preceding "
                                                              "turns, the w facts added before it, rendered as served, "
                                                              "or its w turns read from one pass over the conversation "
                                                              "(default: turns)"),
    ("--max-model-len", "max_model_len", int, "N", "context length of the engine (default: 4096)"),
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
    ("--cpu-kv-cache-gib", "cpu_kv_cache_gib", int, "GIB", "vLLM CPU's KV cache size (default: 1)"),
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
    p.add_argument("--engine-probe", dest="engine_probe", action="store_true", default=d,
                   help="report the connector's pending state in /health (debugging; enables vLLM's "
                        "pickle-based IPC)")
    p.add_argument("--remember", dest="remember", action="store_true", default=d,
                   help="chats remember by default: each exchange is stored and its facts extracted in the "
                        "background (a request's memory.remember overrides)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=d,
                   help="turn vLLM's prefix cache off")
    p.add_argument("--memory-boundary", dest="memory_boundary", action="store_true", default=d,
                   help="end the memory block with an explicit boundary and instruction (computed, after the facts)")
    p.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_true", default=d,
                   help="let vLLM split long prefills over steps")
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
