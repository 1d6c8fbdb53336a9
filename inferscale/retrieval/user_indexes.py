"""The users' vector indexes, cached in this process; the catalog's embeddings are the real copy.

    indexes = UserIndexes(catalog, "auto", dim=384, path_of=lambda user: user_dir / "index.bin")
    scores, ids = indexes.search("alice", query_vector, k=5)
    indexes.apply("alice", version, add_ids=[...], add_vecs=..., remove_ids=[...])   # after a commit

An index is loaded from its file when that matches the catalog (same ids, same vectors), else
rebuilt from the catalog (a crash between a commit and the index save leaves a stale file) and
saved atomically (`path_of` None: kept in memory only, as with a shared catalog, where every
replica builds it from the catalog). A cached index is reloaded when another process committed a
newer version.
One lock guards the cache: held for a search or an index change (milliseconds), never for encoding.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np

from inferscale.retrieval.index_factory import make_index


class UserIndexes:
    def __init__(self, catalog, kind: str, dim: int, path_of: Callable[[str], Path]) -> None:
        self.catalog = catalog
        self.kind = kind
        self.dim = dim
        self.path_of = path_of
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, object]] = {}  # user -> (memory version, index)

    def search(self, user: str, query: np.ndarray, k: int, among: np.ndarray | None = None):
        """(scores [1, k], ids [1, k]) of the user's nearest facts (ids -1 past the end); `among`:
        only these ids are candidates."""
        with self._lock:
            return self._current(user).search(query, k, among=among)

    def apply(self, user: str, version: int, add_ids=(), add_vecs=None, remove_ids=()) -> None:
        """Bring the user's index to memory `version`, just committed: apply the change to the
        cached index when it holds the version before, else rebuild from the catalog (which already
        has the change). Saved atomically when it changed."""
        with self._lock:
            cached = self._cache.get(user)
            if cached is None or cached[0] != version - 1:
                self._rebuild(user)
                return
            idx = cached[1]
            if len(remove_ids):
                idx.remove(list(remove_ids))
            if len(add_ids):
                idx.add(list(add_ids), add_vecs)
            if (len(remove_ids) or len(add_ids)) and self.path_of(user) is not None:
                idx.save(self.path_of(user))
            self._cache[user] = (version, idx)

    def forget(self, user: str) -> None:
        with self._lock:
            self._cache.pop(user, None)

    def _current(self, user: str):
        cached = self._cache.get(user)
        if cached is None or cached[0] != self.catalog.version(user):
            return self._rebuild(user, load_first=True)
        return cached[1]

    def _rebuild(self, user: str, load_first: bool = False):
        path = self.path_of(user)
        with self.catalog.snapshot():
            version = self.catalog.version(user)
            ids, vecs = self.catalog.embeddings(user)
        idx = None
        if load_first and path is not None and path.is_file():
            try:
                idx = type(make_index(self.kind, dim=self.dim)).load(path)
                same = np.array_equal(idx.ids(), ids) and (not len(ids) or np.allclose(
                    idx.vectors(ids), vecs / np.linalg.norm(vecs, axis=1, keepdims=True), atol=1e-6))
                if not same:
                    idx = None  # stale (a crash between commit and index save): rebuild
            except (ValueError, OSError):
                idx = None
        if idx is None:
            idx = make_index(self.kind, dim=self.dim)
            if len(ids):
                idx.add(ids, vecs)
            if path is not None and path.parent.exists():
                idx.save(path)
        self._cache[user] = (version, idx)
        return idx
