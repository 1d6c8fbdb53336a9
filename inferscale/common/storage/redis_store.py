"""The shared KV tier: a user's fact KV in Redis, readable by every replica.

    store = RedisStore.open_or_create(redis.Redis.from_url(url), user_prefix(user), meta)
    store.put(kvs); store.get_compact(["f3~9c1e~7"]); store.delete([...])
    kv = RedisKV("redis://host:6379/0"); kv.open_or_create(user, meta); kv.read(user)   # every user's

Same interface as the local `Store` (`protocols.FactStore`; `RedisKV` is a `protocols.KVBackend`),
same tensors per fact (`fact_tensors`: codes and scales as stored). The redis package is imported
only when a client connects (`connect`). Keys::

    inferscale:u:<user hash>:meta                       the user's StoreMeta (JSON), like a manifest
    inferscale:shared:<fingerprint>:meta, ...:<space>:...  a model's model-level store (the prompt header)
    inferscale:u:<user hash>:<space>:info               hash: kv key -> entry (tokens, text, sha256)
    inferscale:u:<user hash>:<space>:kv:<kv key>        safetensors bytes of one fact

`<user hash>` is `user_dir_name` of the memory's user id (which carries the tenant), `<space>` a
digest of the StoreMeta (model fingerprint, w, context, dtype, layout) and `<kv key>` carries the
fact id, the user's incarnation and the memory version of the fact's last change: KV of an updated
or deleted fact, of another model or another w, can never be read under a current key.

Fact KV is derived data. A fact whose bytes are gone (Redis evicted them under `maxmemory`) is not
`in` the store and reading it raises `UnknownFactError`; the memory service encodes it again from
the catalog. Bytes are checked against the sha256 recorded at `put` on every read. Writes of one
`put` or `delete` are one MULTI/EXEC transaction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from inferscale.common.storage.format import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    ChecksumError,
    CompactKV,
    FactKV,
    FormatVersionError,
    StoreError,
    StoreMeta,
    UnknownFactError,
    check_put,
    compact_from,
    fact_entry,
    fact_from,
    fact_tensors,
)
from inferscale.common.storage.paths import user_dir_name

PREFIX = "inferscale:u:"
SHARED_PREFIX = "inferscale:shared:"  # model-level KV (the prompt header), not any user's


def space_of(meta: StoreMeta) -> str:
    """A short digest naming everything a store's KV is valid for."""
    return hashlib.sha256(json.dumps(asdict(meta), sort_keys=True).encode()).hexdigest()[:16]


def user_prefix(user: str) -> str:
    """The key prefix of `user`'s KV."""
    return f"{PREFIX}{user_dir_name(user)}:"


def shared_prefix(fingerprint: str) -> str:
    """The key prefix of a model's model-level store (one per model fingerprint)."""
    return f"{SHARED_PREFIX}{fingerprint[:24]}:"


