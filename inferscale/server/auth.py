"""API keys -> tenants, and tenant-scoped user ids.

A request names its key as `Authorization: Bearer KEY`; the key decides the tenant. Every user a
request names (the chat `user` field, `/v1/memories/{user}`) is the tenant's own: the memory holds
it as `"<tenant>:<user>"`, so no spelling of a user id can reach another tenant's memory (another
tenant's user simply does not exist for this key: 404). Tenant names cannot contain ':', so the
mapping is one-to-one.

Open mode (no keys configured): every request belongs to the tenant "default" and the header is
not read. A memory written with `inferscale memory --root DIR add default:alice ...` is the
server's user "alice" in open mode.
"""

from __future__ import annotations

import hmac
from typing import Mapping

from fastapi import Request

from inferscale.common.facts import validate_id
from inferscale.server.errors import APIError, bad_request
from inferscale.server.settings import OPEN_TENANT, validate_tenant

MAX_ID = 128  # the memory service's id limit


class Tenancy:
    def __init__(self, api_keys: Mapping[str, str] | None = None) -> None:
        self._keys = [(k.encode(), validate_tenant(t)) for k, t in (api_keys or {}).items()]

    @property
    def open_mode(self) -> bool:
        return not self._keys

    def tenant_for(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` header value; 401 when missing or unknown."""
        if self.open_mode:
            return OPEN_TENANT
        if not authorization:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        found = None
        for key, tenant in self._keys:  # compare against every key: time does not depend on which matched
            if hmac.compare_digest(key, token.encode()):
                found = tenant
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return found

    @staticmethod
    def internal_user(tenant: str, user: str, param: str = "user") -> str:
        """The memory's id of a tenant's user (400 if the id is not a valid user id)."""
        try:
            validate_id("user", user)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        uid = Tenancy.scope(tenant) + user
        if len(uid) > MAX_ID:
            raise bad_request(f"user id {user!r} is too long: at most {MAX_ID - len(tenant) - 1} characters "
                              "for this tenant", param)
        return uid

    @staticmethod
    def public_user(tenant: str, uid: str) -> str | None:
        """The tenant's name of a memory user id, or None if it belongs to another tenant."""
        prefix = Tenancy.scope(tenant)
        return uid[len(prefix):] if uid.startswith(prefix) else None

    @staticmethod
    def scope(tenant: str) -> str:
        """The prefix of every memory user id of `tenant`."""
        return f"{tenant}:"

    @staticmethod
    def tenant_of(uid: str) -> str:
        """The tenant a memory user id belongs to."""
        return uid.split(":", 1)[0]


def tenant_of(request: Request) -> str:
    """FastAPI dependency: the request's tenant (401 if its key is missing or invalid)."""
    tenancy: Tenancy = request.app.state.inferscale.tenancy
    return tenancy.tenant_for(request.headers.get("authorization"))
