"""Where fact KV lives, by URL: each user's local store (the default) or the shared Redis tier.

    kv = open_kv("", root)                      # LocalKV: <root>/users/<hash>/kv (processes on one machine)
    kv = open_kv("redis://host:6379/0", root)   # RedisKV: every replica reads and writes the same KV
    store = kv.open_or_create(user, meta); store.put(kvs); kv.read(user).get_compact(keys)

Both are `protocols.KVBackend`s (`LocalKV` in `local_store`, `RedisKV` in `redis_store`) and hand
out `protocols.FactStore`s (a user's, and the model-level one holding the prompt header), keyed by
the versioned kv key the catalog holds. The memory service and the vLLM connector open stores
through this, so each reads the KV where the other wrote it.
"""

from __future__ import annotations

from pathlib import Path

from inferscale.common.storage.local_store import LocalKV
from inferscale.common.storage.protocols import KVBackend
from inferscale.common.storage.redis_store import RedisKV

__all__ = ["KVBackend", "LocalKV", "RedisKV", "open_kv", "validate_kv_url"]


def validate_kv_url(url: str, what: str = "kv_store") -> str:
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{what} must be empty (local files in the memory root) or a redis:// URL, got {url!r}")
    return url


def open_kv(url: str, root: str | Path) -> KVBackend:
    """The KV backend `url` names: "" for local files under `root`, or a redis:// URL."""
    validate_kv_url(url)
    return RedisKV(url) if url else LocalKV(root)
