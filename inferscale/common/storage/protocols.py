"""The storage interfaces, as `typing.Protocol`s: what the memory service, the serving layer and the
vLLM connector may call, whichever backend is behind it.

    FactStore       one store of fact KV: `Store` (local files), `RedisStore` (the shared tier)
    KVBackend       where every user's store lives: `LocalKV` (local_store), `RedisKV` (redis_store)
    CatalogBackend  the source of truth, `Catalog` (SQLite, PostgreSQL): the sum of one small
                    protocol per concern, which is what a part of the service asks for:
      Transactions  connections, transactions, snapshots and writer locks
      UserRows      users, incarnations and versions
      JobRows       background extraction jobs
      TurnRows      the conversation's turns
      FactRows      facts, their rows and embeddings
      UsageRows     expiry and usage (quotas)
      HistoryRows   each fact's events

Every protocol is `runtime_checkable`, so `isinstance(x, FactStore)` checks that an object has
every member named here (not their signatures). Facts are keyed by the versioned kv key the catalog
holds (`<fact id>~<incarnation>~<version>`), and KV under a key never changes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import numpy as np

from inferscale.common.storage.format import CompactKV, FactKV, StoreMeta


@runtime_checkable
class FactStore(Protocol):
    """One store of fact KV (a user's, or the model-level one holding the prompt header).

    A store is written by one writer at a time (the memory service holds the user's lock); readers
    never wait. Reads verify every byte they return against the checksum written with it."""

    meta: StoreMeta  # what the KV is valid for (model, layout, w, context, dtype)

    def __contains__(self, fact_id: str) -> bool:
        """Whether the store holds this fact's KV (False for KV an evicting tier lost)."""

    def fact_ids(self) -> list[str]:
        """The ids of every fact the store records."""

    def missing(self, fact_ids: list[str]) -> list[str]:
        """The ids among `fact_ids` whose KV the store does not hold, in order (one round trip)."""

    def info(self, fact_id: str) -> dict:
        """The fact's entry (token ids as "tokens", "n_tokens", text, ...); UnknownFactError if none."""

    def put(self, facts: list[FactKV]) -> list[str]:
        """Commit a batch atomically (all or nothing); facts with existing ids are replaced.
        ValueError for a batch this store cannot hold (empty, another KV shape, repeated ids)."""

    def delete(self, fact_ids: list[str]) -> None:
        """Remove these facts atomically, leaving none of their bytes; UnknownFactError (and nothing
        removed) if any id is unknown."""

    def get(self, fact_ids: list[str]) -> list[FactKV]:
        """The facts' KV in the order asked (quantised KV dequantised to float32); UnknownFactError
        for an id without KV, ChecksumError for corrupted bytes."""

    def get_compact(self, fact_ids: list[str]) -> list[CompactKV]:
        """As `get`, the KV as stored (codes and scales, no dequantisation)."""

    def verify(self) -> list[str]:
        """Check every fact's bytes; the problems found (empty: all committed KV is intact)."""

    def discard_uncommitted(self) -> list[str]:
        """Remove what an interrupted write left that no commit references (local: shard and
        temporary files; Redis: nothing, its writes are transactions); the names removed. Call
        with the writer's lock held."""


@runtime_checkable
class KVBackend(Protocol):
    """Where every user's store and the model-level store live (`open_kv` picks one by URL).

    `open*` with `expect` refuse a store written for something else (`ModelMismatchError`, or
    `FormatVersionError`); the `*_or_create` ones create a missing store with `meta`, and an existing
    store of the same model keeps its own dtype. Writers open under the user's lock; `read` and
    `read_shared` are for readers and never create anything."""

    shared: bool  # True when every replica reads and writes the same KV (Redis)

    def open(self, user: str, expect: StoreMeta | None = None) -> FactStore:
        """The user's store; FileNotFoundError when the user has none."""

    def open_or_create(self, user: str, meta: StoreMeta) -> FactStore:
        """The user's store, created with `meta` when missing (for writers)."""

    def open_reader(self, user: str, meta: StoreMeta) -> FactStore:
        """The user's store for reads outside the lock, created when missing; never for a write."""

    def read(self, user: str) -> FactStore:
        """The user's store for reading, as last committed; FileNotFoundError when the user has none
        (nothing is created). An unchanged local manifest is not parsed again."""

    def open_shared(self, fingerprint: str, expect: StoreMeta | None = None) -> FactStore:
        """The model-level store (the prompt header's KV); FileNotFoundError when there is none."""

    def open_or_create_shared(self, meta: StoreMeta) -> FactStore:
        """The model-level store of `meta`'s model, created when missing (for writers)."""

    def read_shared(self, fingerprint: str) -> FactStore:
        """The model-level store for reading; FileNotFoundError when there is none (nothing is
        created). An unchanged local manifest is not parsed again."""

    def delete_user(self, user: str) -> None:
        """Remove every byte of the user's KV (no error when there is none)."""

    def describe(self) -> str:
        """Where the KV lives, for messages (no credentials)."""


# The catalog, by concern. Every query is scoped by one user id. Methods taking `db` run inside the
# caller's `transaction()` and commit with it; the others read the last committed state (inside
# `snapshot()`: one consistent state for every query).
@runtime_checkable
class Transactions(Protocol):
    """Connections, transactions, snapshots and the per-user writer locks."""

    def transaction(self) -> AbstractContextManager[Any]:
        """One atomic write: yields the connection to pass as `db`; ROLLBACK on any error."""

    def snapshot(self) -> AbstractContextManager[Any]:
        """A read transaction: every query inside sees the same committed state."""

    def locks(self) -> Any:
        """Per-user writer locks (`hold(user)`, `hold_name(dir name)`) every process sharing the
        catalog respects."""

    def checkpoint(self) -> None:
        """Make deleted text leave the database's logs (a no-op where there are none to trim)."""

    def purge_user_storage(self) -> None:
        """Reclaim the space of deleted rows where the backend keeps them until then."""

    def lock_scope(self, db, name: str) -> None:
        """Serialise, until they commit, the write transactions that lock `name` (quota checks)."""

    def close(self) -> None:
        """Close every connection this catalog opened (any thread's)."""


@runtime_checkable
class UserRows(Protocol):
    """Users: their ids, incarnations and memory versions."""

    def users(self, prefix: str = "", limit: int | None = None, after: str | None = None) -> list[str]:
        """User ids starting with `prefix`, sorted (a page of `limit` after `after`)."""

    def user_exists(self, user_id: str) -> bool: ...

    def ensure_user(self, db, user_id: str, incarnation: str) -> None:
        """Create the user (version 0) unless it exists."""

    def incarnation(self, user_id: str) -> str | None:
        """The user's incarnation (drawn at creation); None for an unknown user."""

    def version(self, user_id: str) -> int:
        """The user's memory version; 0 for an unknown user."""

    def bump_version(self, db, user_id: str) -> int:
        """Increment the user's version; the new one."""

    def delete_user(self, db, user_id: str) -> None:
        """Delete the user and every row of theirs."""


@runtime_checkable
class JobRows(Protocol):
    """Background extraction jobs (`memory.jobs`)."""

    def insert_job(self, db, user_id: str, job_id: str, turn_ids: str) -> bool:
        """Queue a job of the user's (turn ids as JSON); False when one of that id exists."""

    def job(self, user_id: str, job_id: str) -> Any:
        """The job's `JobRow`; None when unknown."""

    def jobs(self, user_id: str, unfinished: bool = False) -> list:
        """The user's jobs (`JobRow`), oldest first; only queued and running ones if asked."""

    def set_job(self, user_id: str, job_id: str, state: str, outcome: str | None = None,
                error: str | None = None) -> None:
        """Move a job to `state`, with its outcome (JSON) or error."""


@runtime_checkable
class TurnRows(Protocol):
    """The conversation's turns, in order."""

    def turns(self, user_id: str, include_deleted: bool = False) -> list:
        """The user's turns (`TurnRow`) in conversation order; deleted ones (text None) if asked."""

    def turn(self, user_id: str, turn_id: str) -> Any:
        """The turn's `TurnRow`; None when unknown."""

    def next_seq(self, db, user_id: str) -> int:
        """The sequence number a turn appended to the user's conversation is stored at."""

    def insert_turn(self, db, user_id: str, seq: int, turn) -> None: ...

    def set_turn_text(self, db, user_id: str, turn_id: str, text: str | None) -> None:
        """Edit a turn; None deletes its text (it keeps its place)."""


@runtime_checkable
class FactRows(Protocol):
    """Facts (`FactRow`), their embeddings and KV keys. Reads with `now` skip facts expired by
    then; `where` is a filter as `filters.to_sql` makes it."""

    def facts(self, user_id: str, now: float | None = None, where: tuple[str, list] | None = None,
              limit: int | None = None, after: int | None = None) -> list:
        """The user's facts (`FactRow`) in the order they were added: a page after row id `after`."""

    def matching_ids(self, user_id: str, where: tuple[str, list] | None, now: float | None) -> np.ndarray:
        """Row ids of the user's live facts that satisfy the filter."""

    def at_most(self, bounds: list[tuple[str, list]], cap: int) -> int:
        """An upper bound on a filter's matches from its `filters.bounds` queries, counted up to `cap`."""

    def optimize(self) -> None:
        """Refresh the query planner's statistics where the backend needs it (filters choose their
        plan by them)."""

    def fact(self, user_id: str, fact_id: str, now: float | None = None) -> Any:
        """The fact's `FactRow`; None when unknown."""

    def facts_by_fact_ids(self, user_id: str, fact_ids: list[str], now: float | None = None) -> dict:
        """{fact id: `FactRow`} of these ids (unknown ids absent)."""

    def facts_by_index_ids(self, user_id: str, ids: list[int], now: float | None = None,
                           where: tuple[str, list] | None = None) -> dict:
        """{row id: `FactRow`} of these vector-index ids (unknown ids, and those `where` refuses, absent)."""

    def insert_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None, updated_at: float | None = None) -> None:
        """A new fact with its metadata and expiry (from `fact`), created `now` (and updated then
        unless `updated_at` says when)."""

    def update_fact(self, db, user_id: str, fact, kv_key: str, embedding: np.ndarray, version: int,
                    kv_bytes: int | None = None, now: float | None = None) -> None:
        """Replace the text, metadata and expiry of the fact `fact.id` and point it at new KV."""

    def set_fields(self, db, user_id: str, fact, version: int, now: float | None = None) -> None:
        """Replace the metadata and expiry of the fact `fact.id` (text and KV unchanged)."""

    def set_kv_key(self, db, user_id: str, fact_id: str, kv_key: str, version: int,
                   kv_bytes: int | None = None) -> None:
        """Point a re-encoded fact at its new KV."""

    def delete_fact(self, db, user_id: str, fact_id: str) -> None: ...

    def embeddings(self, user_id: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(row ids, their embeddings) of the user's facts; embeddings None when there are none."""


@runtime_checkable
class UsageRows(Protocol):
    """Expiry (the sweep) and usage (facts and KV bytes, for quotas)."""

    def expired(self, user_id: str, now: float) -> list[str]:
        """Ids of the user's facts expired at `now`, not swept yet."""

    def users_with_expired(self, now: float) -> list[str]: ...

    def usage(self, db, prefix: str) -> tuple[int, int]:
        """(facts, KV bytes) of the users whose id starts with `prefix`, read on `db`."""

    def usage_by_user(self) -> dict[str, tuple[int, int]]: ...

    def users_uncounted(self, prefix: str) -> list[str]:
        """Users starting with `prefix` with facts whose KV bytes are not recorded."""

    def uncounted(self, user_id: str) -> list[tuple[str, str]]:
        """(fact id, kv key) of facts whose KV bytes are not recorded (written by an older version)."""

    def set_kv_bytes(self, db, user_id: str, kv_key: str, kv_bytes: int) -> None: ...


@runtime_checkable
class HistoryRows(Protocol):
    """Each fact's events (ADD, UPDATE, DELETE, REENCODE, IMPORT)."""

    def history(self, user_id: str, fact_id: str, limit: int | None = None, after: int | None = None) -> list[dict]:
        """The fact's events (id, version, event, old_text, new_text, ts, metadata, expires_at),
        oldest first: a page."""

    def forget_history(self, db, user_id: str, fact_id: str) -> None:
        """Erase what the fact's events said (texts, metadata); the events stay."""

    def log(self, db, user_id: str, fact_id: str, version: int, event: str, old_text: str | None,
            new_text: str | None, ts: float | None = None, fact=None) -> None:
        """Record an event (ADD, UPDATE, DELETE, REENCODE, IMPORT) of the fact; `fact`: the fact
        after it, whose metadata and expiry the event keeps."""


@runtime_checkable
class CatalogBackend(Transactions, UserRows, JobRows, TurnRows, FactRows, UsageRows, HistoryRows, Protocol):
    """The source of truth of every user's memory (`open_catalog` picks SQLite or PostgreSQL): every
    concern's protocol. A part of the service that needs only some asks for those."""
