"""KV tiers: a device tier (a preallocated page pool), a host-memory tier, and the on-disk store.

Both memory tiers are byte-budgeted LRUs keyed by (user, kv_key). KV under a key never changes
(a re-encode writes a new key), so a cached entry can never be stale. A pinned user's entries
are never evicted from the device tier; pinning more than the budget holds is refused.

Bookkeeping (LRU order, page allocation, pins, counters) is plain Python, under one lock that
`KVTiers` owns and never holds while the disk is read: a reader that loaded KV while a writer
dropped that user's keys does not put it back (each drop bumps the user's epoch), so forgotten KV
never returns to a cache. The device pool's
buffer is a preallocated numpy array on CPU; an engine on an accelerator passes its own buffer
with the same `[pages, layers, 2, page_tokens, kv_heads, head_dim]` shape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from inferscale.common.storage.format import FactKV

Key = tuple[str, str]  # (user_id, kv_key)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class HostTier:
    """LRU of fact KV (`FactKV`, or `CompactKV` as a store keeps it) under a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host tier budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.used = 0
        self.stats = TierStats()
        self._lru: OrderedDict[Key, FactKV] = OrderedDict()

    def get(self, key: Key) -> FactKV | None:
        f = self._lru.get(key)
        if f is None:
            self.stats.misses += 1
            return None
        self._lru.move_to_end(key)
        self.stats.hits += 1
        return f

    def put(self, key: Key, f: FactKV) -> None:
        size = f.nbytes
        if size > self.budget or key in self._lru:
            return
        while self.used + size > self.budget:
            _, old = self._lru.popitem(last=False)
            self.used -= old.nbytes
            self.stats.evictions += 1
        self._lru[key] = f
        self.used += size

    def drop_user(self, user: str) -> None:
        self.drop([k for k in self._lru if k[0] == user])

    def drop(self, keys) -> None:
        for key in keys:
            f = self._lru.pop(key, None)
            if f is not None:
                self.used -= f.nbytes

    def keys(self) -> list[Key]:
        return list(self._lru)


@dataclass
class _Entry:
    pages: list[int]
    n_tokens: int
    token_ids: np.ndarray
    meta: dict = field(default_factory=dict)


