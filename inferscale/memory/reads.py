"""The memory service's reads: facts, pages, filtered search, and the KV a serving engine reads.
A part of `MemoryService` (on its `core`: the catalog, indexes, stores and clock). Reads never wait
for a writer, and none returns a fact whose `expires_at` has passed (`core.clock()`), swept or not.

    svc.search("alice", "where do I work?", k=5, filters={"category": "work"})
    page = svc.list_page("alice", limit=100, filters={"tags": {"in": ["trip"]}})

A filtered search is exact whichever way it runs. A filter that matches few facts (at most `FEW`,
bounded by counting its conditions' index entries) has the catalog name them (indexed SQL), and
exactly those are scored. A broader one over-fetches: the top `OVERFETCH * k` of the whole index,
filtered in the catalog, is the answer when k of them pass; else the search runs among all the
matches. It never returns a fact outside the filter and finds k facts whenever k match.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from inferscale.common.facts import validate_id
from inferscale.common.bounds import clamp_time
from inferscale.common.pages import Page, check_limit, decode_cursor, page_of
from inferscale.common.storage.catalog import FactRow
from inferscale.common.storage.filters import NODE_TYPES, Node, bounds, parse_filter, to_sql
from inferscale.common.storage.format import FactKV, StoreError
from inferscale.memory.core import MemoryCore
from inferscale.memory.encoding import FactEncoding
from inferscale.memory.service_types import FactPlan, MemoryFact, UnknownFactError, UnknownUserError, _public
from inferscale.retrieval.embedders import Embedder, embed_query

Filters = Mapping | Node | None  # a request's JSON filter, or one parsed already


def readable_event(e: dict) -> dict:
    """A history event as reads return it: without its row id, times clamped into the range."""
    out = {k: v for k, v in e.items() if k != "id"}
    out["ts"] = clamp_time(out["ts"])
    expires = out.get("expires_at")
    out["expires_at"] = clamp_time(expires) if isinstance(expires, (int, float)) else None
    return out


def _node(filters: Filters) -> Node | None:
    return filters if filters is None or isinstance(filters, NODE_TYPES) else parse_filter(filters)


class MemoryReads:
    FEW = 4096  # a filter matching at most this many facts: the search scores exactly those
    OVERFETCH = 32  # a broader one first tries the top OVERFETCH * k of the whole index

    def __init__(self, core: MemoryCore, embedder: Embedder, encoding: FactEncoding) -> None:
        self.core, self.catalog, self.embedder, self.encoding = core, core.catalog, embedder, encoding

    def get(self, user: str, fact_id: str) -> MemoryFact:
        self.core.check_user(user)
        return _public(self.core.fact_row(user, fact_id, live=True))

    def list(self, user: str, filters: Filters = None) -> list[MemoryFact]:
        """Every live fact of the user's that satisfies `filters`, in the order they were added."""
        self.core.check_user(user)
        where = self._where(user, filters)
        return [_public(r) for r in self.catalog.facts(user, now=self.core.clock(), where=where)]

    def list_page(self, user: str, limit: int = 100, cursor: str | None = None, filters: Filters = None) -> Page:
        """One page of `list`: `limit` facts after the cursor, and the next page's cursor."""
        self.core.check_user(user)
        check_limit(limit)
        after = decode_cursor(cursor, "facts", int)
        rows = self.catalog.facts(user, now=self.core.clock(), where=self._where(user, filters), limit=limit + 1,
                                  after=after)
        rows, next_cursor = page_of(rows, limit, "facts", lambda r: r.id)
        return Page([_public(r) for r in rows], next_cursor)

    def history(self, user: str, fact_id: str) -> list[dict]:
        """The fact's events, oldest first."""
        return self.history_page(user, fact_id).items

    def history_page(self, user: str, fact_id: str, limit: int | None = None, cursor: str | None = None) -> Page:
        """A page of `history` (`limit` events after the cursor; all of them without a limit)."""
        self.core.check_user(user)
        validate_id("fact", fact_id)
        if limit is not None:
            check_limit(limit)
        events = self.catalog.history(user, fact_id, limit=None if limit is None else limit + 1,
                                      after=decode_cursor(cursor, "history", int))
        if not events and cursor is None:
            raise UnknownFactError(f"user {user!r} has no fact {fact_id!r}, now or before")
        events, next_cursor = page_of(events, limit, "history", lambda e: e["id"]) if limit else (events, None)
        return Page([readable_event(e) for e in events], next_cursor)

    def version(self, user: str) -> int:
        self.core.check_user(user)
        return self.catalog.version(user)

    def users(self) -> list[str]:
        """Every user with a memory."""
        return self.catalog.users()

    def users_page(self, prefix: str = "", limit: int = 100, cursor: str | None = None) -> Page:
        """A page of the user ids that start with `prefix` (a tenant's), sorted."""
        check_limit(limit)
        ids = self.catalog.users(prefix, limit + 1, decode_cursor(cursor, "users", str))
        ids, next_cursor = page_of(ids, limit, "users", lambda u: u)
        return Page(ids, next_cursor)

    def has_turn(self, user: str, turn_id: str) -> bool:
        """Whether `user` (who must exist) has turn `turn_id` with its text."""
        self.core.check_user(user)
        row = self.catalog.turn(user, turn_id)
        return row is not None and row.text is not None

    def search(self, user: str, query: str, k: int = 5, filters: Filters = None) -> list[MemoryFact]:
        """The user's k live facts nearest to `query` (cosine) among those that satisfy `filters`,
        best first."""
        q = self._query(user, query, k)
        return [_public(r, s) for r, s in self._nearest(user, q, k, filters)]

    def search_plan(self, user: str, query: str, k: int, filters: Filters = None) -> tuple[list[MemoryFact], FactPlan]:
        """`search`, and the `fact_plan` of its hits read from the same catalog snapshot: what a
        request serves, with the memory read once."""
        q = self._query(user, query, k)
        hits, plan = self._planned(user, lambda: self._nearest(user, q, k, filters))
        return [_public(r, s) for r, s in hits], plan

    def list_plan(self, user: str, filters: Filters = None) -> tuple[list[MemoryFact], FactPlan]:
        """`list`, and the `fact_plan` of those facts read from the same catalog snapshot."""
        self.core.check_user(user)
        where = self._where(user, filters)
        rows, plan = self._planned(user, lambda: [(r, None) for r in self.catalog.facts(user, now=self.core.clock(),
                                                                                        where=where)])
        return [_public(r) for r, _ in rows], plan

    def get_plan(self, user: str, fact_ids: Sequence[str]) -> tuple[list[MemoryFact], FactPlan]:
        """These live facts (`get`), and their `fact_plan`, from the same catalog snapshot."""
        self.core.check_user(user)
        rows, plan = self._planned(user, lambda: [(r, None) for r in self.core.fact_rows(user, fact_ids)])
        return [_public(r) for r, _ in rows], plan

    def _planned(self, user: str, read_rows: Callable[[], list[tuple[FactRow, float | None]]]
                 ) -> tuple[list[tuple[FactRow, float | None]], FactPlan]:
        """(rows, their `FactPlan`): `read_rows()` ((row, score) pairs) run in one catalog snapshot
        with the user's version and incarnation, again if a writer replaced a KV key meanwhile."""
        def read():
            with self.catalog.snapshot():
                version, incarnation = self.catalog.version(user), self.catalog.incarnation(user)
                rows = read_rows()
            if incarnation is None:
                raise UnknownUserError(f"unknown user {user!r}")
            store = self.encoding.ensure_kv(user, [r for r, _ in rows])
            return rows, FactPlan(version, incarnation,
                                  [(r.fact_id, r.kv_key, store.info(r.kv_key)["tokens"]) for r, _ in rows])

        return self._despite_writers(read)

    def _query(self, user: str, query: str, k: int):
        """The embedded query of a search, its arguments checked."""
        self.core.check_user(user)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("the search query is empty")
        self.core.limits.check_text(query, "the search query")
        return embed_query(self.embedder, query)

    def _nearest(self, user: str, q, k: int, filters: Filters) -> list[tuple[FactRow, float]]:
        """(row, score) of the k live facts nearest to the embedded query `q` that satisfy `filters`."""
        node = _node(filters)
        now = self.core.clock()
        if node is None and not self.catalog.expired(user, now):  # the whole index is the user's memory
            hits = self._hits(user, q, k, now, None)
            if hits is not None:
                return hits
        if self.catalog.at_most(bounds(node, user), self.FEW + 1) > self.FEW:  # broad: the index's best, filtered
            hits = self._overfetched(user, q, k, now, self._where(user, node, per_row=True))
            if hits is not None:
                return hits
        among = self.catalog.matching_ids(user, self._where(user, node), now)
        if not len(among):
            return []
        hits = self._hits(user, q, k, now, among)
        return hits if hits is not None else self._hits(user, q, k, self.core.clock(), among, strict=False)

    def _hits(self, user: str, q, k: int, now: float, among, strict: bool = True) -> list[tuple[FactRow, float]] | None:
        """The nearest facts' rows, or None when one of them changed or expired meanwhile (`strict`)."""
        scores, ids = self.core.indexes.search(user, q, k, among=among)
        hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        rows = self.catalog.facts_by_index_ids(user, [i for i, _ in hits], now)  # scoped to this user
        if strict and len(rows) < len(hits):
            return None
        return [(rows[i], s) for i, s in hits if i in rows]

    def _overfetched(self, user: str, q, k: int, now: float, where) -> list[tuple[FactRow, float]] | None:
        """The top `OVERFETCH * k` of the whole index, filtered in the catalog: the answer when k of
        them pass (no match outside them can score higher) or when they are the whole index; else
        None (a narrow filter: search among its matches)."""
        want = k * self.OVERFETCH
        scores, ids = self.core.indexes.search(user, q, want)
        hits = [(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]
        rows = self.catalog.facts_by_index_ids(user, [i for i, _ in hits], now, where)
        passing = [(i, s) for i, s in hits if i in rows]
        if len(passing) >= k or len(hits) < want:
            return [(rows[i], s) for i, s in passing[:k]]
        return None

    def _where(self, user: str, filters: Filters, per_row: bool = False) -> tuple[str, list] | None:
        node = _node(filters)
        return None if node is None else to_sql(node, user, per_row)

    # -- what a serving engine reads ----------------------------------------------------------
    def load_kv(self, user: str, fact_ids: Sequence[str]) -> list[FactKV]:
        """Current KV of the user's live facts, read from their store, in order (named by fact
        id); refuses unknown and expired ids."""
        self.core.check_user(user)

        def read() -> list[FactKV]:
            with self.catalog.snapshot():
                rows = self.core.fact_rows(user, fact_ids)
            kvs = self.encoding.ensure_kv(user, rows).get([r.kv_key for r in rows])
            for r, kv in zip(rows, kvs):
                kv.fact_id = r.fact_id
            return kvs

        return self._despite_writers(read)

    def fact_plan(self, user: str, fact_ids: Sequence[str]) -> FactPlan:
        """Version, incarnation and (fact_id, kv_key, token ids) of these live facts, from one snapshot."""
        self.core.check_user(user)
        return self._planned(user, lambda: [(r, None) for r in self.core.fact_rows(user, fact_ids)])[1]

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
