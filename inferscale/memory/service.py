"""The memory service: persistent per-user memory with online updates, retrieval and KV.

    svc = MemoryService(MemoryConfig(root="mem"), encoder=engine, embedder=MiniLMEmbedder())
    svc.add("alice", turns=[...], facts=[...])         # encodes KV (Context-Window Encoding)
    hits = svc.search("alice", "where does Tom live?", k=5, filters={"category": "home"})
    kv = svc.load_kv("alice", [h.fact_id for h in hits])   # read from the user's store

The service is its parts, each a file, all on one `MemoryCore` (the catalog, KV stores, indexes,
locks, limits and clock):

    reads        MemoryReads      get, list, pages, history, filtered search, the KV and plans an engine reads
    writes       MemoryWrites     add, update, delete, delete_user, sweep_expired
    turn_edits   TurnEdits        update_turn, delete_turn (the facts whose window held the turn re-encoded)
    portability  Portability      export_memory, import_memory
    encoding     FactEncoding     facts into KV, again when their context changed or their KV went missing
    ledger       quotas.Usage     facts and KV bytes per tenant, quotas checked where a write commits

The methods below hand each call to its part. Storage layout, write order (crash safety),
encoding contexts and concurrency: docs/storage.md ("The memory service"). A fact past its
`expires_at` is gone from every read at once and forgotten by `sweep_expired`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from inferscale.common.facts import Fact, Turn
from inferscale.common.pages import Page
from inferscale.common.storage.backends import open_kv
from inferscale.common.storage.catalogs import open_catalog
from inferscale.common.storage.format import FactKV
from inferscale.common.storage.paths import user_dir
from inferscale.common.storage.protocols import FactStore
from inferscale.memory.contexts import EncodingContexts
from inferscale.memory.core import MemoryCore
from inferscale.memory.crash_recovery import CrashRecovery
from inferscale.memory.encoding import FactEncoding
from inferscale.memory.limits import TextLimits
from inferscale.memory.portability import Imported, Portability
from inferscale.memory.quotas import Quota, Usage
from inferscale.memory.reads import Filters, MemoryReads
from inferscale.memory.service_types import FactPlan, KVEncoder, MemoryConfig, MemoryFact
from inferscale.memory.turn_edits import TurnEdits
from inferscale.memory.writes import UNCHANGED, MemoryWrites
from inferscale.retrieval.embedders import Embedder
from inferscale.retrieval.user_indexes import UserIndexes


class MemoryService:
    def __init__(self, config: MemoryConfig, encoder: KVEncoder, embedder: Embedder) -> None:
        self.config, self.encoder, self.embedder = config, encoder, embedder
        self.root = Path(config.root)
        (self.root / "users").mkdir(parents=True, exist_ok=True)
        self.catalog = catalog = open_catalog(config.catalog, self.root)
        self.meta = encoder.store_meta(config.w, config.context).with_dtype(config.kv_dtype)
        self.limits = TextLimits(config.max_text_chars, config.max_fact_tokens, getattr(encoder, "builder", None))
        self.kv = open_kv(config.kv_store, self.root)
        # with shared KV the index lives in memory only: a file on one replica would outlive a delete on another
        index_file = (lambda u: None) if self.kv.shared else (lambda u: user_dir(self.root, u) / "index.bin")
        self.indexes = UserIndexes(catalog, config.index, embedder.dim, index_file)
        self.core = core = MemoryCore(config, catalog, self.kv, self.meta, self.limits, self.indexes)
        self.contexts = EncodingContexts(catalog, config.w, config.context)
        self.ledger = Usage(catalog, self.meta, lambda u: core.store(u, reader=True))  # facts, bytes, quotas
        self.recovery = CrashRecovery(self.root, catalog, self.kv, core.locks, core.store)
        self.recovery.remove_orphan_dirs()
        self.encoding = FactEncoding(core, encoder, self.contexts, self.ledger)
        self.reads = MemoryReads(core, embedder, self.encoding)
        self.writes = MemoryWrites(core, self.encoding, self.contexts, self.ledger, self.recovery, embedder)
        self.turn_edits = TurnEdits(core, self.encoding, self.contexts, self.recovery)
        self.portability = Portability(core, self.reads, self.writes)

    def close(self) -> None:
        self.catalog.close()

    @property
    def clock(self) -> Callable[[], float]:
        """What "now" is for expiry and a fact's times (`time.time`; a test may set another)."""
        return self.core.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.core.clock = clock

    @property
    def stats(self) -> dict[str, int]:
        """{"reencoded_missing": facts whose KV was gone from the KV store and encoded again}"""
        return self.encoding.stats

    def store(self, user: str, reader: bool = False) -> FactStore:
        """The user's KV store (`reader`: for reads outside the user's writer lock)."""
        return self.core.store(user, reader)

    def user_dir(self, user: str) -> Path:
        """Where the user's local files live (its KV files and index, unless storage is shared)."""
        return self.core.user_dir(user)

    def writer(self, user: str):
        """The user's writer lock, for writes beside the service's own (the memory chain's links)."""
        return self.core.writer(user)

    def refusals(self, facts: Sequence[Fact] = (), turns: Sequence[Turn] = ()) -> dict[str, str]:
        """Why `add()` would refuse each of these turns and facts on its own (text, length), by
        "turn <id>" / "fact <id>"; what is not listed passes. Lets a bulk import skip and report
        what it cannot ingest instead of failing as a whole."""
        return self.limits.refusals(facts, turns)

    # -- reads (reads.py) --------------------------------------------------------------------
    def get(self, user: str, fact_id: str) -> MemoryFact:
        return self.reads.get(user, fact_id)

    def list(self, user: str, filters: Filters = None) -> list[MemoryFact]:
        """Every live fact of the user's that satisfies `filters`, in the order they were added."""
        return self.reads.list(user, filters)

    def list_page(self, user: str, limit: int = 100, cursor: str | None = None, filters: Filters = None) -> Page:
        return self.reads.list_page(user, limit, cursor, filters)

    def history(self, user: str, fact_id: str) -> list[dict]:
        return self.reads.history(user, fact_id)

    def history_page(self, user: str, fact_id: str, limit: int | None = None, cursor: str | None = None) -> Page:
        return self.reads.history_page(user, fact_id, limit, cursor)

    def version(self, user: str) -> int:
        return self.reads.version(user)

    def users(self) -> list[str]:
        return self.reads.users()

    def users_page(self, prefix: str = "", limit: int = 100, cursor: str | None = None) -> Page:
        return self.reads.users_page(prefix, limit, cursor)

    def has_turn(self, user: str, turn_id: str) -> bool:
        return self.reads.has_turn(user, turn_id)

    def search(self, user: str, query: str, k: int = 5, filters: Filters = None) -> list[MemoryFact]:
        """The user's k live facts nearest to `query` among those that satisfy `filters`, best first."""
        return self.reads.search(user, query, k, filters)

    def search_plan(self, user: str, query: str, k: int, filters: Filters = None) -> tuple[list[MemoryFact], FactPlan]:
        return self.reads.search_plan(user, query, k, filters)

    def list_plan(self, user: str, filters: Filters = None) -> tuple[list[MemoryFact], FactPlan]:
        return self.reads.list_plan(user, filters)

    def get_plan(self, user: str, fact_ids: Sequence[str]) -> tuple[list[MemoryFact], FactPlan]:
        return self.reads.get_plan(user, fact_ids)

    def load_kv(self, user: str, fact_ids: Sequence[str]) -> list[FactKV]:
        return self.reads.load_kv(user, fact_ids)

    def fact_plan(self, user: str, fact_ids: Sequence[str]) -> FactPlan:
        return self.reads.fact_plan(user, fact_ids)

    # -- writes (writes.py, turn_edits.py, portability.py) -------------------------------------
    def add(self, user: str, facts: Sequence[Fact] = (), turns: Sequence[Turn] = (),
            progress: Callable[[int, int], None] | None = None, quota: Quota | None = None,
            imported: Mapping[str, dict] | None = None, deleted_turns: Collection[str] = (),
            atomic: bool = False) -> list[str]:
        """Append turns and add facts (ids new to the user); returns the added fact ids
        (`MemoryWrites.add`: batches, `atomic`, progress, quotas)."""
        return self.writes.add(user, facts, turns, progress, quota, imported, deleted_turns, atomic)

    def update(self, user: str, fact_id: str, text: str | None = None, metadata=UNCHANGED, expires_at=UNCHANGED,
               quota: Quota | None = None) -> MemoryFact:
        return self.writes.update(user, fact_id, text, metadata, expires_at, quota)

    def delete(self, user: str, fact_id: str, keep_history: bool = False) -> None:
        self.writes.delete(user, fact_id, keep_history)

    def delete_user(self, user: str) -> None:
        self.writes.delete_user(user)

    def sweep_expired(self, keep_history: bool = False) -> dict[str, list[str]]:
        return self.writes.sweep_expired(keep_history)

    def update_turn(self, user: str, turn_id: str, text: str) -> list[str]:
        return self.turn_edits.update_turn(user, turn_id, text)

    def delete_turn(self, user: str, turn_id: str) -> list[str]:
        return self.turn_edits.delete_turn(user, turn_id)

    def export_memory(self, user: str) -> dict[str, Any]:
        return self.portability.export_memory(user)

    def import_memory(self, user: str, doc: Mapping[str, Any], quota: Quota | None = None) -> Imported:
        return self.portability.import_memory(user, doc, quota)

    # -- usage (quotas.py) -------------------------------------------------------------------
    def usage(self, prefix: str) -> tuple[int, int]:
        """(facts, KV bytes) held by the users whose id starts with `prefix` (a tenant's)."""
        return self.ledger.of(prefix)

    def usage_by_user(self) -> dict[str, tuple[int, int]]:
        """user -> (facts, KV bytes) of every user with facts (one catalog query)."""
        return self.catalog.usage_by_user()
