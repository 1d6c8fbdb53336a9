"""What a crash or an interrupted delete can leave in a memory root, and its removal.

A user directory that no catalog user owns (delete-user interrupted after its commit, or a new
user's first add before its commit) is removed when the memory is opened and by the next write of
that user id; KV that no committed fact references, and shards or temporary files written but
never committed, are dropped at a user's first write (`recover`, under the user's writer lock). The
memory chain's links are not orphans: the chain keeps them (`memory.chain`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

from inferscale.common.prompt.chain_links import is_chain_key
from inferscale.common.storage.local_store import Store
from inferscale.common.storage.paths import user_dir
from inferscale.common.storage.protocols import CatalogBackend, FactStore, KVBackend

log = logging.getLogger("inferscale.memory")


class CrashRecovery:
    def __init__(self, root: Path, catalog: CatalogBackend, kv: KVBackend, locks,
                 open_store: Callable[[str], FactStore]) -> None:
        self.root, self.catalog, self.kv, self._locks, self._store = root, catalog, kv, locks, open_store
        self._recovered: set[str] = set()

    def _user_dir(self, user: str) -> Path:
        return user_dir(self.root, user)

    def remove_orphan_dirs(self) -> None:
        """Remove user directories no catalog user owns (see the module docstring)."""
        users = self.root / "users"
        live = {self._user_dir(u).name for u in self.catalog.users()}
        for d in sorted(p for p in users.iterdir() if p.name not in live):
            with self._locks.hold_name(d.name):
                if d.name in {self._user_dir(u).name for u in self.catalog.users()}:
                    continue  # committed meanwhile by another process
                log.info("removing the files of a user the catalog no longer has (%s)", d.name)
                self.purge_dir(d)

    @staticmethod
    def purge_dir(d: Path) -> None:
        try:
            shutil.rmtree(d)
        except FileNotFoundError:
            pass

    def recover(self, user: str) -> None:
        """Drop KV that no committed fact references (left by a crash before a commit); for a user id
        the catalog does not have, remove whatever files it left. Call with the user's lock held."""
        if user in self._recovered:
            return
        udir = self._user_dir(user)
        if not self.catalog.user_exists(user):
            self.purge_dir(udir)
            self.kv.delete_user(user)
        elif self.kv.shared or (udir / "kv" / Store.MANIFEST).exists():
            store = self._store(user)
            live = {r.kv_key for r in self.catalog.facts(user)}
            # the memory chain's links are kept: each names the exact prefix it holds (common.prompt.chain_links)
            orphans = [k for k in store.fact_ids() if k not in live and not is_chain_key(k)]
            if orphans:
                store.delete(orphans)
            store.discard_uncommitted()  # shards or temp files written but never committed
        self._recovered.add(user)

    def forget(self, user: str) -> None:
        """`user` was deleted: its next write checks its files again."""
        self._recovered.discard(user)