class DeviceTier:
    """A preallocated pool of KV pages; facts occupy whole pages; LRU eviction except pinned users."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int,
                 page_tokens: int = 16, dtype=np.float32, buffer: np.ndarray | None = None) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        page_shape = (num_layers, 2, page_tokens, num_kv_heads, head_dim)
        page_bytes = int(np.prod(page_shape)) * np.dtype(dtype).itemsize
        num_pages = budget_bytes // page_bytes
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.pool = buffer if buffer is not None else np.zeros((num_pages, *page_shape), dtype)
        if self.pool.shape[1:] != page_shape:
            raise ValueError(f"device buffer shape {self.pool.shape[1:]} != page shape {page_shape}")
        self._free = list(range(self.pool.shape[0] - 1, -1, -1))
        self._lru: OrderedDict[Key, _Entry] = OrderedDict()
        self.pinned: set[str] = set()
        self.stats = TierStats()

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    def pinned_pages(self) -> int:
        return sum(len(e.pages) for k, e in self._lru.items() if k[0] in self.pinned)

    def get(self, key: Key, fact_id: str) -> FactKV | None:
        e = self._lru.get(key)
        if e is None:
            self.stats.misses += 1
            return None
        self._lru.move_to_end(key)
        self.stats.hits += 1
        kv = self.pool[e.pages].transpose(1, 2, 0, 3, 4, 5)  # [L, 2, pages, page_tokens, H, D]
        kv = kv.reshape(kv.shape[0], 2, -1, *kv.shape[4:])[:, :, : e.n_tokens]
        return FactKV(fact_id, e.token_ids, kv[:, 0], kv[:, 1], meta=e.meta)

    def put(self, key: Key, f: FactKV) -> bool:
        """Place a fact; evicts unpinned LRU entries as needed. False if it cannot fit."""
        if key in self._lru:
            return True
        need = self.pages_for(f.num_tokens)
        while len(self._free) < need:
            victim = next((k for k in self._lru if k[0] not in self.pinned), None)
            if victim is None:
                return False
            self._free.extend(self._lru.pop(victim).pages)
            self.stats.evictions += 1
        pages = [self._free.pop() for _ in range(need)]
        pad = need * self.page_tokens - f.num_tokens
        kv = np.stack([f.k, f.v], axis=1)  # [L, 2, n, H, D]
        kv = np.pad(kv, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
        kv = kv.reshape(kv.shape[0], 2, need, self.page_tokens, *kv.shape[3:]).transpose(2, 0, 1, 3, 4, 5)
        self.pool[pages] = kv.astype(self.pool.dtype)
        self._lru[key] = _Entry(pages, f.num_tokens, f.token_ids, f.meta)
        return True

    def drop_user(self, user: str) -> None:
        self.drop([k for k in self._lru if k[0] == user])
        self.pinned.discard(user)

    def drop(self, keys) -> None:
        for key in keys:
            e = self._lru.pop(key, None)
            if e is not None:
                self._free.extend(e.pages)


class KVTiers:
    """device -> host -> disk lookup with promotion; counters per tier."""

    def __init__(self, device: DeviceTier | None, host: HostTier) -> None:
        self.device = device
        self.host = host
        self.disk_reads = 0
        self._lock = threading.Lock()
        self._epoch: dict[str, int] = {}  # per user, bumped by every drop

    def get(self, user: str, items: Sequence[tuple[str, str]],
            load: Callable[[list[str]], list[FactKV]]) -> list[FactKV]:
        """KV of (fact_id, kv_key) pairs of one user, in order; `load(kv_keys)` reads the disk
        (called without the tiers' lock, so other users' reads go on meanwhile)."""
        out: dict[str, FactKV] = {}
        missing = []
        with self._lock:
            epoch = self._epoch.get(user, 0)
            for fact_id, kv_key in items:
                key = (user, kv_key)
                f = self.device.get(key, fact_id) if self.device else None
                if f is None:
                    f = self.host.get(key)
                    if f is not None and self.device:
                        self.device.put(key, f)
                if f is None:
                    missing.append((fact_id, kv_key))
                else:
                    out[kv_key] = f
        if missing:
            loaded = load([k for _, k in missing])
            with self._lock:
                self.disk_reads += len(missing)
                cache = self._epoch.get(user, 0) == epoch  # not if the user's KV was dropped meanwhile
                for (fact_id, kv_key), f in zip(missing, loaded):
                    f.fact_id = fact_id
                    if cache:
                        self.host.put((user, kv_key), f)
                        if self.device:
                            self.device.put((user, kv_key), f)
                    out[kv_key] = f
        result = []
        for fact_id, kv_key in items:
            f = out[kv_key]
            if f.fact_id != fact_id:
                f = FactKV(fact_id, f.token_ids, f.k, f.v, f.text, f.embedding, f.source_turn, f.meta)
            result.append(f)
        return result

    def pin(self, user: str, resident_pages: int) -> None:
        if self.device is None:
            raise ValueError("no device tier configured: nothing to pin")
        with self._lock:
            total = self.device.pinned_pages() + resident_pages
            if total > self.device.pool.shape[0]:
                raise ValueError(f"pinning user {user!r} needs {total} pages, the device tier holds "
                                 f"{self.device.pool.shape[0]}")
            self.device.pinned.add(user)

    def unpin(self, user: str) -> None:
        if self.device:
            with self._lock:
                self.device.pinned.discard(user)

    def drop_user(self, user: str) -> None:
        with self._lock:
            self._epoch[user] = self._epoch.get(user, 0) + 1
            self.host.drop_user(user)
            if self.device:
                self.device.drop_user(user)

    def drop(self, user: str, kv_keys: Sequence[str]) -> None:
        """Forget these KV keys of the user in every tier (deleted or superseded KV)."""
        keys = [(user, k) for k in kv_keys]
        with self._lock:
            self._epoch[user] = self._epoch.get(user, 0) + 1
            self.host.drop(keys)
            if self.device:
                self.device.drop(keys)

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        out = {"host": vars(self.host.stats) | {"hit_rate": self.host.stats.hit_rate, "bytes": self.host.used},
               "disk_reads": self.disk_reads}
        if self.device:
            s = self.device.stats
            out["device"] = vars(s) | {"hit_rate": s.hit_rate,
                                       "bytes": (self.device.pool.shape[0] - len(self.device._free)) * self.device.page_bytes}
        return out
