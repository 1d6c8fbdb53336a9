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
from dataclasses import dataclass

from inferscale.common.storage.catalog_facts import FactQueries, FactRow, paged

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
# on columns a migrated catalog only has after `FactQueries._migrate_to_3`
INDEXES = """
CREATE INDEX IF NOT EXISTS facts_expiry ON facts (expires_at);
CREATE INDEX IF NOT EXISTS facts_user_expiry ON facts (user_id, expires_at);
CREATE INDEX IF NOT EXISTS facts_created ON facts (user_id, created_at);
CREATE INDEX IF NOT EXISTS facts_updated ON facts (user_id, updated_at);
"""


class CatalogError(Exception):
    """The catalog cannot be used (another schema version, an unreachable database)."""


@dataclass(frozen=True)
class TurnRow:
    turn_id: str
    seq: int
    speaker: str
    text: str | None
    session: int
    date: str | None


@dataclass(frozen=True)
class JobRow:
    job_id: str
    state: str
    turn_ids: str
    outcome: str | None
    error: str | None
    created: float
    updated: float


class Catalog(FactQueries):
    """The queries, over one connection per thread (a `protocols.CatalogBackend`); the fact
    queries are `catalog_facts.FactQueries`. A backend provides `_connect`, `_begin_write`,
    `_begin_read`, `locks` and the dialect (`_SQL_TYPES`, `_sql`)."""

    _SQL_TYPES: dict[str, str] = {}
    url: str  # what opened it, without credentials (logs, errors)

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list = []
        self._all_lock = threading.Lock()

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

    def _q(self, q: str, params: tuple = ()):
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

    # -- users -----------------------------------------------------------------------------
    def user_exists(self, user_id: str) -> bool:
        return self._q("SELECT 1 FROM users WHERE user_id=?", (user_id,)).fetchone() is not None

    def ensure_user(self, db, user_id: str, incarnation: str) -> None:
        self.execute(db, "INSERT INTO users (user_id, version, created, incarnation) VALUES (?, 0, ?, ?) "
                         "ON CONFLICT (user_id) DO NOTHING", (user_id, time.time(), incarnation))

    def incarnation(self, user_id: str) -> str | None:
        """The user's incarnation; None for an unknown user."""
        row = self._q("SELECT incarnation FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else None

    def version(self, user_id: str) -> int:
        row = self._q("SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else 0

    def bump_version(self, db, user_id: str) -> int:
        self.execute(db, "UPDATE users SET version = version + 1 WHERE user_id=?", (user_id,))
        return self.execute(db, "SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()[0]

    def users(self, prefix: str = "", limit: int | None = None, after: str | None = None) -> list[str]:
        """User ids starting with `prefix`, sorted: a page of `limit` after `after`."""
        q = "SELECT user_id FROM users WHERE substr(user_id, 1, ?) = ?"
        return [r[0] for r in self._q(*paged(q, [len(prefix), prefix], "user_id", after, limit))]

    def delete_user(self, db, user_id: str) -> None:
        self.execute(db, "DELETE FROM users WHERE user_id=?", (user_id,))  # cascades to every table

    # -- background jobs (fact extraction) --------------------------------------------------
    def insert_job(self, db, user_id: str, job_id: str, turn_ids: str) -> bool:
        """Queue a job (turn ids as JSON); False when the user already has one of that id."""
        now = time.time()
        cur = self.execute(db, "INSERT INTO jobs (user_id, job_id, state, turn_ids, created, updated) "
                               "VALUES (?, ?, 'queued', ?, ?, ?) ON CONFLICT (user_id, job_id) DO NOTHING",
                           (user_id, job_id, turn_ids, now, now))
        return cur.rowcount == 1

    def job(self, user_id: str, job_id: str) -> JobRow | None:
        r = self._q("SELECT job_id, state, turn_ids, outcome, error, created, updated FROM jobs "
                    "WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
        return JobRow(*r) if r else None

    def jobs(self, user_id: str, unfinished: bool = False) -> list[JobRow]:
        q = "SELECT job_id, state, turn_ids, outcome, error, created, updated FROM jobs WHERE user_id=?"
        if unfinished:
            q += " AND state IN ('queued', 'running')"
        return [JobRow(*r) for r in self._q(q + " ORDER BY created", (user_id,))]

    def set_job(self, user_id: str, job_id: str, state: str, outcome: str | None = None,
                error: str | None = None) -> None:
        """Move a job to `state` (its own transaction)."""
        with self.transaction() as db:
            self.execute(db, "UPDATE jobs SET state=?, outcome=?, error=?, updated=? WHERE user_id=? AND job_id=?",
                         (state, outcome, error, time.time(), user_id, job_id))

    # -- turns -----------------------------------------------------------------------------
    def turns(self, user_id: str, include_deleted: bool = False) -> list[TurnRow]:
        q = "SELECT turn_id, seq, speaker, text, session, date FROM turns WHERE user_id=?"
        if not include_deleted:
            q += " AND text IS NOT NULL"
        return [TurnRow(*r) for r in self._q(q + " ORDER BY seq", (user_id,))]

    def next_seq(self, db, user_id: str) -> int:
        return self.execute(db, "SELECT COALESCE(MAX(seq), -1) + 1 FROM turns WHERE user_id=?",
                            (user_id,)).fetchone()[0]

    def turn(self, user_id: str, turn_id: str) -> TurnRow | None:
        r = self._q("SELECT turn_id, seq, speaker, text, session, date FROM turns "
                    "WHERE user_id=? AND turn_id=?", (user_id, turn_id)).fetchone()
        return TurnRow(*r) if r else None

    def insert_turn(self, db, user_id: str, seq: int, turn) -> None:
        self.execute(db, "INSERT INTO turns (user_id, turn_id, seq, speaker, text, session, date) "
                         "VALUES (?,?,?,?,?,?,?)", (user_id, turn.id, seq, turn.speaker, turn.text, turn.session,
                                                    turn.date))

    def set_turn_text(self, db, user_id: str, turn_id: str, text: str | None) -> None:
        self.execute(db, "UPDATE turns SET text=? WHERE user_id=? AND turn_id=?", (text, user_id, turn_id))


def new_incarnation() -> str:
    return secrets.token_hex(8)
