"""The catalog: users, turns, facts, per-user memory versions and history.

The catalog is the source of truth for what a user's memory holds. KV and the vector index are
derived from it: a fact is visible once its catalog row commits, and its KV was written (and made
durable) before that commit, so a crash never exposes a fact without its KV; a fact whose KV went
missing (an evicted shared tier, a replica without the files) is encoded again from these rows.

Two backends share one schema and every query (written with `?` placeholders):

    open_catalog("", root)                       -> SQLiteCatalog(root / "catalog.sqlite")  (default)
    open_catalog("postgresql://host/db", root)   -> PostgresCatalog, shared by replicas

SQLite runs in WAL mode: each write is one transaction and readers see a consistent snapshot.
Every thread gets its own connection, so one thread's read snapshot never shares a connection with
another thread's write transaction: reads do not wait for writes, and writes wait only for each
other's (short) commit, never for encoding. The schema carries a version (`meta` table): a catalog
written by a newer InferScale is refused by name; older ones are migrated on open.

A user row carries an **incarnation**, a random token drawn when the user is created: KV keys and
prefix-cache salts include it, so a user deleted and created again never gets a key (or salt) of
its previous life.

Every query is scoped by `user_id`; there is no query that reads rows of more than one user.
"""

from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager
from typing import Sequence

import numpy as np

from inferscale.common.storage.catalog_facts import FactRow, FactTable, HistoryTable
from inferscale.common.storage.catalog_rows import JobRow, JobTable, TurnRow, TurnTable, UserTable

__all__ = ["Catalog", "CatalogError", "FactRow", "JobRow", "TurnRow", "new_incarnation"]

SCHEMA_VERSION = 3  # 1: before user incarnations; 2: incarnations + the meta table; 3: metadata, times, expiry

