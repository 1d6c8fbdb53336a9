"""What every part of the memory service shares: the catalog, the KV stores, the indexes, the
per-user locks, the text limits and the clock, with the few checks they all make.

    core = MemoryCore(config, catalog, kv, meta, limits, indexes)
    with core.writer("alice"):              # exclusive per user, across threads and processes
        store = core.store("alice")          # the user's store, for a write
    row = core.fact_row("alice", "f1", live=True)   # UnknownFactError when it is not there (or expired)

The service's parts (`reads.MemoryReads`, `writes.MemoryWrites`, `turn_edits.TurnEdits`,
`portability.Portability`, `encoding.FactEncoding`) each take a core and the parts they use,
and set up nothing of their own on it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from inferscale.common.facts import validate_id
from inferscale.common.storage.catalog import FactRow
from inferscale.common.storage.format import StoreMeta
from inferscale.common.storage.paths import user_dir
from inferscale.common.storage.protocols import CatalogBackend, FactStore, KVBackend
from inferscale.memory.limits import TextLimits
from inferscale.memory.service_types import MemoryConfig, UnknownFactError, UnknownUserError
from inferscale.retrieval.user_indexes import UserIndexes


class MemoryCore:
    def __init__(self, config: MemoryConfig, catalog: CatalogBackend, kv: KVBackend, meta: StoreMeta,
                 limits: TextLimits, indexes: UserIndexes) -> None:
        self.config, self.catalog, self.kv, self.meta, self.limits = config, catalog, kv, meta, limits
        self.root = Path(config.root)
        self.locks = catalog.locks()
        self.clock: Callable[[], float] = time.time  # what "now" is for expiry and a fact's times
        self.indexes = indexes

    def user_dir(self, user: str) -> Path:
        return user_dir(self.root, user)

    def writer(self, user: str):
        """The user's writer lock: exclusive per user, across threads and processes sharing `root`."""
        return self.locks.hold(user)

    def store(self, user: str, reader: bool = False) -> FactStore:
        """The user's store; `reader`: for reads outside the user's lock (its manifest parsed again
        only when it changed), never for a write."""
        return self.kv.open_reader(user, self.meta) if reader else self.kv.open_or_create(user, self.meta)

    @staticmethod
    def forget_kv(store: FactStore, kv_keys: list[str]) -> None:
        """Remove superseded or deleted KV from the store (rewriting shared shards)."""
        if kv_keys:
            store.delete(kv_keys)

    def check_user(self, user: str, must_exist: bool = True) -> str:
        validate_id("user", user)
        if must_exist and not self.catalog.user_exists(user):
            raise UnknownUserError(f"unknown user {user!r}")
        return user

    def fact_row(self, user: str, fact_id: str, live: bool = False) -> FactRow:
        """The fact's row (`live`: only while it has not expired), or UnknownFactError."""
        validate_id("fact", fact_id)
        row = self.catalog.fact(user, fact_id, now=self.clock() if live else None)
        if row is None:
            raise UnknownFactError(f"user {user!r} has no fact {fact_id!r}")
        return row

    def fact_rows(self, user: str, fact_ids: Sequence[str]) -> list[FactRow]:
        """The live row of each id, in order, in one catalog query."""
        for f in fact_ids:
            validate_id("fact", f)
        rows = self.catalog.facts_by_fact_ids(user, list(fact_ids), now=self.clock())
        unknown = [f for f in fact_ids if f not in rows]
        if unknown:
            raise UnknownFactError(f"user {user!r} has no fact {unknown[0]!r}")
        return [rows[f] for f in fact_ids]
