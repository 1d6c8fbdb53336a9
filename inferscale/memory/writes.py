"""The memory service's writes: add (in batches, or atomically), update, delete, a user's purge,
and the sweep of expired facts. A part of `MemoryService` (on its `core`); write order and crash
safety: docs/storage.md ("The memory service").

Every write holds the user's writer lock, recovers what a crash left behind first
(`CrashRecovery.recover`), validates everything before it writes anything, stores the new KV
before the catalog names it, and forgets superseded KV only after its transaction commits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from inferscale.common.facts import Fact, Turn, validate_id
from inferscale.common.storage.catalog import new_incarnation
from inferscale.memory.contexts import EncodingContexts, fact_of
from inferscale.memory.core import MemoryCore
from inferscale.memory.crash_recovery import CrashRecovery
from inferscale.memory.encoding import FactEncoding
from inferscale.memory.limits import check_new_ids
from inferscale.memory.progress import Heartbeat
from inferscale.memory.quotas import Quota, Usage
from inferscale.memory.service_types import AddInterrupted, MemoryFact, UnknownUserError, _public
from inferscale.retrieval.embedders import Embedder

log = logging.getLogger("inferscale.memory")
UNCHANGED = object()  # update(): keep this field as it is


@dataclass(frozen=True)
class _Encoded:
    """A batch of an add, encoded and stored, not committed: its facts, KV keys, embeddings, KV bytes."""

    facts: list[Fact]
    keys: list[str]
    embs: np.ndarray | None
    sizes: list[int]


class MemoryWrites:
    PROGRESS_EVERY_S = 3.0  # how often a long add reports while a batch encodes

    def __init__(self, core: MemoryCore, encoding: FactEncoding, contexts: EncodingContexts, ledger: Usage,
                 recovery: CrashRecovery, embedder: Embedder) -> None:
        self.core, self.catalog, self.encoding, self.contexts = core, core.catalog, encoding, contexts
        self.ledger, self.recovery, self.embedder = ledger, recovery, embedder

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
        self.core.check_user(user, must_exist=False)
        facts, turns, deleted = list(facts), list(turns), frozenset(deleted_turns)
        if not facts and not turns:
            raise ValueError("add() needs facts or turns")
        for t in turns:
            self.core.limits.check_turn(t)
        for f in facts:
            self.core.limits.check_fact(f)
        with self.core.writer(user):
            self.recovery.recover(user)
            check_new_ids(self.catalog, user, facts, turns, self.core.clock())
            if quota is not None:  # before any encoding: a count that cannot fit once the expired are swept
                expired = len(self.catalog.expired(user, self.core.clock()))
                with self.catalog.transaction() as db:
                    self.ledger.check(db, quota, len(facts) - expired, 0)
            self._sweep_locked(user)  # after every check: a refused add changes nothing
            incarnation = self.catalog.incarnation(user) or new_incarnation()
            step = self.core.config.ingest_batch
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
        kvs = self.encoding.encode(facts, contexts, incarnation, version, progress)
        embs = self.embedder.embed([f.text for f in facts])
        self.core.store(user).put(kvs)
        return _Encoded(facts, [kv.fact_id for kv in kvs], embs, [self.ledger.kv_bytes(kv) for kv in kvs])

    def _forget_encoded(self, user: str, encoded: Sequence["_Encoded"]) -> None:
        keys = [k for e in encoded for k in e.keys]
        if keys:  # nothing names this KV: it must not stay behind
            self.core.forget_kv(self.core.store(user), keys)

    def _commit(self, user: str, incarnation: str, encoded: list["_Encoded"], turns: Sequence[Turn],
                deleted: frozenset, quota: Quota | None = None, imported: Mapping[str, dict] | None = None) -> None:
        """One transaction: the turns (those in `deleted` without text), the encoded facts, their
        history; the quota checked against all of it. On any failure their KV is forgotten."""
        facts = [f for e in encoded for f in e.facts]
        keys = [k for e in encoded for k in e.keys]
        sizes = [n for e in encoded for n in e.sizes]
        now = self.core.clock()
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
            self.core.indexes.apply(user, v, [rows[f.id].id for f in facts], np.stack(embs))
        else:
            self.core.indexes.apply(user, v)

    def update(self, user: str, fact_id: str, text: str | None = None, metadata=UNCHANGED, expires_at=UNCHANGED,
               quota: Quota | None = None) -> MemoryFact:
        """Change a live fact's text, metadata (replaced whole) or `expires_at` (None: never).
        A new text is embedded and encoded again (same context), and under context "facts" so are
        the facts whose context held its old text; metadata and expiry alone change no KV."""
        self.core.check_user(user)
        with self.core.writer(user):
            self.recovery.recover(user)
            row = self.core.fact_row(user, fact_id, live=True)  # an expired fact is gone: 404, nothing written
            old = fact_of(row)
            fact = Fact(fact_id, old.text if text is None else text, row.source_turn, row.date,
                        old.metadata if metadata is UNCHANGED else metadata,
                        old.expires_at if expires_at is UNCHANGED else expires_at)
            self.core.limits.check_fact(fact)
            self._sweep_locked(user)  # after every check: a refused update changes nothing
            if fact.text == row.text:
                return self._update_fields(user, row, fact)
            version = self.catalog.version(user) + 1
            after = self.contexts.listed_after(user, fact_id)
            todo = [fact] + [fact_of(r) for r in after]
            contexts = self.contexts.contexts(user, todo, fact_edits={fact_id: fact.text})
            kv, *dep_kvs = self.encoding.encode(todo, contexts, self.catalog.incarnation(user), version)
            emb = self.embedder.embed([fact.text])[0]
            store = self.core.store(user)
            store.put([kv, *dep_kvs])
            size, now = self.ledger.kv_bytes(kv), self.core.clock()
            try:
                with self.catalog.transaction() as db:
                    self.ledger.check(db, quota, 0, size - (row.kv_bytes or 0))
                    v = self.catalog.bump_version(db, user)
                    self.catalog.update_fact(db, user, fact, kv.fact_id, emb, v, size, now)
                    self.catalog.log(db, user, fact_id, v, "UPDATE", row.text, fact.text, now, fact)
                    self.encoding.reencoded(db, user, v, after, dep_kvs)
            except Exception:
                self.core.forget_kv(store, [kv.fact_id] + [k.fact_id for k in dep_kvs])
                raise
            self.core.forget_kv(store, [row.kv_key] + [r.kv_key for r in after])
            self.core.indexes.apply(user, v, [row.id], emb[None])
            return _public(self.catalog.fact(user, fact_id))

    def _update_fields(self, user: str, row, fact: Fact) -> MemoryFact:
        """Metadata and expiry only: the same text, embedding and KV."""
        now = self.core.clock()
        with self.catalog.transaction() as db:
            v = self.catalog.bump_version(db, user)
            self.catalog.set_fields(db, user, fact, v, now)
            self.catalog.log(db, user, fact.id, v, "UPDATE", None, None, now, fact)
        self.core.indexes.apply(user, v)
        return _public(self.catalog.fact(user, fact.id))

    def delete(self, user: str, fact_id: str, keep_history: bool = False) -> None:
        """Forget a fact: its row, embedding, KV (shards it shared are rewritten) and, unless
        `keep_history`, the texts of its history (the events stay, without text)."""
        self.core.check_user(user)
        with self.core.writer(user):
            self.recovery.recover(user)
            self._delete_locked(user, fact_id, keep_history)
            self.catalog.checkpoint()

    def _delete_locked(self, user: str, fact_id: str, keep_history: bool = False) -> None:
        row = self.core.fact_row(user, fact_id)
        after = self.contexts.listed_after(user, fact_id)  # their KV saw the text being forgotten
        facts = [fact_of(r) for r in after]
        store = self.core.store(user)
        dep_kvs = (self.encoding.encode(facts, self.contexts.contexts(user, facts, fact_edits={fact_id: None}),
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
            self.encoding.reencoded(db, user, v, after, dep_kvs)
        self.core.forget_kv(store, [row.kv_key] + [r.kv_key for r in after])
        self.core.indexes.apply(user, v, remove_ids=[row.id])

    def delete_user(self, user: str) -> None:
        """Purge a user: rows (turns, facts, embeddings, history), index, every byte of KV, caches.

        The rows go first (one transaction), then the files. A crash in between leaves files that
        no user owns: they are removed on the next open, and repeating delete_user finishes it."""
        validate_id("user", user)
        with self.core.writer(user):
            udir = self.core.user_dir(user)
            exists = self.catalog.user_exists(user)
            if not exists and not udir.exists():
                raise UnknownUserError(f"unknown user {user!r}")
            if exists:
                with self.catalog.transaction() as db:
                    self.catalog.delete_user(db, user)
                self.catalog.purge_user_storage()
            self.catalog.checkpoint()
            self.recovery.purge_dir(udir)
            self.core.kv.delete_user(user)
            self.core.indexes.forget(user)
            self.recovery.forget(user)

    # -- expiry and usage --------------------------------------------------------------------
    def sweep_expired(self, keep_history: bool = False) -> dict[str, list[str]]:
        """Forget every fact expired by now, in every user, as completely as `delete` does (KV in
        every tier, index, history texts unless `keep_history`); returns {user: fact ids}."""
        swept = {}
        self.catalog.optimize()  # the periodic upkeep: the planner's statistics follow the memory's growth
        for user in self.catalog.users_with_expired(self.core.clock()):
            with self.core.writer(user):
                self.recovery.recover(user)
                gone = self._sweep_locked(user, keep_history)
            if gone:
                swept[user] = gone
                self.catalog.checkpoint()
        return swept

    def _sweep_locked(self, user: str, keep_history: bool = False) -> list[str]:
        gone = self.catalog.expired(user, self.core.clock())
        for fact_id in gone:
            self._delete_locked(user, fact_id, keep_history)
        if gone:
            log.info("user %s: %d expired facts forgotten", user, len(gone))
        return gone
