"""The memory API's HTTP app over test doubles, in process: the real FastAPI app (`create_app`:
routes, error handlers, middleware, gateway) over a `MemoryService` with `WindowEncoder` and
`HashEmbedder` (tests/doubles.py), and no engine. Chat requests that get past their validation
would need one; the memory routes never do.

    api = MemoryAPI(tmp_path, storage={}, quotas={...})     # storage: tests/memory/conftest.py's
    r = api.client.post("/v1/memories/alice", json={"facts": [...]})
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from doubles import HashEmbedder, WindowEncoder


class NoEngine:
    """Stands for the engine: the memory routes never use it."""

    errored = False

    def get_num_unfinished_requests(self) -> int:
        return 0


class MemoryAPI:
    def __init__(self, root: Path, storage: dict | None = None, **config) -> None:
        from fastapi.testclient import TestClient

        from inferscale.memory.service import MemoryService
        from inferscale.memory.service_types import MemoryConfig
        from inferscale.server.app import create_app
        from inferscale.server.settings import ServerConfig

        model = Path(root) / "model"
        model.mkdir(parents=True, exist_ok=True)
        (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
        self.memory = MemoryService(MemoryConfig(root=str(Path(root) / "mem"), w=2, index="exact", **(storage or {})),
                                    WindowEncoder(), HashEmbedder())
        composer = SimpleNamespace(memory=self.memory, config=SimpleNamespace(model=str(model)), calibration=None)
        config.setdefault("default_mode", "inject")
        cfg = ServerConfig(model=str(model), memory_root=str(Path(root) / "mem"), **config)
        self.app = create_app(cfg, composer, NoEngine())
        self.client = TestClient(self.app)  # no `with`: no startup hooks (they start the engine's side)

    def close(self) -> None:
        self.client.close()
        self.app.state.inferscale.gateway.close()
        self.memory.close()
