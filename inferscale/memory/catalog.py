"""The SQLite catalog: users, turns, facts, per-user memory versions and history.

The catalog is the source of truth for what a user's memory holds. KV shards and the vector
index are derived from it: a fact is visible once its catalog row commits, and its KV was
written (and fsynced) before that commit, so a crash never exposes a fact without its KV.
SQLite runs in WAL mode: each write is one transaction and readers see a consistent snapshot.
Every thread gets its own connection, so one thread's read snapshot never shares a connection with
another thread's write transaction: reads do not wait for writes, and writes wait only for each
other's (short) commit, never for encoding.

A user row carries an **incarnation**, a random token drawn when the user is created: KV keys and
prefix-cache salts include it, so a user deleted and created again never gets a key (or salt) of
its previous life.

Every query is scoped by `user_id`; there is no query that reads rows of more than one user.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    user_id TEXT PRIMARY KEY,
    version INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
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
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the vector index id
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    fact_id TEXT NOT NULL,
    text TEXT NOT NULL,
    source_turn TEXT,
    date TEXT,
    kv_key TEXT NOT NULL,            -- key of its KV in the user's store (changes on re-encode)
    embedding BLOB NOT NULL,         -- float32, so the index can always be rebuilt
    version INTEGER NOT NULL,        -- user memory version of its last change
    UNIQUE (user_id, fact_id)
);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    fact_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    event TEXT NOT NULL,             -- ADD | UPDATE | DELETE | REENCODE
    old_text TEXT,
    new_text TEXT,
    ts REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_order ON turns (user_id, seq);
CREATE INDEX IF NOT EXISTS history_fact ON history (user_id, fact_id);
"""


@dataclass(frozen=True)
class FactRow:
    id: int
    user_id: str
    fact_id: str
    text: str
    source_turn: str | None
    date: str | None
    kv_key: str
    version: int


@dataclass(frozen=True)
class TurnRow:
    turn_id: str
    seq: int
    speaker: str
    text: str | None
    session: int
    date: str | None