class RedisStore:
    def __init__(self, client, prefix: str, meta: StoreMeta) -> None:
        self.client = client
        self.meta = meta
        self._ns = f"{prefix}{space_of(meta)}:"
        self.path = f"redis {prefix}"  # for messages, like `Store.path`

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def open(cls, client, prefix: str, expect: StoreMeta | None = None, any_dtype: bool = False) -> "RedisStore":
        """The store under `prefix` (`user_prefix`, `shared_prefix`); FileNotFoundError when none.
        `expect` and `any_dtype` as in `Store.open`."""
        raw = client.get(prefix + "meta")
        if raw is None:
            raise FileNotFoundError(f"no KV under {prefix} in the shared tier")
        meta_d = json.loads(raw)
        if meta_d.get("format_version") not in READABLE_VERSIONS:
            raise FormatVersionError(f"shared-tier KV under {prefix} has format version "
                                     f"{meta_d.get('format_version')!r}")
        meta = StoreMeta(**meta_d)
        if expect is not None:
            meta.check_compatible(expect, any_dtype)
        return cls(client, prefix, meta)

    @classmethod
    def open_or_create(cls, client, prefix: str, meta: StoreMeta) -> "RedisStore":
        client.set(prefix + "meta", json.dumps(asdict(meta)), nx=True)  # the first writer's meta
        return cls.open(client, prefix, expect=meta, any_dtype=True)  # keeps its dtype, as Store does

    def refresh(self) -> None:
        """Nothing to reload: every call reads Redis."""

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, fact_id: str) -> bool:
        return bool(self.client.exists(self._ns + "kv:" + fact_id))

    def __len__(self) -> int:
        return int(self.client.hlen(self._ns + "info"))

    def fact_ids(self) -> list[str]:
        return sorted(k.decode() if isinstance(k, bytes) else k for k in self.client.hkeys(self._ns + "info"))

    def info(self, fact_id: str) -> dict:
        raw = self.client.hget(self._ns + "info", fact_id)
        if raw is None:
            raise UnknownFactError(f"{self.path} has no fact {fact_id!r}")
        return json.loads(raw)

    def missing(self, fact_ids: list[str]) -> list[str]:
        """The ids among `fact_ids` whose KV bytes are not in Redis (never written, or evicted)."""
        pipe = self.client.pipeline(transaction=False)
        for fid in fact_ids:
            pipe.exists(self._ns + "kv:" + fid)
        return [fid for fid, there in zip(fact_ids, pipe.execute()) if not there]

    # -- writing ---------------------------------------------------------------------------
    def put(self, facts: list[FactKV]) -> list[str]:
        check_put(self.meta, facts)
        pipe = self.client.pipeline(transaction=True)
        for f in facts:
            data = st_save(fact_tensors(self.meta, f), metadata={"format_version": str(FORMAT_VERSION)})
            entry = {**fact_entry(f), "sha256": hashlib.sha256(data).hexdigest()}
            pipe.set(self._ns + "kv:" + f.fact_id, data)
            pipe.hset(self._ns + "info", f.fact_id, json.dumps(entry))
        pipe.execute()
        return []

    def delete(self, fact_ids: list[str]) -> None:
        known = set(self.fact_ids())
        unknown = [f for f in fact_ids if f not in known]
        if unknown:
            raise UnknownFactError(f"{self.path} has no fact {unknown[0]!r}")
        pipe = self.client.pipeline(transaction=True)
        for fid in fact_ids:
            pipe.delete(self._ns + "kv:" + fid)
            pipe.hdel(self._ns + "info", fid)
        pipe.execute()

    def discard_uncommitted(self) -> list[str]:
        """Nothing to remove: every `put` and `delete` is one MULTI/EXEC transaction."""
        return []

    def verify(self) -> list[str]:
        """Check every fact's bytes against the sha256 written with them; the problems found (a fact
        whose bytes are gone is one: it will be encoded again when it is next needed)."""
        problems = []
        for fid in self.fact_ids():
            try:
                self._tensors([fid])
            except StoreError as e:
                problems.append(str(e))
        return problems

    # -- reading ---------------------------------------------------------------------------
    def _tensors(self, fact_ids: list[str]) -> list[tuple[dict[str, np.ndarray], dict]]:
        if not fact_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self._ns + "info", fact_ids)
        pipe.mget([self._ns + "kv:" + f for f in fact_ids])
        infos, blobs = pipe.execute()
        out = []
        for fid, raw, data in zip(fact_ids, infos, blobs):
            if raw is None or data is None:
                raise UnknownFactError(f"{self.path} has no KV for fact {fid!r}")
            entry = json.loads(raw)
            got = hashlib.sha256(data).hexdigest()
            if got != entry["sha256"]:
                raise ChecksumError(f"{self.path}: KV of fact {fid!r} is corrupted: sha256 {got[:16]}... != "
                                    f"written {entry['sha256'][:16]}...")
            out.append((st_load(data), entry))
        return out

    def get_compact(self, fact_ids: list[str]) -> list[CompactKV]:
        return [compact_from(self.meta, fid, t) for fid, (t, _) in zip(fact_ids, self._tensors(fact_ids))]

    def get(self, fact_ids: list[str]) -> list[FactKV]:
        return [fact_from(self.meta, fid, t, e) for fid, (t, e) in zip(fact_ids, self._tensors(fact_ids))]


def delete_user(client, user: str) -> int:
    """Remove every key of `user` (every space, the meta). Returns how many went."""
    n = 0
    for key in client.scan_iter(match=user_prefix(user) + "*", count=1000):
        n += client.delete(key)
    return n


def connect(url: str):
    """A Redis client for `url` (redis://, rediss:// or unix://), checked with a PING."""
    try:
        import redis
    except ImportError as e:  # pragma: no cover - installed with the `scale` extra
        raise StoreError("a redis:// KV store needs the redis client (pip install 'inferscale[scale]')") from e
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as e:
        raise StoreError(f"cannot reach the shared KV tier at {url.split('@')[-1]}: {e}") from e
    return client


class RedisKV:
    """Every user's KV in one Redis (the tier shared by replicas; a `protocols.KVBackend`)."""

    shared = True

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = connect(url)

    def open(self, user: str, expect: StoreMeta | None = None) -> RedisStore:
        return RedisStore.open(self.client, user_prefix(user), expect)

    def open_or_create(self, user: str, meta: StoreMeta) -> RedisStore:
        return RedisStore.open_or_create(self.client, user_prefix(user), meta)

    def open_reader(self, user: str, meta: StoreMeta) -> RedisStore:
        """As `open_or_create`: a Redis store reads the server on every query, there is nothing to cache."""
        return self.open_or_create(user, meta)

    def read(self, user: str) -> RedisStore:
        """As `open`: FileNotFoundError when the user has no KV; nothing to cache, nothing created."""
        return self.open(user)

    def open_shared(self, fingerprint: str, expect: StoreMeta | None = None) -> RedisStore:
        return RedisStore.open(self.client, shared_prefix(fingerprint), expect)

    def open_or_create_shared(self, meta: StoreMeta) -> RedisStore:
        return RedisStore.open_or_create(self.client, shared_prefix(meta.model_fingerprint), meta)

    def read_shared(self, fingerprint: str) -> RedisStore:
        """As `open_shared`."""
        return self.open_shared(fingerprint)

    def delete_user(self, user: str) -> None:
        delete_user(self.client, user)

    def describe(self) -> str:
        return f"redis {self.url.split('@')[-1]}"
