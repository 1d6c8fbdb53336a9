"""The SQLite catalog: the embedded default, one file beside the memory root's KV.

    catalog = SQLiteCatalog(root / "catalog.sqlite", root / "locks")

WAL mode, one connection per thread, writer locks as files (`UserLocks`); the schema and every
query are `Catalog`'s (`inferscale.common.storage.catalog`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from inferscale.common.storage.catalog import Catalog
from inferscale.common.storage.locks import UserLocks


class SQLiteCatalog(Catalog):
    """The embedded default: one file beside the memory root's KV, writer locks as files."""

    _SQL_TYPES = {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "ref": "INTEGER", "blob": "BLOB", "real": "REAL",
                  "bytes_order": ""}  # TEXT compares as bytes (BINARY)

    _BY_ID_FIRST = "+"  # a unary plus keeps SQLite off the user_id index when a query names ids

    def __init__(self, path: str | Path, lock_dir: str | Path | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.url = str(self.path)
        self._locks = UserLocks(lock_dir if lock_dir is not None else self.path.parent / "locks")
        self._init_schema(lambda db, table: {r[1] for r in db.execute(f"PRAGMA table_info({table})")})
        self.optimize()

    def _connect(self):
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA secure_delete=ON")  # deleted text is overwritten, not left in free pages
        return conn

    def _begin_write(self, db) -> None:
        db.execute("BEGIN IMMEDIATE")

    def _begin_read(self, db) -> None:
        db.execute("BEGIN")

    def locks(self) -> UserLocks:
        return self._locks

    def optimize(self) -> None:
        """A bounded ANALYZE (milliseconds at any size): without statistics SQLite drives a filtered
        query from the user's whole index instead of the few facts the filter names."""
        self.db.execute("PRAGMA analysis_limit=1000")
        self.db.execute("ANALYZE")

    def checkpoint(self) -> None:
        """Copy the WAL into the database file and truncate it, so deleted text does not linger in
        the log (secure_delete already overwrote it in the database pages)."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
