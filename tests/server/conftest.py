"""A real server on loopback for the server tests: one tiny random Llama, one memory composer and
one vLLM `AsyncLLM` for the session (starting the engine is what costs time; tests/conftest.py
keeps the files that use it on one test worker), served by uvicorn on an event loop of its own in
a background thread. A module starts the apps it needs (`live.start(...)`) on that loop; several
apps share the engine because they share the loop that drives it. Tests name their own users, so
what one module writes never meets another's."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

pytest.importorskip("vllm")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                  VLLM_CPU_KVCACHE_SPACE="1",
                  # AsyncLLM always runs the engine core (scheduler + its connector) in a process of
                  # its own; with this flag off the worker runs inside that process too, so the probe
                  # (a function sent through vLLM's IPC, which needs pickle) sees the scheduler:
                  VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_ALLOW_INSECURE_SERIALIZATION="1")


class Live:
    def __init__(self, composer, engine, stats) -> None:
        self.composer, self.engine, self.stats = composer, engine, stats
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="server-loop", daemon=True)
        self.thread.start()
        self.servers = []
        self.model_name = os.path.basename(str(composer.config.model))

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, **config) -> tuple[str, object]:
        """Serve a new app (ServerConfig `config`) over the shared engine; returns (base URL, app)."""
        import uvicorn

        from inferscale.server.app import create_app
        from inferscale.server.settings import ServerConfig

        config.setdefault("default_mode", "inject")  # the tests of auto (the default) set it themselves
        cfg = ServerConfig(model=str(self.composer.config.model), memory_root=self.composer.config.memory_root,
                           max_model_len=self.composer.config.max_model_len, w=self.composer.config.w, **config)
        app = create_app(cfg, self.composer, self.engine, self.stats)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        deadline = time.time() + 30
        while not server.started:
            if time.time() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.servers.append(server)
        return f"http://127.0.0.1:{port}", app

    def close(self) -> None:
        for s in self.servers:
            s.should_exit = True
        time.sleep(0.3)
        self.engine.shutdown(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture(scope="session")
def live(tmp_path_factory):
    from doubles import HashEmbedder
    from tiny_models import make_tiny_model

    from inferscale.server.vllm_engine import build_engine
    from inferscale.serving.memory_llm import MemoryLLMConfig
    from inferscale.serving.composer import MemoryComposer

    model = tmp_path_factory.mktemp("llama")
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
    cfg = MemoryLLMConfig(model=str(model), memory_root=str(tmp_path_factory.mktemp("mem")), w=3,
                          max_model_len=2048)
    composer = MemoryComposer(cfg, embedder=HashEmbedder())
    engine, stats = build_engine(composer, engine_probe=True)
    server = Live(composer, engine, stats)
    # what an app's startup does (this harness serves apps with lifespan off): heads:N computed in the engine
    from inferscale.server.vllm_engine import attach_engine_model

    assert server.run(attach_engine_model(engine)) == ""
    yield server
    server.close()
    composer.memory.close()
