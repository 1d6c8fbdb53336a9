"""The stores a memory plan names, opened for reading and checked against the served model.

Both halves of the connector use it: the scheduler to check a plan's tokens against the stores,
the worker to read the KV it injects. The stores come from the memory root's KV backend (local
files, or the Redis tier every replica shares: `common.storage.backends.open_kv`), opened through
its read path (`KVBackend.read`: an unchanged manifest is not parsed again).

    stores = PlanStores(open_kv(cfg.kv_store, cfg.memory_root), spec, fingerprint)
    store = stores.checked(plan, "user")     # PlanError: no such store, or one of another model
"""

from __future__ import annotations

from inferscale.common.prompt.plan import MemoryPlan, PlanError
from inferscale.common.model.spec import ModelSpec
from inferscale.common.storage.format import StoreError
from inferscale.common.storage.protocols import FactStore, KVBackend

SHARED = "<shared>"  # the owner name of the model-level store (the prompt header's KV)


class PlanStores:
    def __init__(self, kv: KVBackend, spec: ModelSpec, fingerprint: str) -> None:
        self.kv, self.spec, self.fingerprint = kv, spec, fingerprint

    def open(self, owner: str) -> FactStore:
        """The store of `owner` (a user id, or `SHARED`); FileNotFoundError when it has none."""
        if owner == SHARED:
            return self.kv.read_shared(self.fingerprint)
        return self.kv.read(owner)

    def checked(self, plan: MemoryPlan, which: str) -> FactStore:
        """The plan's `which` store ("user" or "shared"), written for this model, else PlanError."""
        try:
            store = self.open(plan.user if which == "user" else SHARED)
        except FileNotFoundError:
            raise PlanError(f"no {which} store for user {plan.user!r}") from None
        try:
            store.meta.check_model(self.spec, self.fingerprint)
        except StoreError as e:
            raise PlanError(f"{which} store of user {plan.user!r}: {e}") from None
        return store