class Catalog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self.db.executescript(SCHEMA)
        cols = {r[1] for r in self.db.execute("PRAGMA table_info(users)")}
        if "incarnation" not in cols:  # a catalog written before incarnations existed
            self.db.execute("ALTER TABLE users ADD COLUMN incarnation TEXT")
        stale = [r[0] for r in self.db.execute("SELECT user_id FROM users WHERE incarnation IS NULL")]
        if stale:
            with self.transaction() as db:
                for uid in stale:
                    db.execute("UPDATE users SET incarnation=? WHERE user_id=?", (new_incarnation(), uid))

    @property
    def db(self) -> sqlite3.Connection:
        """This thread's connection (opened on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA secure_delete=ON")  # deleted text is overwritten, not left in free pages
            self._local.conn = conn
            with self._all_lock:
                self._all.append(conn)
        return conn

    def close(self) -> None:
        with self._all_lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        self._local = threading.local()

    def checkpoint(self) -> None:
        """Copy the WAL into the database file and truncate it, so deleted text does not linger in
        the log (secure_delete already overwrote it in the database pages)."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    @contextmanager
    def transaction(self):
        """One atomic write: BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any error)."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
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
        db.execute("BEGIN")
        try:
            yield db
        finally:
            db.execute("COMMIT")

    # -- users -----------------------------------------------------------------------------
    def user_exists(self, user_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM users WHERE user_id=?", (user_id,)).fetchone() is not None

    def ensure_user(self, db, user_id: str, incarnation: str) -> None:
        db.execute("INSERT OR IGNORE INTO users (user_id, version, created, incarnation) VALUES (?, 0, ?, ?)",
                   (user_id, time.time(), incarnation))

    def incarnation(self, user_id: str) -> str | None:
        """The user's incarnation; None for an unknown user."""
        row = self.db.execute("SELECT incarnation FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else None

    def version(self, user_id: str) -> int:
        row = self.db.execute("SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else 0

    def bump_version(self, db, user_id: str) -> int:
        db.execute("UPDATE users SET version = version + 1 WHERE user_id=?", (user_id,))
        return db.execute("SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()[0]

    def users(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT user_id FROM users ORDER BY user_id")]

    def set_pinned(self, user_id: str, pinned: bool) -> None:
        with self.transaction() as db:
            db.execute("UPDATE users SET pinned=? WHERE user_id=?", (int(pinned), user_id))

    def pinned_users(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT user_id FROM users WHERE pinned=1")]

    # -- turns -----------------------------------------------------------------------------
    def turns(self, user_id: str, include_deleted: bool = False) -> list[TurnRow]:
        q = "SELECT turn_id, seq, speaker, text, session, date FROM turns WHERE user_id=?"
        if not include_deleted:
            q += " AND text IS NOT NULL"
        return [TurnRow(*r) for r in self.db.execute(q + " ORDER BY seq", (user_id,))]

    def next_seq(self, db, user_id: str) -> int:
        return db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM turns WHERE user_id=?", (user_id,)).fetchone()[0]

    def turn(self, user_id: str, turn_id: str) -> TurnRow | None:
        r = self.db.execute("SELECT turn_id, seq, speaker, text, session, date FROM turns "
                            "WHERE user_id=? AND turn_id=?", (user_id, turn_id)).fetchone()
        return TurnRow(*r) if r else None

    # -- facts -----------------------------------------------------------------------------
    _FACT_COLS = "id, user_id, fact_id, text, source_turn, date, kv_key, version"

    def facts(self, user_id: str) -> list[FactRow]:
        q = f"SELECT {self._FACT_COLS} FROM facts WHERE user_id=? ORDER BY id"
        return [FactRow(*r) for r in self.db.execute(q, (user_id,))]

    def fact(self, user_id: str, fact_id: str) -> FactRow | None:
        r = self.db.execute(f"SELECT {self._FACT_COLS} FROM facts WHERE user_id=? AND fact_id=?",
                            (user_id, fact_id)).fetchone()
        return FactRow(*r) if r else None

    def facts_by_index_ids(self, user_id: str, ids: list[int]) -> dict[int, FactRow]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        q = f"SELECT {self._FACT_COLS} FROM facts WHERE user_id=? AND id IN ({marks})"
        return {r[0]: FactRow(*r) for r in self.db.execute(q, (user_id, *ids))}

    def embeddings(self, user_id: str) -> tuple[np.ndarray, np.ndarray]:
        rows = self.db.execute("SELECT id, embedding FROM facts WHERE user_id=? ORDER BY id", (user_id,)).fetchall()
        ids = np.asarray([r[0] for r in rows], dtype=np.int64)
        vecs = np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows]) if rows else None
        return ids, vecs

    def history(self, user_id: str, fact_id: str) -> list[dict]:
        q = ("SELECT version, event, old_text, new_text, ts FROM history WHERE user_id=? AND fact_id=? "
             "ORDER BY id")
        return [dict(zip(("version", "event", "old_text", "new_text", "ts"), r))
                for r in self.db.execute(q, (user_id, fact_id))]

    def forget_history(self, db, user_id: str, fact_id: str) -> None:
        """Erase the texts of a fact's history events (the events stay, without their text)."""
        db.execute("UPDATE history SET old_text=NULL, new_text=NULL WHERE user_id=? AND fact_id=?", (user_id, fact_id))

    def log(self, db, user_id: str, fact_id: str, version: int, event: str,
            old_text: str | None, new_text: str | None) -> None:
        db.execute("INSERT INTO history (user_id, fact_id, version, event, old_text, new_text, ts) "
                   "VALUES (?,?,?,?,?,?,?)", (user_id, fact_id, version, event, old_text, new_text, time.time()))


def new_incarnation() -> str:
    return secrets.token_hex(8)
