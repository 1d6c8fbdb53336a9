"""What the catalog's tables run their SQL on: this thread's connection, a transaction's
connection, and transactions. `Catalog` provides it to each of its parts (`catalog_rows`,
`catalog_facts`); queries are written with `?` placeholders, and the backend's dialect rewrites
them where it needs to (PostgreSQL's `%s`).

    rows = sql.query("SELECT fact_id FROM facts WHERE user_id=?", (user,))
    with sql.transaction() as db:
        sql.execute(db, "UPDATE users SET version = version + 1 WHERE user_id=?", (user,))
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol


class SQLRunner(Protocol):
    def query(self, q: str, params: tuple = ()) -> Any:
        """Run `q` on this thread's connection (outside a transaction, or inside a snapshot);
        returns the cursor."""

    def execute(self, db: Any, q: str, params: tuple = ()) -> Any:
        """Run `q` on `db`, a transaction's connection; returns the cursor."""

    def transaction(self) -> ContextManager[Any]:
        """One atomic write: yields the connection, COMMIT on exit, ROLLBACK on any error."""
