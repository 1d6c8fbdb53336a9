"""The catalog's facts (`FactTable`: their rows with metadata and times, filters, expiry, usage)
and their history (`HistoryTable`): parts of `Catalog`, each over its connections
(`catalog_sql.SQLRunner`).

A fact row carries its metadata twice: as JSON (`facts.metadata`, what reads return) and as one
`fact_meta` row per value (what filters read, through indexes). Both are written in the fact's
transaction and removed with it (`ON DELETE CASCADE`).

Reads take `now` (epoch seconds): a fact whose `expires_at <= now` is not returned, so an expired
fact leaves every read at the second it expires, before any sweep. `now=None` reads every row,
expired or not (the write paths, which must see what they replace or forget).

Lists are pages in index-id order: `after` is the last id of the previous page (`limit` rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from inferscale.common.metadata import dumps, loads
from inferscale.common.storage.catalog_sql import SQLRunner
from inferscale.common.storage.filters import meta_rows

_CHUNK = 500  # ids per IN (...) query, below SQLite's and PostgreSQL's parameter limits


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
    metadata: str | None = None  # JSON object (None: none)
    expires_at: float | None = None
    created_at: float | None = None
    updated_at: float | None = None
    kv_bytes: int | None = None  # the stored KV's bytes (None: written before the catalog counted them)


def _live(now: float | None) -> tuple[str, tuple]:
    return ("", ()) if now is None else (" AND (f.expires_at IS NULL OR f.expires_at > ?)", (now,))


def paged(q: str, params: list, key: str, after: object = None, limit: int | None = None) -> tuple[str, tuple]:
    """`q` (ending in its WHERE conditions) as a keyset page: rows after `after` by `key`, in
    `key` order, at most `limit` of them."""
    if after is not None:
        q += f" AND {key} > ?"
        params = [*params, after]
    q += f" ORDER BY {key}"
    if limit is not None:
        q += " LIMIT ?"
        params = [*params, limit]
    return q, tuple(params)


def _meta_json(fact) -> tuple[dict, str | None]:
    """A fact's metadata, and its catalog spelling (None for none)."""
    metadata = dict(getattr(fact, "metadata", None) or {})
    return metadata, dumps(metadata) if metadata else None


