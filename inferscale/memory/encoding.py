"""How the memory service turns facts into KV: each fact encoded after its context (its window of
the conversation, the facts listed before it, or the whole conversation: `MemoryConfig.context`),
under an immutable store key, and encoded again when its context changed or its KV went missing.

    kvs = encoding.encode(facts, contexts.contexts(user, facts), incarnation, version)
    store = encoding.ensure_kv(user, rows)     # the user's store, holding the KV of `rows`

A part of `MemoryService`: the writes, the turn edits and the reads (`ensure_kv`) use it.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from inferscale.common.facts import Fact
from inferscale.common.storage.catalog import FactRow
from inferscale.common.storage.format import FactKV
from inferscale.common.storage.protocols import FactStore
from inferscale.memory.contexts import EncodingContexts, fact_of
from inferscale.memory.core import MemoryCore
from inferscale.memory.progress import reports_progress
from inferscale.memory.quotas import Usage
from inferscale.memory.service_types import KVEncoder

log = logging.getLogger("inferscale.memory")


class FactEncoding:
    def __init__(self, core: MemoryCore, encoder: KVEncoder, contexts: EncodingContexts, ledger: Usage) -> None:
        self.core, self.encoder, self.contexts, self.ledger = core, encoder, contexts, ledger
        self.stats = {"reencoded_missing": 0}  # facts whose KV was gone from the KV store and encoded again

    def encode(self, facts: Sequence[Fact], contexts, incarnation: str, version: int,
               progress: Callable[[int, int], None] | None = None) -> list[FactKV]:
        """Encode `facts`, each after its context (`EncodingContexts.contexts`); `progress(rows run,
        rows in all)` is handed to encoders that report it (the torch encoder does)."""
        config = self.core.config
        if config.context == "facts":
            encode = self.encoder.encode_listed
        elif config.context == "conversation":
            encode = self.encoder.encode_conversation
        else:
            encode = self.encoder.encode_windowed
        extra = {"progress": progress} if progress is not None and reports_progress(encode) else {}
        kvs = encode(facts, contexts, config.w, **extra)
        for f, kv in zip(facts, kvs):
            kv.fact_id = f"{f.id}~{incarnation}~{version}"  # immutable store key of this encoding
            kv.text = f.text
        return kvs

    def reencoded(self, db, user: str, version: int, rows: Sequence[FactRow], kvs: Sequence[FactKV]) -> None:
        """Point re-encoded facts at their new KV (inside the caller's transaction)."""
        catalog = self.core.catalog
        for r, kv in zip(rows, kvs, strict=True):
            catalog.set_kv_key(db, user, r.fact_id, kv.fact_id, version, self.ledger.kv_bytes(kv))
            catalog.log(db, user, r.fact_id, version, "REENCODE", None, None)

    def ensure_kv(self, user: str, rows: Sequence[FactRow]) -> FactStore:
        """The user's store, holding the KV of `rows`: a fact whose KV went missing (an evicted or
        emptied shared tier, a replica that never had the files) is encoded again from the catalog,
        under its current key, before anything reads it."""
        core = self.core
        store = core.store(user, reader=True)
        if not store.missing([r.kv_key for r in rows]):
            return store
        with core.writer(user):
            store = core.store(user)  # what is on disk now, under the lock: the put below builds on it
            current = [r for r in (core.catalog.fact(user, r.fact_id) for r in rows) if r is not None]
            gone = set(store.missing([r.kv_key for r in current]))  # again under the lock: one round trip
            lost = [r for r in current if r.kv_key in gone]
            if lost:
                log.warning("user %s: KV of %d facts is missing from %s; encoding them again",
                            user, len(lost), core.kv.describe())
                facts = [fact_of(r) for r in lost]
                kvs = self.encode(facts, self.contexts.contexts(user, facts), "", 0)
                for r, kv in zip(lost, kvs):
                    kv.fact_id = r.kv_key  # the same encoding the key was made for: same catalog state
                store.put(kvs)
                self.stats["reencoded_missing"] += len(lost)
        return store
