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

from dataclasses import dataclass


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
