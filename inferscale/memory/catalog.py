"""The SQLite catalog: users, turns, facts, per-user memory versions and history.

The catalog is the source of truth for what a user's memory holds. KV shards and the vector
index are derived from it: a fact is visible once its catalog row commits, and its KV was
written (and fsynced) before that commit, so a crash never exposes a fact without its KV.
SQLite runs in WAL mode: each write is one transaction and readers see a consistent snapshot.

Every query is scoped by `user_id`; there is no query that reads rows of more than one user.
"""

from __future__ import annotations

import sqlite3
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
    created REAL NOT NULL
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
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def transaction(self):
        """One atomic write: BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any error)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    @contextmanager
    def snapshot(self):
        """A read transaction: every query inside sees the same committed state."""
        self.db.execute("BEGIN")
        try:
            yield self.db
        finally:
            self.db.execute("COMMIT")

    # -- users -----------------------------------------------------------------------------
    def user_exists(self, user_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM users WHERE user_id=?", (user_id,)).fetchone() is not None

    def ensure_user(self, db, user_id: str) -> None:
        db.execute("INSERT OR IGNORE INTO users (user_id, version, created) VALUES (?, 0, ?)", (user_id, time.time()))

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

    def log(self, db, user_id: str, fact_id: str, version: int, event: str,
            old_text: str | None, new_text: str | None) -> None:
        db.execute("INSERT INTO history (user_id, fact_id, version, event, old_text, new_text, ts) "
                   "VALUES (?,?,?,?,?,?,?)", (user_id, fact_id, version, event, old_text, new_text, time.time()))