class FactTable:
    """Facts: reads (live at `now`, filtered, paged), writes, expiry and usage."""

    _FACT_COLS = ("f.id, f.user_id, f.fact_id, f.text, f.source_turn, f.date, f.kv_key, f.version, f.metadata, "
                  "f.expires_at, f.created_at, f.updated_at, f.kv_bytes")

    def __init__(self, sql: SQLRunner, by_id_first: str = "") -> None:
        self.sql = sql
        self.by_id_first = by_id_first  # the dialect's way to look rows up by id, not scan the user's index

    # -- reads -------------------------------------------------------------------------------
    def facts(self, user_id: str, now: float | None = None, where: tuple[str, list] | None = None,
              limit: int | None = None, after: int | None = None) -> list[FactRow]:
        """The user's facts in id order; `where`: a filter's (SQL, params) (`filters.to_sql`)."""
        q, params = self._selecting(self._FACT_COLS, user_id, now, where)
        return [FactRow(*r) for r in self.sql.query(*paged(q, params, "f.id", after, limit))]

    def matching_ids(self, user_id: str, where: tuple[str, list] | None, now: float | None) -> np.ndarray:
        """The index ids of the user's live facts that satisfy the filter (int64)."""
        q, params = self._selecting("f.id", user_id, now, where)
        return np.asarray([r[0] for r in self.sql.query(q, tuple(params))], dtype=np.int64)

    @staticmethod
    def _selecting(columns: str, user_id: str, now: float | None,
                   where: tuple[str, list] | None) -> tuple[str, list]:
        """SELECT `columns` of the user's facts, live at `now`, that satisfy `where`."""
        live, live_p = _live(now)
        q, params = f"SELECT {columns} FROM facts f WHERE f.user_id=?{live}", [user_id, *live_p]
        if where is not None:
            q += f" AND {where[0]}"
            params += where[1]
        return q, params

    def at_most(self, bounds: list[tuple[str, list]], cap: int) -> int:
        """The least row count of the `filters.bounds` queries, counted up to `cap` (`cap` when
        there are none): an upper bound on a filter's matches, cheap because each stops at `cap`."""
        least = cap
        for sql, params in bounds:
            n = self.sql.query(f"SELECT COUNT(*) FROM ({sql} LIMIT ?) b", (*params, cap)).fetchone()[0]
            least = min(least, int(n))
        return least

    def fact(self, user_id: str, fact_id: str, now: float | None = None) -> FactRow | None:
        live, live_p = _live(now)
        r = self.sql.query(f"SELECT {self._FACT_COLS} FROM facts f WHERE f.user_id=? AND f.fact_id=?{live}",
                           (user_id, fact_id, *live_p)).fetchone()
        return FactRow(*r) if r else None

    def facts_by_fact_ids(self, user_id: str, fact_ids: list[str], now: float | None = None) -> dict[str, FactRow]:
        """The user's rows of these fact ids (unknown ids absent)."""
        live, live_p = _live(now)
        out: dict[str, FactRow] = {}
        ids = list(dict.fromkeys(fact_ids))
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            q = (f"SELECT {self._FACT_COLS} FROM facts f WHERE f.user_id=? "
                 f"AND f.fact_id IN ({','.join('?' * len(chunk))}){live}")
            rows = self.sql.query(q, (user_id, *chunk, *live_p))
            out.update((row.fact_id, row) for row in (FactRow(*r) for r in rows))
        return out

    def facts_by_index_ids(self, user_id: str, ids: list[int], now: float | None = None,
                           where: tuple[str, list] | None = None) -> dict[int, FactRow]:
        """The user's rows of these index ids (unknown ids, and those `where` refuses, absent)."""
        live, live_p = _live(now)
        cond, cond_p = (f" AND {where[0]}", where[1]) if where is not None else ("", [])
        out: dict[int, FactRow] = {}
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            q = (f"SELECT {self._FACT_COLS} FROM facts f WHERE {self.by_id_first}f.user_id=? "
                 f"AND f.id IN ({','.join('?' * len(chunk))}){live}{cond}")
            out.update((r[0], FactRow(*r)) for r in self.sql.query(q, (user_id, *chunk, *live_p, *cond_p)))
        return out

    def embeddings(self, user_id: str) -> tuple[np.ndarray, np.ndarray]:
        rows = self.sql.query("SELECT id, embedding FROM facts WHERE user_id=? ORDER BY id", (user_id,)).fetchall()
        ids = np.asarray([r[0] for r in rows], dtype=np.int64)
        vecs = np.stack([np.frombuffer(bytes(r[1]), dtype=np.float32) for r in rows]) if rows else None
        return ids, vecs

    # -- expiry ------------------------------------------------------------------------------
    def expired(self, user_id: str, now: float) -> list[str]:
        """Fact ids of the user's facts expired at `now` (still in the catalog until swept)."""
        return [r[0] for r in self.sql.query("SELECT fact_id FROM facts WHERE user_id=? AND expires_at <= ? "
                                             "ORDER BY id", (user_id, now))]

    def users_with_expired(self, now: float) -> list[str]:
        return [r[0] for r in self.sql.query("SELECT DISTINCT user_id FROM facts WHERE expires_at <= ? "
                                             "ORDER BY user_id", (now,))]

    # -- usage -------------------------------------------------------------------------------
    def usage(self, db, prefix: str) -> tuple[int, int]:
        """(facts, KV bytes) of every user whose id starts with `prefix` (a tenant's), read on
        `db` (inside a write transaction, to check a quota against what is committed)."""
        r = self.sql.execute(db, "SELECT COUNT(*), COALESCE(SUM(kv_bytes), 0) FROM facts WHERE user_id IN "
                                 "(SELECT user_id FROM users WHERE substr(user_id, 1, ?) = ?)",
                             (len(prefix), prefix)).fetchone()
        return int(r[0]), int(r[1])

    def usage_by_user(self) -> dict[str, tuple[int, int]]:
        """user id -> (facts, KV bytes), for every user with facts."""
        return {r[0]: (int(r[1]), int(r[2])) for r in self.sql.query(
            "SELECT user_id, COUNT(*), COALESCE(SUM(kv_bytes), 0) FROM facts GROUP BY user_id")}

    def users_uncounted(self, prefix: str) -> list[str]:
        """Users whose id starts with `prefix` holding facts whose KV bytes were never recorded."""
        return [r[0] for r in self.sql.query("SELECT DISTINCT user_id FROM facts WHERE kv_bytes IS NULL "
                                             "AND substr(user_id, 1, ?) = ?", (len(prefix), prefix))]

    def uncounted(self, user_id: str) -> list[tuple[str, str]]:
        """(fact id, kv key) of the user's facts whose KV bytes were never recorded."""
        return [tuple(r) for r in self.sql.query("SELECT fact_id, kv_key FROM facts WHERE user_id=? "
                                                 "AND kv_bytes IS NULL", (user_id,))]

    def set_kv_bytes(self, db, user_id: str, kv_key: str, kv_bytes: int) -> None:
        self.sql.execute(db, "UPDATE facts SET kv_bytes=? WHERE user_id=? AND kv_key=?",
                         (kv_bytes, user_id, kv_key))

    # -- writes ------------------------------------------------------------------------------
    def insert_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None, updated_at: float | None = None) -> None:
        """A new fact, created `now` (and last changed `updated_at`, by default then too)."""
        now = time.time() if now is None else now
        metadata, spelled = _meta_json(fact)
        row = self.sql.execute(db, "INSERT INTO facts (user_id, fact_id, text, source_turn, date, kv_key, "
                                   "embedding, version, metadata, expires_at, created_at, updated_at, kv_bytes) "
                                   "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?) RETURNING id",
                               (user_id, fact.id, fact.text, fact.source_turn, fact.date, kv_key, _blob(embedding),
                                version, spelled, getattr(fact, "expires_at", None), now,
                                now if updated_at is None else updated_at, kv_bytes)).fetchone()
        self._insert_meta(db, user_id, row[0], metadata)

    def update_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None) -> None:
        """Replace a fact's text, metadata and expiry (all three from `fact`) and its KV key."""
        self.sql.execute(db, "UPDATE facts SET text=?, kv_key=?, embedding=?, kv_bytes=? "
                             "WHERE user_id=? AND fact_id=?", (fact.text, kv_key, _blob(embedding), kv_bytes, user_id,
                                                               fact.id))
        self.set_fields(db, user_id, fact, version, now)

    def set_fields(self, db, user_id: str, fact, version: int, now: float | None = None) -> None:
        """Replace the metadata and expiry of the fact `fact.id` (its text and KV stay)."""
        metadata, spelled = _meta_json(fact)
        row = self.sql.execute(db, "UPDATE facts SET metadata=?, expires_at=?, version=?, updated_at=? "
                                   "WHERE user_id=? AND fact_id=? RETURNING id",
                               (spelled, getattr(fact, "expires_at", None), version,
                                time.time() if now is None else now, user_id, fact.id)).fetchone()
        self.sql.execute(db, "DELETE FROM fact_meta WHERE fact=?", (row[0],))
        self._insert_meta(db, user_id, row[0], metadata)

    def _insert_meta(self, db, user_id: str, fact_row: int, metadata: dict) -> None:
        for key, kind, sval, nval in meta_rows(metadata):
            self.sql.execute(db, "INSERT INTO fact_meta (fact, user_id, key, kind, sval, nval) "
                                 "VALUES (?,?,?,?,?,?)", (fact_row, user_id, key, kind, sval, nval))

    def set_kv_key(self, db, user_id: str, fact_id: str, kv_key: str, version: int,
                   kv_bytes: int | None = None) -> None:
        self.sql.execute(db, "UPDATE facts SET kv_key=?, version=?, kv_bytes=? WHERE user_id=? AND fact_id=?",
                         (kv_key, version, kv_bytes, user_id, fact_id))

    def delete_fact(self, db, user_id: str, fact_id: str) -> None:
        # its fact_meta rows go with it (ON DELETE CASCADE)
        self.sql.execute(db, "DELETE FROM facts WHERE user_id=? AND fact_id=?", (user_id, fact_id))


