"""The KV tier: fact KV kept in memory in front of the stores, as a byte-budgeted LRU.

`HostTier` is the one tier implementation: the vLLM connector keeps one in host memory and,
on an accelerator, one more in the device's memory (torch tensors) in front of it. Entries are
keyed by (owner, kv_key): owner a user id (or "<shared>" for the model-level store). KV under a
key never changes (a re-encode writes a new key), so a cached entry can never be stale; deleted
or superseded KV is dropped with `drop` / `drop_user`. Not thread-safe: its owner serialises calls.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from inferscale.common.storage.format import FactKV

Key = tuple[str, str]  # (owner: a user id or "<shared>", kv_key)


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
    """LRU of fact KV (`FactKV`, or `CompactKV` as a store keeps it; anything with `nbytes`) under a
    byte budget, with hit, miss and eviction counts (`stats`) and the bytes held (`used`).

    `put` of an entry larger than the whole budget, or of a key already held, does nothing."""

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
