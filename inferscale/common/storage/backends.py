"""Where fact KV lives: each user's local store (the default) or the shared Redis tier.

    kv = open_kv("", root)                      # LocalKV: <root>/users/<hash>/kv (processes on one machine)
    kv = open_kv("redis://host:6379/0", root)   # RedisKV: every replica reads and writes the same KV
    store = kv.open_or_create(user, meta); store.put(kvs); kv.open(user).get_compact(keys)

Both hand out stores (a user's, and the model-level one holding the prompt header) with one
interface (`Store`, `RedisStore`): put / get / get_compact / delete / info / `in` / `missing` /
verify, keyed by the versioned kv key the catalog holds. The memory service and the vLLM connector
open stores through this, so each reads the KV where the other wrote it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from inferscale.common.storage.format import StoreMeta
from inferscale.common.storage.local_store import ManifestCache, Store
from inferscale.common.storage.paths import shared_store_dir, user_store_dir


class LocalKV:
    """Each user's KV in a store directory under the memory root."""

    shared = False

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._readers = ManifestCache()

    def open(self, user: str, expect: StoreMeta | None = None) -> Store:
        """The user's store; FileNotFoundError when the user has none."""
        return Store.open(user_store_dir(self.root, user), expect=expect)

    def open_or_create(self, user: str, meta: StoreMeta) -> Store:
        return Store.open_or_create(user_store_dir(self.root, user), meta)

    def open_reader(self, user: str, meta: StoreMeta) -> Store:
        """The user's store for reading (created when missing): its manifest is parsed again only
        when a commit changed it (`ManifestCache`), so a request does not re-read it. Writers use
        `open_or_create` under the user's lock."""
        path = user_store_dir(self.root, user)
        try:
            return self._readers.open(path, expect=meta, any_dtype=True)
        except FileNotFoundError:  # a user with no KV yet
            return Store.open_or_create(path, meta)

    def open_shared(self, fingerprint: str, expect: StoreMeta | None = None) -> Store:
        """The model-level store (the prompt header's KV; one model per memory root)."""
        return Store.open(shared_store_dir(self.root), expect=expect)

    def open_or_create_shared(self, meta: StoreMeta) -> Store:
        return Store.open_or_create(shared_store_dir(self.root), meta)

    def delete_user(self, user: str) -> None:
        shutil.rmtree(user_store_dir(self.root, user), ignore_errors=True)

    def describe(self) -> str:
        return "local files"


class RedisKV:
    """Every user's KV in one Redis (the tier shared by replicas)."""

    shared = True

    def __init__(self, url: str) -> None:
        from inferscale.common.storage.redis_store import connect

        self.url = url
        self.client = connect(url)

    def open(self, user: str, expect: StoreMeta | None = None):
        from inferscale.common.storage.redis_store import RedisStore, user_prefix

        return RedisStore.open(self.client, user_prefix(user), expect)

    def open_or_create(self, user: str, meta: StoreMeta):
        from inferscale.common.storage.redis_store import RedisStore, user_prefix

        return RedisStore.open_or_create(self.client, user_prefix(user), meta)

    def open_reader(self, user: str, meta: StoreMeta):
        """As `open_or_create`: a Redis store reads the server on every query, there is nothing to cache."""
        return self.open_or_create(user, meta)

    def open_shared(self, fingerprint: str, expect: StoreMeta | None = None):
        from inferscale.common.storage.redis_store import RedisStore, shared_prefix

        return RedisStore.open(self.client, shared_prefix(fingerprint), expect)

    def open_or_create_shared(self, meta: StoreMeta):
        from inferscale.common.storage.redis_store import RedisStore, shared_prefix

        return RedisStore.open_or_create(self.client, shared_prefix(meta.model_fingerprint), meta)

    def delete_user(self, user: str) -> None:
        from inferscale.common.storage.redis_store import delete_user

        delete_user(self.client, user)

    def describe(self) -> str:
        return f"redis {self.url.split('@')[-1]}"


def validate_kv_url(url: str, what: str = "kv_store") -> str:
    if url and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{what} must be empty (local files in the memory root) or a redis:// URL, got {url!r}")
    return url


def open_kv(url: str, root: str | Path) -> LocalKV | RedisKV:
    """The KV backend `url` names: "" for local files under `root`, or a redis:// URL."""
    validate_kv_url(url)
    return RedisKV(url) if url else LocalKV(root)
