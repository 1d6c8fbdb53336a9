"""The memory service: persistent per-user memory with online updates, retrieval and KV.

    svc = MemoryService(MemoryConfig(root="mem"), encoder=engine, embedder=MiniLMEmbedder())
    svc.add("alice", turns=[...], facts=[...])         # encodes KV (Context-Window Encoding)
    hits = svc.search("alice", "where does Tom live?", k=5)
    kv = svc.load_kv("alice", [h.fact_id for h in hits])   # read from the user's store

Storage layout, write order (crash safety), encoding contexts and concurrency: docs/storage.md
("The memory service").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from inferscale.common.facts import Fact, Turn, validate_id
from inferscale.common.storage.backends import open_kv
from inferscale.common.storage.catalog import FactRow, new_incarnation
from inferscale.common.storage.catalogs import open_catalog
from inferscale.common.storage.format import FactKV, StoreError
from inferscale.common.storage.paths import user_dir
from inferscale.common.storage.protocols import CatalogBackend, FactStore, KVBackend
from inferscale.memory.contexts import EncodingContexts, fact_of
from inferscale.memory.crash_recovery import CrashRecovery
from inferscale.memory.limits import TextLimits
from inferscale.memory.progress import Heartbeat, reports_progress
from inferscale.memory.turn_edits import TurnEdits
from inferscale.memory.service_types import (
    AddInterrupted,
    FactPlan,
    KVEncoder,
    MemoryConfig,
    MemoryFact,
    UnknownFactError,
    UnknownUserError,
    _public,
)
from inferscale.retrieval.embedders import Embedder, embed_query
from inferscale.retrieval.user_indexes import UserIndexes

log = logging.getLogger("inferscale.memory")


class MemoryService(TurnEdits):
    PROGRESS_EVERY_S = 3.0  # how often a long add reports while a batch encodes

    def __init__(self, config: MemoryConfig, encoder: KVEncoder, embedder: Embedder) -> None:
        self.config = config
        self.encoder = encoder
        self.embedder = embedder
        self.root = Path(config.root)
        (self.root / "users").mkdir(parents=True, exist_ok=True)
        self.catalog: CatalogBackend = open_catalog(config.catalog, self.root)
        self.meta = encoder.store_meta(config.w, config.context).with_dtype(config.kv_dtype)
        self.limits = TextLimits(config.max_text_chars, config.max_fact_tokens, getattr(encoder, "builder", None))
        self._locks = self.catalog.locks()
        self.kv: KVBackend = open_kv(config.kv_store, self.root)
        # with shared KV the index lives in memory only: a file on one replica would outlive a delete on another
        index_file = (lambda u: None) if self.kv.shared else (lambda u: self._user_dir(u) / "index.bin")
        self.indexes = UserIndexes(self.catalog, config.index, embedder.dim, index_file)
        self.contexts = EncodingContexts(self.catalog, config.w, config.context)
        self.stats = {"reencoded_missing": 0}  # facts whose KV was gone from the KV store and encoded again
        self.recovery = CrashRecovery(self.root, self.catalog, self.kv, self._locks, self._store)
        self.recovery.remove_orphan_dirs()

    def close(self) -> None:
        self.catalog.close()

    # -- paths, locks, recovery --------------------------------------------------------------
    def _user_dir(self, user: str) -> Path:
        return user_dir(self.root, user)

    def _writer(self, user: str):
        """Exclusive per user, across threads and processes sharing `root`."""
        return self._locks.hold(user)

    def _store(self, user: str, reader: bool = False) -> FactStore:
        """The user's store; `reader`: for reads outside the user's lock (its manifest parsed again
        only when it changed), never for a write."""
        return self.kv.open_reader(user, self.meta) if reader else self.kv.open_or_create(user, self.meta)

    def _forget_kv(self, store: FactStore, kv_keys: list[str]) -> None:
        """Remove superseded or deleted KV from the store (rewriting shared shards)."""
        if kv_keys:
            store.delete(kv_keys)

    # -- validation --------------------------------------------------------------------------
    def _check_user(self, user: str, must_exist: bool = True) -> str:
        validate_id("user", user)
        if must_exist and not self.catalog.user_exists(user):
            raise UnknownUserError(f"unknown user {user!r}")
        return user

    def refusals(self, facts: Sequence[Fact] = (), turns: Sequence[Turn] = ()) -> dict[str, str]:
        """Why `add()` would refuse each of these turns and facts on its own (text, length), by
        "turn <id>" / "fact <id>"; what is not listed passes. Lets a bulk import skip and report
        what it cannot ingest instead of failing as a whole."""
        return self.limits.refusals(facts, turns)

    def _fact_row(self, user: str, fact_id: str) -> FactRow:
        validate_id("fact", fact_id)
        row = self.catalog.fact(user, fact_id)
        if row is None:
            raise UnknownFactError(f"user {user!r} has no fact {fact_id!r}")
        return row

    def _fact_rows(self, user: str, fact_ids: Sequence[str]) -> list[FactRow]:
        """`_fact_row` of each id, in order, in one catalog query."""
        for f in fact_ids:
            validate_id("fact", f)
        rows = self.catalog.facts_by_fact_ids(user, list(fact_ids))
        unknown = [f for f in fact_ids if f not in rows]
        if unknown:
            raise UnknownFactError(f"user {user!r} has no fact {unknown[0]!r}")
        return [rows[f] for f in fact_ids]

    # -- encoding ----------------------------------------------------------------------------
    def _encode(self, facts: Sequence[Fact], contexts, incarnation: str, version: int,
                progress: Callable[[int, int], None] | None = None) -> list[FactKV]:
        """Encode `facts`, each after its context (`EncodingContexts.contexts`); `progress(rows run,
        rows in all)` is handed to encoders that report it (the torch encoder does)."""
        if self.config.context == "facts":
            encode = self.encoder.encode_listed
        elif self.config.context == "conversation":
            encode = self.encoder.encode_conversation
        else:
            encode = self.encoder.encode_windowed
        extra = {"progress": progress} if progress is not None and reports_progress(encode) else {}
        kvs = encode(facts, contexts, self.config.w, **extra)
        for f, kv in zip(facts, kvs):
            kv.fact_id = f"{f.id}~{incarnation}~{version}"  # immutable store key of this encoding
            kv.text = f.text
        return kvs

    # -- writes ------------------------------------------------------------------------------
    def add(self, user: str, facts: Sequence[Fact] = (), turns: Sequence[Turn] = (),
            progress: Callable[[int, int], None] | None = None) -> list[str]:
        """Append turns and add facts (ids new to the user); returns the added fact ids.

        Everything is validated before anything is written. The facts are then encoded and committed
        in batches of `ingest_batch` (the turns with the first), so memory stays bounded and readers
        see the memory grow; if a later batch fails, `AddInterrupted.added` names what committed.
        `progress(facts encoded, facts in all)` is called after each batch commits, and while a batch
        is encoded every `PROGRESS_EVERY_S` seconds or so (its facts counted by the share of the
        encoder's rows run)."""
        self._check_user(user, must_exist=False)
        facts, turns = list(facts), list(turns)
        if not facts and not turns:
            raise ValueError("add() needs facts or turns")
        for t in turns:
            self.limits.check_turn(t)
        for f in facts:
            self.limits.check_fact(f)
        with self._writer(user):
            self.recovery.recover(user)
            known = {r.turn_id for r in self.catalog.turns(user, include_deleted=True)}
            new_turns = set()
            for t in turns:
                if t.id in known or t.id in new_turns:
                    raise ValueError(f"user {user!r} already has turn {t.id!r}")
                new_turns.add(t.id)
            seen = set()
            for f in facts:
                if f.id in seen or self.catalog.fact(user, f.id) is not None:
                    raise ValueError(f"user {user!r} already has fact {f.id!r}; use update()")
                seen.add(f.id)
                if f.source_turn is not None and f.source_turn not in known | new_turns:
                    raise ValueError(f"fact {f.id!r} names unknown turn {f.source_turn!r}")
            incarnation = self.catalog.incarnation(user) or new_incarnation()
            step = self.config.ingest_batch
            batches = [facts[i : i + step] for i in range(0, len(facts), step)] or [[]]
            added: list[str] = []
            for b, batch in enumerate(batches):
                rows = None
                if progress is not None:
                    rows = Heartbeat(lambda frac, done=len(added), n=len(batch): progress(
                        done + int(frac * n), len(facts)), self.PROGRESS_EVERY_S)
                try:
                    self._add_batch(user, incarnation, batch, turns if b == 0 else (), rows)
                except Exception as e:
                    if added:
                        raise AddInterrupted(added, e) from e
                    raise
                added += [f.id for f in batch]
                if progress is not None:
                    progress(len(added), len(facts))
            return added

    def _add_batch(self, user: str, incarnation: str, facts: list[Fact], turns: Sequence[Turn],
                   progress: Callable[[int, int], None] | None = None) -> None:
        version = self.catalog.version(user) + 1
        kvs = embs = None
        if facts:
            kvs = self._encode(facts, self.contexts.contexts(user, facts, turns, facts), incarnation, version,
                               progress)
            embs = self.embedder.embed([f.text for f in facts])
            self._store(user).put(kvs)
        with self.catalog.transaction() as db:
            self.catalog.ensure_user(db, user, incarnation)
            seq = self.catalog.next_seq(db, user)
            for i, t in enumerate(turns):
                self.catalog.insert_turn(db, user, seq + i, t)
            v = self.catalog.bump_version(db, user)
            for f, kv, e in zip(facts, kvs or (), embs if embs is not None else ()):
                self.catalog.insert_fact(db, user, f, kv.fact_id, e, v)
                self.catalog.log(db, user, f.id, v, "ADD", None, f.text)
        rows = [self.catalog.fact(user, f.id) for f in facts]
        self.indexes.apply(user, v, [r.id for r in rows], embs)

    def update(self, user: str, fact_id: str, text: str) -> MemoryFact:
        """Change a fact's text: re-embeds and re-encodes it (same context), and under context
        "facts" the facts whose context held its old text."""
        self._check_user(user)
        with self._writer(user):
            self.recovery.recover(user)
            row = self._fact_row(user, fact_id)
            fact = Fact(fact_id, text, row.source_turn, row.date)
            self.limits.check_fact(fact)
            version = self.catalog.version(user) + 1
            after = self.contexts.listed_after(user, fact_id)
            todo = [fact] + [fact_of(r) for r in after]
            contexts = self.contexts.contexts(user, todo, fact_edits={fact_id: text})
            kv, *dep_kvs = self._encode(todo, contexts, self.catalog.incarnation(user), version)
            emb = self.embedder.embed([text])[0]
            store = self._store(user)
            store.put([kv, *dep_kvs])
            with self.catalog.transaction() as db:
                v = self.catalog.bump_version(db, user)
                self.catalog.update_fact(db, user, fact_id, text, kv.fact_id, emb, v)
                self.catalog.log(db, user, fact_id, v, "UPDATE", row.text, text)
                self._reencoded(db, user, v, after, dep_kvs)
            self._forget_kv(store, [row.kv_key] + [r.kv_key for r in after])
            self.indexes.apply(user, v, [row.id], emb[None])
            return _public(self.catalog.fact(user, fact_id))

    def delete(self, user: str, fact_id: str, keep_history: bool = False) -> None:
        """Forget a fact: its row, embedding, KV (shards it shared are rewritten) and, unless
        `keep_history`, the texts of its history (the events stay, without text)."""
        self._check_user(user)
        with self._writer(user):
            self.recovery.recover(user)
            row = self._fact_row(user, fact_id)
            after = self.contexts.listed_after(user, fact_id)  # their KV saw the text being forgotten
            facts = [fact_of(r) for r in after]
            store = self._store(user)
            dep_kvs = (self._encode(facts, self.contexts.contexts(user, facts, fact_edits={fact_id: None}),
                                    self.catalog.incarnation(user), self.catalog.version(user) + 1) if after else [])
            if dep_kvs:
                store.put(dep_kvs)
            with self.catalog.transaction() as db:
                v = self.catalog.bump_version(db, user)
                self.catalog.delete_fact(db, user, fact_id)
                if keep_history:
                    self.catalog.log(db, user, fact_id, v, "DELETE", row.text, None)
                else:
                    self.catalog.forget_history(db, user, fact_id)
                    self.catalog.log(db, user, fact_id, v, "DELETE", None, None)
                self._reencoded(db, user, v, after, dep_kvs)
            self._forget_kv(store, [row.kv_key] + [r.kv_key for r in after])
            self.indexes.apply(user, v, remove_ids=[row.id])
            self.catalog.checkpoint()

    def delete_user(self, user: str) -> None:
        """Purge a user: rows (turns, facts, embeddings, history), index, every byte of KV, caches.

        The rows go first (one transaction), then the files. A crash in between leaves files that
        no user owns: they are removed on the next open, and repeating delete_user finishes it."""
        validate_id("user", user)
        with self._writer(user):
            udir = self._user_dir(user)
            exists = self.catalog.user_exists(user)
            if not exists and not udir.exists():
                raise UnknownUserError(f"unknown user {user!r}")
            if exists:
                with self.catalog.transaction() as db:
                    self.catalog.delete_user(db, user)
                self.catalog.purge_user_storage()
            self.catalog.checkpoint()
            self.recovery.purge_dir(udir)
            self.kv.delete_user(user)
            self.indexes.forget(user)
            self.recovery.forget(user)

    # -- reads (never wait for a writer) -----------------------------------------------------
    def get(self, user: str, fact_id: str) -> MemoryFact:
        self._check_user(user)
        return _public(self._fact_row(user, fact_id))

    def list(self, user: str) -> list[MemoryFact]:
        self._check_user(user)
        return [_public(r) for r in self.catalog.facts(user)]

    def history(self, user: str, fact_id: str) -> list[dict]:
        self._check_user(user)
        validate_id("fact", fact_id)
        events = self.catalog.history(user, fact_id)
        if not events:
            raise UnknownFactError(f"user {user!r} has no fact {fact_id!r}, now or before")
        return events

    def version(self, user: str) -> int:
        self._check_user(user)
        return self.catalog.version(user)

    def users(self) -> list[str]:
        """Every user with a memory."""
        return self.catalog.users()

    def has_turn(self, user: str, turn_id: str) -> bool:
        """Whether `user` (who must exist) has turn `turn_id` with its text."""
        self._check_user(user)
        row = self.catalog.turn(user, turn_id)
        return row is not None and row.text is not None

    def search(self, user: str, query: str, k: int = 5) -> list[MemoryFact]:
        """The user's k facts nearest to `query` (cosine), best first."""
        self._check_user(user)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the search query is empty")
        self.limits.check_text(query, "the search query")
        q = embed_query(self.embedder, query)
        scores, ids = self.indexes.search(user, q, k)
        hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        rows = self.catalog.facts_by_index_ids(user, [i for i, _ in hits])  # scoped to this user
        return [_public(rows[i], s) for i, s in hits if i in rows]

    def load_kv(self, user: str, fact_ids: Sequence[str]) -> list[FactKV]:
        """Current KV of the user's facts, read from their store, in order (named by fact id);
        refuses unknown ids."""
        self._check_user(user)

        def read() -> list[FactKV]:
            with self.catalog.snapshot():
                rows = self._fact_rows(user, fact_ids)
            kvs = self._ensure_kv(user, rows).get([r.kv_key for r in rows])
            for r, kv in zip(rows, kvs):
                kv.fact_id = r.fact_id
            return kvs

        return self._despite_writers(read)

    def fact_plan(self, user: str, fact_ids: Sequence[str]) -> FactPlan:
        """Version, incarnation and (fact_id, kv_key, token ids) of these facts, from one snapshot."""
        self._check_user(user)

        def read() -> FactPlan:
            with self.catalog.snapshot():
                version = self.catalog.version(user)
                incarnation = self.catalog.incarnation(user)
                rows = self._fact_rows(user, fact_ids)
            if incarnation is None:
                raise UnknownUserError(f"unknown user {user!r}")
            store = self._ensure_kv(user, rows)
            return FactPlan(version, incarnation, [(r.fact_id, r.kv_key, store.info(r.kv_key)["tokens"]) for r in rows])

        return self._despite_writers(read)

    def _ensure_kv(self, user: str, rows: Sequence[FactRow]) -> FactStore:
        """The user's store, holding the KV of `rows`: a fact whose KV went missing (an evicted or
        emptied shared tier, a replica that never had the files) is encoded again from the catalog,
        under its current key, before anything reads it."""
        store = self._store(user, reader=True)
        if not store.missing([r.kv_key for r in rows]):
            return store
        with self._writer(user):
            store = self._store(user)  # what is on disk now, under the lock: the put below builds on it
            current = [r for r in (self.catalog.fact(user, r.fact_id) for r in rows) if r is not None]
            gone = set(store.missing([r.kv_key for r in current]))  # again under the lock: one round trip
            lost = [r for r in current if r.kv_key in gone]
            if lost:
                log.warning("user %s: KV of %d facts is missing from %s; encoding them again",
                            user, len(lost), self.kv.describe())
                facts = [fact_of(r) for r in lost]
                kvs = self._encode(facts, self.contexts.contexts(user, facts), "", 0)
                for r, kv in zip(lost, kvs):
                    kv.fact_id = r.kv_key  # the same encoding the key was made for: same catalog state
                store.put(kvs)
                self.stats["reencoded_missing"] += len(lost)
        return store

    @staticmethod
    def _despite_writers(read: Callable, attempts: int = 3):
        """`read()`, again when a writer replaced a KV key between its catalog snapshot and the
        store (the writer removes superseded KV right after its commit)."""
        for attempt in range(attempts):
            try:
                return read()
            except StoreError:
                if attempt == attempts - 1:
                    raise
