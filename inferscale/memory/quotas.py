"""Per-tenant limits on what a memory holds, checked where the write commits.

    quota = Quota("team-a:", max_facts=10_000, max_kv_bytes=2 * 1024**3)
    svc.add("team-a:alice", facts=[...], quota=quota)      # QuotaExceeded names the limit

A tenant's users are the memory users whose id starts with its prefix (`"<tenant>:"`). The check
runs inside the write's transaction, after the tenant's scope lock (`Catalog.lock_scope`), against
what is committed: two writers of one tenant, on any replica, can never both pass a limit that
only one of them fits under. Facts count until they are deleted or swept (an expired fact still
holds its bytes until then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

from inferscale.common.storage.format import FactKV, StoreError, StoreMeta, stored_nbytes
from inferscale.common.storage.protocols import FactStore, Transactions, UsageRows

log = logging.getLogger("inferscale.memory")


class QuotaExceeded(Exception):
    """A write would take a tenant past one of its limits (`limit`: the setting's name)."""

    def __init__(self, limit: str, allowed: int, used: int, adding: int) -> None:
        super().__init__(f"the tenant's {limit} is {allowed}: {used} in use, and this write adds {adding}")
        self.limit, self.allowed, self.used, self.adding = limit, allowed, used, adding


@dataclass(frozen=True)
class Quota:
    scope: str  # the tenant's user-id prefix
    max_facts: int | None = None
    max_kv_bytes: int | None = None

    def check(self, used_facts: int, used_bytes: int, add_facts: int, add_bytes: int) -> None:
        if self.max_facts is not None and add_facts > 0 and used_facts + add_facts > self.max_facts:
            raise QuotaExceeded("max_facts", self.max_facts, used_facts, add_facts)
        if self.max_kv_bytes is not None and add_bytes > 0 and used_bytes + add_bytes > self.max_kv_bytes:
            raise QuotaExceeded("max_kv_bytes", self.max_kv_bytes, used_bytes, add_bytes)


class UsageCatalog(Transactions, UsageRows, Protocol):
    """What `Usage` reads and writes of the catalog."""


class Usage:
    """What a memory holds, counted in the catalog: the facts and the bytes of their stored KV, per
    tenant scope (a user-id prefix), and the quota check of a write. A part of `MemoryService`."""

    def __init__(self, catalog: UsageCatalog, meta: StoreMeta, read_store: Callable[[str], FactStore]) -> None:
        self.catalog, self.meta, self._read_store = catalog, meta, read_store

    def kv_bytes(self, kv: FactKV) -> int:
        """The bytes `kv` takes in this memory's stores (their dtype)."""
        return stored_nbytes(self.meta, kv)

    def check(self, db, quota: Quota | None, add_facts: int, add_bytes: int) -> None:
        """Inside the write's transaction: QuotaExceeded if it takes the tenant past a limit."""
        if quota is not None:
            self.catalog.lock_scope(db, quota.scope)
            quota.check(*self.catalog.usage(db, quota.scope), add_facts, add_bytes)

    def of(self, prefix: str) -> tuple[int, int]:
        """(facts, KV bytes) held by the users whose id starts with `prefix` (a tenant's)."""
        for user in self.catalog.users_uncounted(prefix):  # only catalogs from before the count have any
            self._count(user)
        with self.catalog.snapshot() as db:
            return self.catalog.usage(db, prefix)

    def _count(self, user: str) -> None:
        """Record the KV bytes of facts written before the catalog counted them (read once)."""
        uncounted = self.catalog.uncounted(user)
        if not uncounted:
            return
        try:
            kvs = self._read_store(user).get([key for _, key in uncounted])
        except StoreError as e:  # missing KV is encoded again when read, and counted then
            log.warning("user %s: cannot count the KV bytes of %d facts yet: %s", user, len(uncounted), e)
            return
        with self.catalog.transaction() as db:
            for (_, key), kv in zip(uncounted, kvs):
                self.catalog.set_kv_bytes(db, user, key, self.kv_bytes(kv))
