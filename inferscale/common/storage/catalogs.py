"""Catalog backends by URL: "" is SQLite in the memory root, `postgresql://` is PostgreSQL.

    catalog = open_catalog("", root)                       # SQLiteCatalog(root / "catalog.sqlite")
    catalog = open_catalog("postgresql://host/db", root)   # PostgresCatalog, shared by replicas
"""

from __future__ import annotations

from pathlib import Path

from inferscale.common.storage.catalog import Catalog
from inferscale.common.storage.catalog_sqlite import SQLiteCatalog


def validate_catalog_url(url: str, what: str = "catalog") -> str:
    """`url` if it names a catalog: "" (SQLite in the memory root) or a postgresql:// URL."""
    if not isinstance(url, str) or (url and not url.startswith(("postgresql://", "postgres://"))):
        raise ValueError(f"{what} must be empty (SQLite in the memory root) or a postgresql:// URL, got {url!r}")
    return url


def open_catalog(url: str, root: str | Path) -> Catalog:
    """The catalog `url` names: "" for SQLite in `root`, or a `postgresql://` URL."""
    if not validate_catalog_url(url):
        return SQLiteCatalog(Path(root) / "catalog.sqlite", Path(root) / "locks")
    from inferscale.common.storage.catalog_postgres import PostgresCatalog

    return PostgresCatalog(url)