class HistoryTable:
    """Each fact's events (ADD, UPDATE, DELETE, REENCODE, IMPORT), oldest first."""

    def __init__(self, sql: SQLRunner) -> None:
        self.sql = sql

    def history(self, user_id: str, fact_id: str, limit: int | None = None, after: int | None = None) -> list[dict]:
        """Events oldest first: id, version, event, old_text, new_text, ts, metadata, expires_at."""
        q = "SELECT id, version, event, old_text, new_text, ts, fields FROM history WHERE user_id=? AND fact_id=?"
        out = []
        for r in self.sql.query(*paged(q, [user_id, fact_id], "id", after, limit)):
            fields = loads(r[6])
            out.append({**dict(zip(("id", "version", "event", "old_text", "new_text", "ts"), r[:6])),
                        "metadata": fields.get("metadata", {}), "expires_at": fields.get("expires_at")})
        return out

    def forget_history(self, db, user_id: str, fact_id: str) -> None:
        """Erase what a fact's history events said (texts, metadata): the events stay, empty."""
        self.sql.execute(db, "UPDATE history SET old_text=NULL, new_text=NULL, fields=NULL "
                             "WHERE user_id=? AND fact_id=?", (user_id, fact_id))

    def log(self, db, user_id: str, fact_id: str, version: int, event: str, old_text: str | None,
            new_text: str | None, ts: float | None = None, fact=None) -> None:
        """Record an event; `fact`: the fact after it (its metadata and expiry are kept with it)."""
        fields = {k: v for k, v in (("metadata", getattr(fact, "metadata", None)),
                                    ("expires_at", getattr(fact, "expires_at", None))) if v}
        self.sql.execute(db, "INSERT INTO history (user_id, fact_id, version, event, old_text, new_text, ts, fields) "
                             "VALUES (?,?,?,?,?,?,?,?)", (user_id, fact_id, version, event, old_text, new_text,
                                                          time.time() if ts is None else ts,
                                                          dumps(fields) if fields else None))


def _blob(embedding: np.ndarray) -> bytes:
    return np.asarray(embedding, dtype=np.float32).tobytes()


