"""The memory service: persistent per-user memory with online updates, retrieval and KV.

    svc = MemoryService(MemoryConfig(root="mem"), encoder=engine, embedder=MiniLMEmbedder())
    svc.add("alice", turns=[...], facts=[...])         # encodes KV (Context-Window Encoding)
    hits = svc.search("alice", "where does Tom live?", k=5, filters={"category": "home"})
    kv = svc.load_kv("alice", [h.fact_id for h in hits])   # read from the user's store

Storage layout, write order (crash safety), encoding contexts and concurrency: docs/storage.md
("The memory service"). Reads (filters, pages, the KV an engine reads) are `reads.MemoryReads`;
a fact past its `expires_at` is gone from every read at once and forgotten by `sweep_expired`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from inferscale.common.facts import Fact, Turn, validate_id
from inferscale.common.storage.backends import open_kv
from inferscale.common.storage.catalog import new_incarnation
from inferscale.common.storage.catalogs import open_catalog
from inferscale.common.storage.format import FactKV
from inferscale.common.storage.paths import user_dir
from inferscale.common.storage.protocols import CatalogBackend, FactStore, KVBackend
from inferscale.memory.contexts import EncodingContexts, fact_of
from inferscale.memory.crash_recovery import CrashRecovery
from inferscale.memory.limits import TextLimits, check_new_ids
from inferscale.memory.progress import Heartbeat, reports_progress
from inferscale.memory.portability import Portability
from inferscale.memory.quotas import Quota, Usage
from inferscale.memory.reads import MemoryReads
from inferscale.memory.turn_edits import TurnEdits
from inferscale.memory.service_types import AddInterrupted, KVEncoder, MemoryConfig, MemoryFact, UnknownUserError
from inferscale.memory.service_types import _public
from inferscale.retrieval.embedders import Embedder
from inferscale.retrieval.user_indexes import UserIndexes

log = logging.getLogger("inferscale.memory")
UNCHANGED = object()  # update(): keep this field as it is


@dataclass(frozen=True)
class _Encoded:
    """A batch of an add, encoded and stored, not committed: its facts, KV keys, embeddings, KV bytes."""

    facts: list[Fact]
    keys: list[str]
    embs: np.ndarray | None
    sizes: list[int]


class MemoryService(MemoryReads, Portability, TurnEdits):
    PROGRESS_EVERY_S = 3.0  # how often a long add reports while a batch encodes

    def __init__(self, config: MemoryConfig, encoder: KVEncoder, embedder: Embedder) -> None:
        self.config = config
        self.clock: Callable[[], float] = time.time  # what "now" is for expiry and a fact's times
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
        self.ledger = Usage(self.catalog, self.meta, lambda u: self._store(u, reader=True))  # facts, bytes, quotas
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

    def writer(self, user: str):
        """The user's writer lock, for writes beside the service's own (the memory chain's links)."""
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
            progress: Callable[[int, int], None] | None = None, quota: Quota | None = None,
            imported: Mapping[str, dict] | None = None, deleted_turns: Collection[str] = (),
            atomic: bool = False) -> list[str]:
        """Append turns and add facts (ids new to the user); returns the added fact ids.

        Everything is validated before anything is written. The facts are then encoded and committed
        in batches of `ingest_batch` (the turns with the first), so memory stays bounded and readers
        see the memory grow; if a later batch fails, `AddInterrupted.added` names what committed.
        `atomic`: every batch is encoded and its KV stored first, then all of them commit in one
        transaction (one quota check of the whole add): a failure anywhere writes nothing.
        `progress(facts encoded, facts in all)` is called after each batch, and while a batch
        is encoded every `PROGRESS_EVERY_S` seconds or so (its facts counted by the share of the
        encoder's rows run). `quota`: the tenant's limits, checked by each batch's commit
        (`QuotaExceeded`; a fact count that cannot fit is refused before anything is encoded).
        `imported`: per fact id, the times and history an exported document gave it (`portability`);
        `deleted_turns`: ids of `turns` stored as deleted (their place kept, without text)."""
        self._check_user(user, must_exist=False)
        facts, turns, deleted = list(facts), list(turns), frozenset(deleted_turns)
        if not facts and not turns:
            raise ValueError("add() needs facts or turns")
        for t in turns:
            self.limits.check_turn(t)
        for f in facts:
            self.limits.check_fact(f)
        with self._writer(user):
            self.recovery.recover(user)
            check_new_ids(self.catalog, user, facts, turns, self.clock())
            if quota is not None:  # before any encoding: a count that cannot fit once the expired are swept
                expired = len(self.catalog.expired(user, self.clock()))
                with self.catalog.transaction() as db:
                    self.ledger.check(db, quota, len(facts) - expired, 0)
            self._sweep_locked(user)  # after every check: a refused add changes nothing
            incarnation = self.catalog.incarnation(user) or new_incarnation()
            step = self.config.ingest_batch
            ends = list(range(step, len(facts), step)) + [len(facts)]
            added: list[str] = []
            pending: list[_Encoded] = []  # atomic: encoded and stored, not committed yet
            for b, end in enumerate(ends):
                batch = facts[ends[b - 1]:end] if b else facts[:end]
                rows = None
                if progress is not None:
                    rows = Heartbeat(lambda frac, done=len(added), n=len(batch): progress(
                        done + int(frac * n), len(facts)), self.PROGRESS_EVERY_S)
                try:
                    if atomic:  # nothing committed yet: every batch's context holds all the new turns
                        pending.append(self._encode_batch(user, incarnation, self.catalog.version(user) + 1,
                                                          batch, turns, facts[:end], deleted, rows))
                    else:
                        first = turns if b == 0 else ()
                        encoded = self._encode_batch(user, incarnation, self.catalog.version(user) + 1, batch,
                                                     first, batch, deleted, rows)
                        self._commit(user, incarnation, [encoded], first, deleted, quota, imported)
                except Exception as e:
                    self._forget_encoded(user, pending)
                    if added and not atomic:
                        raise AddInterrupted(added, e) from e
                    raise
                added += [f.id for f in batch]
                if progress is not None:
                    progress(len(added), len(facts))
            if atomic:
                self._commit(user, incarnation, pending, turns, deleted, quota, imported)
            return added

    def _encode_batch(self, user: str, incarnation: str, version: int, facts: list[Fact], turns: Sequence[Turn],
                      listed: Sequence[Fact], deleted: frozenset, progress=None) -> "_Encoded":
        """Encode `facts` (after `turns` and, under context "facts", `listed`, none of them
        committed yet), embed them and store their KV; nothing names it until `_commit`."""
        if not facts:
            return _Encoded([], [], None, [])
        contexts = self.contexts.contexts(user, facts, turns, listed, deleted_turns=deleted)
        kvs = self._encode(facts, contexts, incarnation, version, progress)
        embs = self.embedder.embed([f.text for f in facts])
        self._store(user).put(kvs)
        return _Encoded(facts, [kv.fact_id for kv in kvs], embs, [self.ledger.kv_bytes(kv) for kv in kvs])

    def _forget_encoded(self, user: str, encoded: Sequence["_Encoded"]) -> None:
        keys = [k for e in encoded for k in e.keys]
        if keys:  # nothing names this KV: it must not stay behind
            self._forget_kv(self._store(user), keys)

    def _commit(self, user: str, incarnation: str, encoded: list["_Encoded"], turns: Sequence[Turn],
                deleted: frozenset, quota: Quota | None = None, imported: Mapping[str, dict] | None = None) -> None:
        """One transaction: the turns (those in `deleted` without text), the encoded facts, their
        history; the quota checked against all of it. On any failure their KV is forgotten."""
        facts = [f for e in encoded for f in e.facts]
        keys = [k for e in encoded for k in e.keys]
        sizes = [n for e in encoded for n in e.sizes]
        now = self.clock()
        try:
            with self.catalog.transaction() as db:
                self.ledger.check(db, quota, len(facts), sum(sizes))
                self.catalog.ensure_user(db, user, incarnation)
                seq = self.catalog.next_seq(db, user)
                for i, t in enumerate(turns):
                    self.catalog.insert_turn(db, user, seq + i, t)
                    if t.id in deleted:
                        self.catalog.set_turn_text(db, user, t.id, None)
                v = self.catalog.bump_version(db, user)
                embs = [row for e in encoded if e.embs is not None for row in e.embs]
                for f, key, emb, size in zip(facts, keys, embs, sizes):
                    past = (imported or {}).get(f.id, {})
                    created = past.get("created_at", now)
                    self.catalog.insert_fact(db, user, f, key, emb, v, size, created, past.get("updated_at", created))
                    for event in past.get("history", ()):
                        self.catalog.log(db, user, f.id, v, event["event"], event["old_text"], event["new_text"],
                                         event["ts"] or now, event["fact"])
                    self.catalog.log(db, user, f.id, v, "IMPORT" if imported else "ADD", None, f.text, now, f)
        except Exception:
            self._forget_encoded(user, encoded)
            raise
        if facts:
            rows = self.catalog.facts_by_fact_ids(user, [f.id for f in facts])
            self.indexes.apply(user, v, [rows[f.id].id for f in facts], np.stack(embs))
        else:
            self.indexes.apply(user, v)

    def update(self, user: str, fact_id: str, text: str | None = None, metadata=UNCHANGED, expires_at=UNCHANGED,
               quota: Quota | None = None) -> MemoryFact:
        """Change a live fact's text, metadata (replaced whole) or `expires_at` (None: never).
        A new text is embedded and encoded again (same context), and under context "facts" so are
        the facts whose context held its old text; metadata and expiry alone change no KV."""
        self._check_user(user)
        with self._writer(user):
            self.recovery.recover(user)
            row = self._fact_row(user, fact_id, live=True)  # an expired fact is gone: 404, nothing written
            old = fact_of(row)
            fact = Fact(fact_id, old.text if text is None else text, row.source_turn, row.date,
                        old.metadata if metadata is UNCHANGED else metadata,
                        old.expires_at if expires_at is UNCHANGED else expires_at)
            self.limits.check_fact(fact)
            self._sweep_locked(user)  # after every check: a refused update changes nothing
            if fact.text == row.text:
                return self._update_fields(user, row, fact)
            version = self.catalog.version(user) + 1
            after = self.contexts.listed_after(user, fact_id)
            todo = [fact] + [fact_of(r) for r in after]
            contexts = self.contexts.contexts(user, todo, fact_edits={fact_id: fact.text})
            kv, *dep_kvs = self._encode(todo, contexts, self.catalog.incarnation(user), version)
            emb = self.embedder.embed([fact.text])[0]
            store = self._store(user)
            store.put([kv, *dep_kvs])
            size, now = self.ledger.kv_bytes(kv), self.clock()
            try:
                with self.catalog.transaction() as db:
                    self.ledger.check(db, quota, 0, size - (row.kv_bytes or 0))
                    v = self.catalog.bump_version(db, user)
                    self.catalog.update_fact(db, user, fact, kv.fact_id, emb, v, size, now)
                    self.catalog.log(db, user, fact_id, v, "UPDATE", row.text, fact.text, now, fact)
                    self._reencoded(db, user, v, after, dep_kvs)
            except Exception:
                self._forget_kv(store, [kv.fact_id] + [k.fact_id for k in dep_kvs])
                raise
            self._forget_kv(store, [row.kv_key] + [r.kv_key for r in after])
            self.indexes.apply(user, v, [row.id], emb[None])
            return _public(self.catalog.fact(user, fact_id))

    def _update_fields(self, user: str, row, fact: Fact) -> MemoryFact:
        """Metadata and expiry only: the same text, embedding and KV."""
        now = self.clock()
        with self.catalog.transaction() as db:
            v = self.catalog.bump_version(db, user)
            self.catalog.set_fields(db, user, fact, v, now)
            self.catalog.log(db, user, fact.id, v, "UPDATE", None, None, now, fact)
        self.indexes.apply(user, v)
        return _public(self.catalog.fact(user, fact.id))

    def delete(self, user: str, fact_id: str, keep_history: bool = False) -> None:
        """Forget a fact: its row, embedding, KV (shards it shared are rewritten) and, unless
        `keep_history`, the texts of its history (the events stay, without text)."""
        self._check_user(user)
        with self._writer(user):
            self.recovery.recover(user)
            self._delete_locked(user, fact_id, keep_history)
            self.catalog.checkpoint()

    def _delete_locked(self, user: str, fact_id: str, keep_history: bool = False) -> None:
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

    # -- expiry and usage --------------------------------------------------------------------
    def sweep_expired(self, keep_history: bool = False) -> dict[str, list[str]]:
        """Forget every fact expired by now, in every user, as completely as `delete` does (KV in
        every tier, index, history texts unless `keep_history`); returns {user: fact ids}."""
        swept = {}
        self.catalog.optimize()  # the periodic upkeep: the planner's statistics follow the memory's growth
        for user in self.catalog.users_with_expired(self.clock()):
            with self._writer(user):
                self.recovery.recover(user)
                gone = self._sweep_locked(user, keep_history)
            if gone:
                swept[user] = gone
                self.catalog.checkpoint()
        return swept

    def _sweep_locked(self, user: str, keep_history: bool = False) -> list[str]:
        gone = self.catalog.expired(user, self.clock())
        for fact_id in gone:
            self._delete_locked(user, fact_id, keep_history)
        if gone:
            log.info("user %s: %d expired facts forgotten", user, len(gone))
        return gone

    def usage(self, prefix: str) -> tuple[int, int]:
        """(facts, KV bytes) held by the users whose id starts with `prefix` (a tenant's)."""
        return self.ledger.of(prefix)

    def usage_by_user(self) -> dict[str, tuple[int, int]]:
        """user -> (facts, KV bytes) of every user with facts (one catalog query)."""
        return self.catalog.usage_by_user()