# `{id}`, `{ref}`, `{blob}`, `{real}`, `{bytes_order}` differ between the dialects; everything else is shared.
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS users (
    user_id TEXT PRIMARY KEY,
    version INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,   -- unused since device-tier pins went, kept as catalogs have it
    created {real} NOT NULL,
    incarnation TEXT                 -- random per creation of the user id (NULL: rows from before it existed)
);
CREATE TABLE IF NOT EXISTS turns (
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    turn_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    speaker TEXT NOT NULL,
    text TEXT,                       -- NULL once deleted (the row keeps the turn's place)
    session INTEGER NOT NULL DEFAULT 0,
    date TEXT,
    PRIMARY KEY (user_id, turn_id)
);
CREATE TABLE IF NOT EXISTS facts (
    id {id},                         -- the vector index id
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    fact_id TEXT NOT NULL,
    text TEXT NOT NULL,
    source_turn TEXT,
    date TEXT,
    kv_key TEXT NOT NULL,            -- key of its KV in the user's store (changes on re-encode)
    embedding {blob} NOT NULL,       -- float32, so the index can always be rebuilt
    version INTEGER NOT NULL,        -- user memory version of its last change
    metadata TEXT,                   -- JSON object (NULL: none), its values also in fact_meta
    expires_at {real},               -- epoch seconds: from then on the fact is never read (NULL: never)
    created_at {real},
    updated_at {real},
    kv_bytes BIGINT,                 -- bytes of its stored KV, for quotas (NULL: written before they were counted)
    UNIQUE (user_id, fact_id)
);
CREATE TABLE IF NOT EXISTS fact_meta (  -- one row per metadata value: what filters read
    fact {ref} NOT NULL REFERENCES facts(id) ON DELETE CASCADE,
    user_id TEXT NOT NULL,
    key TEXT NOT NULL,
    kind TEXT NOT NULL,              -- s (string) | n (number) | b (boolean, nval 0 or 1)
    sval TEXT{bytes_order},
    nval {real}
);
CREATE TABLE IF NOT EXISTS history (
    id {id},
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    fact_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    event TEXT NOT NULL,             -- ADD | UPDATE | DELETE | REENCODE | IMPORT
    old_text TEXT,
    new_text TEXT,
    ts {real} NOT NULL,
    fields TEXT                      -- JSON: the fact's metadata and expires_at after the event (NULL: none)
);
CREATE TABLE IF NOT EXISTS jobs (
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    job_id TEXT NOT NULL,
    state TEXT NOT NULL,             -- queued | running | done | failed
    turn_ids TEXT NOT NULL,          -- JSON list: the stored turns it extracts facts from
    outcome TEXT,                    -- JSON: progress while running, what changed when done
    error TEXT,                      -- why it failed
    created {real} NOT NULL,
    updated {real} NOT NULL,
    PRIMARY KEY (user_id, job_id)
);
CREATE INDEX IF NOT EXISTS turns_order ON turns (user_id, seq);
CREATE INDEX IF NOT EXISTS history_fact ON history (user_id, fact_id);
CREATE INDEX IF NOT EXISTS fact_meta_s ON fact_meta (user_id, key, sval);
CREATE INDEX IF NOT EXISTS fact_meta_n ON fact_meta (user_id, key, nval);
CREATE INDEX IF NOT EXISTS fact_meta_fact ON fact_meta (fact, key);
"""
# on columns a migrated catalog only has after `Catalog._migrate_to_3`
INDEXES = """
CREATE INDEX IF NOT EXISTS facts_expiry ON facts (expires_at);
CREATE INDEX IF NOT EXISTS facts_user_expiry ON facts (user_id, expires_at);
CREATE INDEX IF NOT EXISTS facts_created ON facts (user_id, created_at);
CREATE INDEX IF NOT EXISTS facts_updated ON facts (user_id, updated_at);
"""


class CatalogError(Exception):
    """The catalog cannot be used (another schema version, an unreachable database)."""


class Catalog:
    """A `protocols.CatalogBackend` made of one part per table: `user_rows` (UserTable), `job_rows`
    (JobTable), `turn_rows` (TurnTable), `fact_rows` (FactTable: facts, expiry, usage) and
    `history_rows` (HistoryTable), each running its SQL on this catalog's connections (one per
    thread) through `query` and `execute` (`catalog_sql.SQLRunner`). The methods below hand each
    call to its part. A backend provides `_connect`, `_begin_write`, `_begin_read`, `locks` and the
    dialect (`_SQL_TYPES`, `_sql`, `_BY_ID_FIRST`)."""

    _SQL_TYPES: dict[str, str] = {}
    _BY_ID_FIRST = ""  # the dialect's way to make a query look rows up by id, not scan the user's index
    url: str  # what opened it, without credentials (logs, errors)

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list = []
        self._all_lock = threading.Lock()
        self.user_rows, self.job_rows, self.turn_rows = UserTable(self), JobTable(self), TurnTable(self)
        self.fact_rows, self.history_rows = FactTable(self, self._BY_ID_FIRST), HistoryTable(self)

    # -- backend hooks -------------------------------------------------------------------------
    def _connect(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def _begin_write(self, db) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _begin_read(self, db) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _sql(self, q: str) -> str:
        return q

    def locks(self):
        """Per-user writer locks that every process using this catalog respects."""
        raise NotImplementedError  # pragma: no cover - abstract

    def checkpoint(self) -> None:
        """Make deleted text leave the database's logs (a no-op where the backend has none to trim)."""

    def purge_user_storage(self) -> None:
        """Reclaim the space of deleted rows where the backend keeps them until then."""

    def optimize(self) -> None:
        """Refresh the query planner's statistics (a no-op where the database keeps them itself)."""

    def lock_scope(self, db, name: str) -> None:
        """Serialise the transactions on `db` that name `name` until they commit (a tenant's quota
        check). SQLite's write transactions are serialised already."""

    # -- connections and transactions ----------------------------------------------------------
    @property
    def db(self):
        """This thread's connection (opened on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def execute(self, db, q: str, params: tuple = ()):
        return db.execute(self._sql(q), params)

    def query(self, q: str, params: tuple = ()):
        """`q` on this thread's connection."""
        return self.execute(self.db, q, params)

    def close(self) -> None:
        with self._all_lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        self._local = threading.local()

    @contextmanager
    def transaction(self):
        """One atomic write (ROLLBACK on any error)."""
        db = self.db
        self._begin_write(db)
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    @contextmanager
    def snapshot(self):
        """A read transaction: every query inside sees the same committed state."""
        db = self.db
        self._begin_read(db)
        try:
            yield db
        finally:
            db.execute("COMMIT")

    def _init_schema(self, columns_of) -> None:
        """Create or migrate the schema; refuse one written by a newer version."""
        with self.transaction() as db:
            for stmt in SCHEMA.format(**self._SQL_TYPES).split(";"):
                if stmt.strip():
                    db.execute(stmt)
            row = self.execute(db, "SELECT value FROM meta WHERE key='schema_version'").fetchone()
            found = int(row[0]) if row else 1
            if found > SCHEMA_VERSION:
                raise CatalogError(f"catalog {self.url} has schema version {found}; this InferScale reads "
                                   f"up to {SCHEMA_VERSION} (upgrade InferScale to open it)")
            if "incarnation" not in columns_of(db, "users"):  # a catalog written before incarnations existed
                db.execute("ALTER TABLE users ADD COLUMN incarnation TEXT")
            if found < 3:  # before metadata and expiry (a new catalog reads as 1: nothing to move)
                self._migrate_to_3(db, columns_of(db, "facts"), columns_of(db, "history"))
            for stmt in INDEXES.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            stale = [r[0] for r in self.execute(db, "SELECT user_id FROM users WHERE incarnation IS NULL")]
            for uid in stale:
                self.execute(db, "UPDATE users SET incarnation=? WHERE user_id=?", (new_incarnation(), uid))
            self.execute(db, "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                             "ON CONFLICT (key) DO UPDATE SET value=excluded.value", (str(SCHEMA_VERSION),))

    def _migrate_to_3(self, db, fact_columns: Sequence[str], history_columns: Sequence[str]) -> None:
        """Bring facts and history from before metadata and expiry (schema 2) to schema 3: the
        columns, and each fact's creation and last change read from its history."""
        for name, kind in (("metadata", "TEXT"), ("expires_at", "{real}"), ("created_at", "{real}"),
                           ("updated_at", "{real}"), ("kv_bytes", "BIGINT")):
            if name not in fact_columns:
                db.execute(f"ALTER TABLE facts ADD COLUMN {name} {kind.format(**self._SQL_TYPES)}")
        if "fields" not in history_columns:
            db.execute("ALTER TABLE history ADD COLUMN fields TEXT")
        self.execute(db, "UPDATE facts SET created_at = COALESCE((SELECT MIN(h.ts) FROM history h WHERE "
                         "h.user_id = facts.user_id AND h.fact_id = facts.fact_id), ?) WHERE created_at IS NULL",
                     (time.time(),))
        self.execute(db, "UPDATE facts SET updated_at = COALESCE((SELECT MAX(h.ts) FROM history h WHERE "
                         "h.user_id = facts.user_id AND h.fact_id = facts.fact_id), created_at) "
                         "WHERE updated_at IS NULL")

    # -- users, jobs, turns (catalog_rows.py) ---------------------------------------------
    def user_exists(self, user_id: str) -> bool:
        return self.user_rows.user_exists(user_id)

    def ensure_user(self, db, user_id: str, incarnation: str) -> None:
        self.user_rows.ensure_user(db, user_id, incarnation)

    def incarnation(self, user_id: str) -> str | None:
        return self.user_rows.incarnation(user_id)

    def version(self, user_id: str) -> int:
        return self.user_rows.version(user_id)

    def bump_version(self, db, user_id: str) -> int:
        return self.user_rows.bump_version(db, user_id)

    def users(self, prefix: str = "", limit: int | None = None, after: str | None = None) -> list[str]:
        return self.user_rows.users(prefix, limit, after)

    def delete_user(self, db, user_id: str) -> None:
        self.user_rows.delete_user(db, user_id)

    def insert_job(self, db, user_id: str, job_id: str, turn_ids: str) -> bool:
        return self.job_rows.insert_job(db, user_id, job_id, turn_ids)

    def job(self, user_id: str, job_id: str) -> JobRow | None:
        return self.job_rows.job(user_id, job_id)

    def jobs(self, user_id: str, unfinished: bool = False) -> list[JobRow]:
        return self.job_rows.jobs(user_id, unfinished)

    def set_job(self, user_id: str, job_id: str, state: str, outcome: str | None = None,
                error: str | None = None) -> None:
        self.job_rows.set_job(user_id, job_id, state, outcome, error)

    def turns(self, user_id: str, include_deleted: bool = False) -> list[TurnRow]:
        return self.turn_rows.turns(user_id, include_deleted)

    def next_seq(self, db, user_id: str) -> int:
        return self.turn_rows.next_seq(db, user_id)

    def turn(self, user_id: str, turn_id: str) -> TurnRow | None:
        return self.turn_rows.turn(user_id, turn_id)

    def insert_turn(self, db, user_id: str, seq: int, turn) -> None:
        self.turn_rows.insert_turn(db, user_id, seq, turn)

    def set_turn_text(self, db, user_id: str, turn_id: str, text: str | None) -> None:
        self.turn_rows.set_turn_text(db, user_id, turn_id, text)

    # -- facts, expiry, usage, history (catalog_facts.py) ------------------------------------
    def facts(self, user_id: str, now: float | None = None, where: tuple[str, list] | None = None,
              limit: int | None = None, after: int | None = None) -> list[FactRow]:
        return self.fact_rows.facts(user_id, now, where, limit, after)

    def matching_ids(self, user_id: str, where: tuple[str, list] | None, now: float | None) -> np.ndarray:
        return self.fact_rows.matching_ids(user_id, where, now)

    def at_most(self, bounds: list[tuple[str, list]], cap: int) -> int:
        return self.fact_rows.at_most(bounds, cap)

    def fact(self, user_id: str, fact_id: str, now: float | None = None) -> FactRow | None:
        return self.fact_rows.fact(user_id, fact_id, now)

    def facts_by_fact_ids(self, user_id: str, fact_ids: list[str], now: float | None = None) -> dict[str, FactRow]:
        return self.fact_rows.facts_by_fact_ids(user_id, fact_ids, now)

    def facts_by_index_ids(self, user_id: str, ids: list[int], now: float | None = None,
                           where: tuple[str, list] | None = None) -> dict[int, FactRow]:
        return self.fact_rows.facts_by_index_ids(user_id, ids, now, where)

    def embeddings(self, user_id: str) -> tuple[np.ndarray, np.ndarray]:
        return self.fact_rows.embeddings(user_id)

    def insert_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None, updated_at: float | None = None) -> None:
        self.fact_rows.insert_fact(db, user_id, fact, kv_key, embedding, version, kv_bytes, now, updated_at)

    def update_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None) -> None:
        self.fact_rows.update_fact(db, user_id, fact, kv_key, embedding, version, kv_bytes, now)

    def set_fields(self, db, user_id: str, fact, version: int, now: float | None = None) -> None:
        self.fact_rows.set_fields(db, user_id, fact, version, now)

    def set_kv_key(self, db, user_id: str, fact_id: str, kv_key: str, version: int,
                   kv_bytes: int | None = None) -> None:
        self.fact_rows.set_kv_key(db, user_id, fact_id, kv_key, version, kv_bytes)

    def delete_fact(self, db, user_id: str, fact_id: str) -> None:
        self.fact_rows.delete_fact(db, user_id, fact_id)

    def expired(self, user_id: str, now: float) -> list[str]:
        return self.fact_rows.expired(user_id, now)

    def users_with_expired(self, now: float) -> list[str]:
        return self.fact_rows.users_with_expired(now)

    def usage(self, db, prefix: str) -> tuple[int, int]:
        return self.fact_rows.usage(db, prefix)

    def usage_by_user(self) -> dict[str, tuple[int, int]]:
        return self.fact_rows.usage_by_user()

    def users_uncounted(self, prefix: str) -> list[str]:
        return self.fact_rows.users_uncounted(prefix)

    def uncounted(self, user_id: str) -> list[tuple[str, str]]:
        return self.fact_rows.uncounted(user_id)

    def set_kv_bytes(self, db, user_id: str, kv_key: str, kv_bytes: int) -> None:
        self.fact_rows.set_kv_bytes(db, user_id, kv_key, kv_bytes)

    def history(self, user_id: str, fact_id: str, limit: int | None = None, after: int | None = None) -> list[dict]:
        return self.history_rows.history(user_id, fact_id, limit, after)

    def forget_history(self, db, user_id: str, fact_id: str) -> None:
        self.history_rows.forget_history(db, user_id, fact_id)

    def log(self, db, user_id: str, fact_id: str, version: int, event: str, old_text: str | None,
            new_text: str | None, ts: float | None = None, fact=None) -> None:
        self.history_rows.log(db, user_id, fact_id, version, event, old_text, new_text, ts, fact)


def new_incarnation() -> str:
    return secrets.token_hex(8)
