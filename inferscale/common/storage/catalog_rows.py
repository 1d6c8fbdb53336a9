"""The catalog's users, background jobs and turns: one part per table, each over the catalog's
connections (`catalog_sql.SQLRunner`). `Catalog` is made of these parts and of
`catalog_facts.FactTable` and `catalog_facts.HistoryTable`; its protocols are in `protocols.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from inferscale.common.storage.catalog_facts import paged
from inferscale.common.storage.catalog_sql import SQLRunner


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


class UserTable:
    """Users: existence, incarnation, memory version; a user's delete cascades to every table."""

    def __init__(self, sql: SQLRunner) -> None:
        self.sql = sql

    def user_exists(self, user_id: str) -> bool:
        return self.sql.query("SELECT 1 FROM users WHERE user_id=?", (user_id,)).fetchone() is not None

    def ensure_user(self, db, user_id: str, incarnation: str) -> None:
        self.sql.execute(db, "INSERT INTO users (user_id, version, created, incarnation) VALUES (?, 0, ?, ?) "
                             "ON CONFLICT (user_id) DO NOTHING", (user_id, time.time(), incarnation))

    def incarnation(self, user_id: str) -> str | None:
        """The user's incarnation; None for an unknown user."""
        row = self.sql.query("SELECT incarnation FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else None

    def version(self, user_id: str) -> int:
        row = self.sql.query("SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()
        return row[0] if row else 0

    def bump_version(self, db, user_id: str) -> int:
        self.sql.execute(db, "UPDATE users SET version = version + 1 WHERE user_id=?", (user_id,))
        return self.sql.execute(db, "SELECT version FROM users WHERE user_id=?", (user_id,)).fetchone()[0]

    def users(self, prefix: str = "", limit: int | None = None, after: str | None = None) -> list[str]:
        """User ids starting with `prefix`, sorted: a page of `limit` after `after`."""
        q = "SELECT user_id FROM users WHERE substr(user_id, 1, ?) = ?"
        return [r[0] for r in self.sql.query(*paged(q, [len(prefix), prefix], "user_id", after, limit))]

    def delete_user(self, db, user_id: str) -> None:
        self.sql.execute(db, "DELETE FROM users WHERE user_id=?", (user_id,))  # cascades to every table


class JobTable:
    """Background jobs (fact extraction): queued, running, done or failed."""

    def __init__(self, sql: SQLRunner) -> None:
        self.sql = sql

    def insert_job(self, db, user_id: str, job_id: str, turn_ids: str) -> bool:
        """Queue a job (turn ids as JSON); False when the user already has one of that id."""
        now = time.time()
        cur = self.sql.execute(db, "INSERT INTO jobs (user_id, job_id, state, turn_ids, created, updated) "
                                   "VALUES (?, ?, 'queued', ?, ?, ?) ON CONFLICT (user_id, job_id) DO NOTHING",
                               (user_id, job_id, turn_ids, now, now))
        return cur.rowcount == 1

    def job(self, user_id: str, job_id: str) -> JobRow | None:
        r = self.sql.query("SELECT job_id, state, turn_ids, outcome, error, created, updated FROM jobs "
                           "WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
        return JobRow(*r) if r else None

    def jobs(self, user_id: str, unfinished: bool = False) -> list[JobRow]:
        q = "SELECT job_id, state, turn_ids, outcome, error, created, updated FROM jobs WHERE user_id=?"
        if unfinished:
            q += " AND state IN ('queued', 'running')"
        return [JobRow(*r) for r in self.sql.query(q + " ORDER BY created", (user_id,))]

    def set_job(self, user_id: str, job_id: str, state: str, outcome: str | None = None,
                error: str | None = None) -> None:
        """Move a job to `state` (its own transaction)."""
        with self.sql.transaction() as db:
            self.sql.execute(db, "UPDATE jobs SET state=?, outcome=?, error=?, updated=? WHERE user_id=? AND job_id=?",
                             (state, outcome, error, time.time(), user_id, job_id))


class TurnTable:
    """A conversation's turns, in order (a deleted turn keeps its place, without text)."""

    def __init__(self, sql: SQLRunner) -> None:
        self.sql = sql

    def turns(self, user_id: str, include_deleted: bool = False) -> list[TurnRow]:
        q = "SELECT turn_id, seq, speaker, text, session, date FROM turns WHERE user_id=?"
        if not include_deleted:
            q += " AND text IS NOT NULL"
        return [TurnRow(*r) for r in self.sql.query(q + " ORDER BY seq", (user_id,))]

    def next_seq(self, db, user_id: str) -> int:
        return self.sql.execute(db, "SELECT COALESCE(MAX(seq), -1) + 1 FROM turns WHERE user_id=?",
                                (user_id,)).fetchone()[0]

    def turn(self, user_id: str, turn_id: str) -> TurnRow | None:
        r = self.sql.query("SELECT turn_id, seq, speaker, text, session, date FROM turns "
                           "WHERE user_id=? AND turn_id=?", (user_id, turn_id)).fetchone()
        return TurnRow(*r) if r else None

    def insert_turn(self, db, user_id: str, seq: int, turn) -> None:
        self.sql.execute(db, "INSERT INTO turns (user_id, turn_id, seq, speaker, text, session, date) "
                             "VALUES (?,?,?,?,?,?,?)", (user_id, turn.id, seq, turn.speaker, turn.text, turn.session,
                                                        turn.date))

    def set_turn_text(self, db, user_id: str, turn_id: str, text: str | None) -> None:
        self.sql.execute(db, "UPDATE turns SET text=? WHERE user_id=? AND turn_id=?", (text, user_id, turn_id))
