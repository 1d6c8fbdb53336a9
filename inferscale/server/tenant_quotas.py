"""Quotas per tenant (`ServerConfig.quotas`, or the API-keys file): facts and KV bytes held,
requests in flight.

    limits = TenantQuotas(config.quotas)
    limits.memory_quota("team-a:alice")      # the memory service's `Quota` for a write of that user
    app.add_middleware(LimitInFlight, limits=limits, tenancy=tenancy)

Facts and KV bytes are checked by the memory service where a write commits (`memory.quotas`): an
add or import past them is refused with 413, naming the limit, and nothing of it stays. Requests in
flight are counted per tenant around every `/v1/` request (a streamed answer counts until its last
byte); one over `max_in_flight` is refused at once with 429. Other tenants never notice either.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Mapping

from inferscale.memory.quotas import Quota
from inferscale.server.auth import Tenancy
from inferscale.server.errors import APIError

log = logging.getLogger("inferscale.server")


class TenantQuotas:
    def __init__(self, quotas: Mapping[str, Mapping[str, int]]) -> None:
        self.limits = {t: dict(q) for t, q in quotas.items()}
        self.in_flight: Counter[str] = Counter()

    def of(self, tenant: str) -> dict[str, int]:
        return self.limits.get(tenant, {})

    def memory_quota(self, uid: str) -> Quota | None:
        """The limits a write to memory user `uid` ("<tenant>:<user>") is checked against."""
        tenant = Tenancy.tenant_of(uid)
        q = self.of(tenant)
        if "max_facts" not in q and "max_kv_bytes" not in q:
            return None
        return Quota(Tenancy.scope(tenant), q.get("max_facts"), q.get("max_kv_bytes"))

    def enter(self, tenant: str) -> None:
        """Count a request in; APIError 429 when the tenant already has `max_in_flight`."""
        limit = self.of(tenant).get("max_in_flight")
        if limit is not None and self.in_flight[tenant] >= limit:
            raise APIError(429, f"this tenant has {self.in_flight[tenant]} requests in flight; its max_in_flight is "
                                f"{limit}: retry when one finishes", param="max_in_flight", code="quota_exceeded",
                           headers={"Retry-After": "1"})
        self.in_flight[tenant] += 1

    def leave(self, tenant: str) -> None:
        self.in_flight[tenant] -= 1
        if self.in_flight[tenant] <= 0:
            del self.in_flight[tenant]


class LimitInFlight:
    """Pure ASGI middleware: per-tenant requests in flight on `/v1/` routes. A request whose key is
    missing or wrong passes through untouched (the route answers it with 401)."""

    def __init__(self, app, limits: TenantQuotas, tenancy) -> None:
        self.app, self.limits, self.tenancy = app, limits, tenancy

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        auth = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        try:
            tenant = self.tenancy.tenant_for(auth)
        except APIError:
            return await self.app(scope, receive, send)
        try:
            self.limits.enter(tenant)
        except APIError as e:
            return await e.response()(scope, receive, send)
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.leave(tenant)


def tenant_usage(usage_by_user: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """tenant -> (facts, KV bytes), summed over its users."""
    facts: Counter[str] = Counter()
    kv_bytes: Counter[str] = Counter()
    for uid, (n, b) in usage_by_user.items():
        facts[Tenancy.tenant_of(uid)] += n
        kv_bytes[Tenancy.tenant_of(uid)] += b
    return {t: (facts[t], kv_bytes[t]) for t in facts}


async def sweep_forever(gateway, interval_s: float) -> None:
    """Forget expired facts every `interval_s` seconds (on a write thread), until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            swept = await gateway.write(gateway.memory.sweep_expired)
        except Exception as e:  # noqa: BLE001 - the next round tries again
            log.warning("sweeping expired facts failed: %s", e)
            continue
        if swept:
            log.info("forgot %d expired facts of %d users", sum(map(len, swept.values())), len(swept))
