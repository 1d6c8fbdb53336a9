"""The local KV backend: one store directory per user in the format of `storage.format`.

    store = Store.open_or_create(path, meta); store.put(kvs); store.get_compact(["f3~9c1e~7"])
    cache = ManifestCache(); reader = cache.open(path)   # readers: skip parsing an unchanged manifest
    kv = LocalKV(root); kv.open_or_create(user, meta); kv.read(user)   # every user's store under a root

`Store` is a `protocols.FactStore` and `LocalKV` a `protocols.KVBackend`.

See `inferscale.common.storage.format` for the layout on disk, the checks on open and the
crash-safety of every write.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import uuid
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from inferscale.common.storage.atomic import atomic_write_bytes
from inferscale.common.storage.format import (
    READABLE_VERSIONS,
    ChecksumError,
    CompactKV,
    FactKV,
    FormatVersionError,
    StoreError,
    StoreMeta,
    UnknownFactError,
    check_put,
    compact_from,
    fact_entry,
    fact_from,
    fact_tensors,
)
from inferscale.common.storage.paths import shared_store_dir, user_store_dir


class Store:
    """A KV store directory: create, open (with compatibility checks), put and get facts.

    The manifest on disk is the only source of truth; a Store object holds a copy that it reloads
    with `refresh()`. One writer at a time per directory (the memory service serialises writers).
    """

    MANIFEST = "manifest.json"

    def __init__(self, path: Path, meta: StoreMeta, manifest: dict) -> None:
        self.path = path
        self.meta = meta
        self._manifest = manifest
        self._verified: dict[str, dict[str, np.ndarray]] = {}  # small cache of verified shards

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, meta: StoreMeta) -> "Store":
        path = Path(path)
        if (path / cls.MANIFEST).exists():
            raise FileExistsError(f"a store already exists at {path}; open it instead")
        manifest = {"meta": asdict(meta), "facts": {}, "shards": {}}
        (path / "shards").mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path / cls.MANIFEST, json.dumps(manifest, indent=1).encode())
        return cls(path, meta, manifest)

    @classmethod
    def open(cls, path: str | Path, expect: StoreMeta | None = None, any_dtype: bool = False) -> "Store":
        """Open an existing store; with `expect`, refuse one written for something else (of another
        dtype too, unless `any_dtype`)."""
        path = Path(path)
        mf = path / cls.MANIFEST
        if not mf.is_file():
            raise FileNotFoundError(f"no InferScale store at {path} (missing {cls.MANIFEST})")
        try:
            manifest = json.loads(mf.read_text())
            raw = manifest["meta"]
        except (json.JSONDecodeError, KeyError) as e:
            raise StoreError(f"store manifest {mf} is unreadable: {e}") from None
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise FormatVersionError(
                f"store at {path} has format version {version!r}; this InferScale reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        meta = StoreMeta(**raw)
        if expect is not None:
            meta.check_compatible(expect, any_dtype)
        return cls(path, meta, manifest)

    @classmethod
    def open_or_create(cls, path: str | Path, meta: StoreMeta) -> "Store":
        """The store at `path`, created with `meta` if there is none; an existing store of the same
        model and layout opens whatever its dtype (it keeps its own: `meta.dtype` is for new ones)."""
        if (Path(path) / cls.MANIFEST).exists():
            return cls.open(path, expect=meta, any_dtype=True)
        return cls.create(path, meta)

    def refresh(self) -> None:
        self._manifest = json.loads((self.path / self.MANIFEST).read_text())

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, fact_id: str) -> bool:
        return fact_id in self._manifest["facts"]

    def __len__(self) -> int:
        return len(self._manifest["facts"])

    def fact_ids(self) -> list[str]:
        return list(self._manifest["facts"])

    def missing(self, fact_ids: list[str]) -> list[str]:
        """The ids among `fact_ids` this store does not hold."""
        return [f for f in fact_ids if f not in self._manifest["facts"]]

    def info(self, fact_id: str) -> dict:
        try:
            return dict(self._manifest["facts"][fact_id])
        except KeyError:
            raise UnknownFactError(f"store at {self.path} has no fact {fact_id!r}") from None

    # -- writing ---------------------------------------------------------------------------
    MAX_FACTS_PER_SHARD = 16  # bounds what deleting one fact rewrites

    def _write_shard(self, facts: list[FactKV], manifest: dict) -> None:
        """Write one shard holding `facts` (fsynced) and record it and its facts in `manifest`."""
        tensors: dict[str, np.ndarray] = {}
        entries = {}
        for f in facts:
            tensors.update(fact_tensors(self.meta, f))
            entries[f.fact_id] = fact_entry(f)
        data = st_save(tensors, metadata={"format_version": str(self.meta.format_version)})
        name = f"{uuid.uuid4().hex}.safetensors"
        atomic_write_bytes(self.path / "shards" / name, data)
        for fid, e in entries.items():
            manifest["facts"][fid] = {**e, "shard": name}
        manifest["shards"][name] = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "facts": sorted(entries),
        }

    def _commit(self, manifest: dict) -> None:
        """Write `manifest` atomically, then remove the shards it no longer references."""
        dead = self._drop_unreferenced(manifest)
        atomic_write_bytes(self.path / self.MANIFEST, json.dumps(manifest, indent=1).encode())
        self._manifest = manifest
        self._remove_shards(dead)

    def put(self, facts: list[FactKV]) -> list[str]:
        """Commit a batch of facts (new shards of at most MAX_FACTS_PER_SHARD facts, one manifest
        write); facts with existing ids are replaced. Returns the new shards' names."""
        seen = check_put(self.meta, facts)
        manifest = json.loads(json.dumps(self._manifest))  # deep copy; commit only on success
        before = set(manifest["shards"])
        replaced = [fid for fid in seen if fid in manifest["facts"]]
        if replaced:  # the old bytes of a replaced fact must not survive in a shard it shared
            self._forget(manifest, replaced)
        for i in range(0, len(facts), self.MAX_FACTS_PER_SHARD):
            self._write_shard(facts[i : i + self.MAX_FACTS_PER_SHARD], manifest)
        self._commit(manifest)
        return sorted(set(manifest["shards"]) - before)

    def delete(self, fact_ids: list[str]) -> None:
        """Remove facts so that none of their bytes (tokens, text, K, V) stay in any file: a shard
        that also holds surviving facts is rewritten without them, then the manifest commits and
        the old shards are deleted. A crash leaves either the old or the new state."""
        manifest = json.loads(json.dumps(self._manifest))
        for fid in fact_ids:
            if fid not in manifest["facts"]:
                raise UnknownFactError(f"store at {self.path} has no fact {fid!r}")
        self._forget(manifest, list(dict.fromkeys(fact_ids)))
        self._commit(manifest)

    def _forget(self, manifest: dict, fact_ids: list[str]) -> None:
        """Drop `fact_ids` from `manifest`, re-writing the survivors of every shard they were in."""
        touched = {manifest["facts"][fid]["shard"] for fid in fact_ids}
        for fid in fact_ids:
            del manifest["facts"][fid]
        survivors = [fid for fid, e in manifest["facts"].items() if e["shard"] in touched]
        for fid in survivors:
            del manifest["facts"][fid]  # re-added by _write_shard in their new shard
        for i in range(0, len(survivors), self.MAX_FACTS_PER_SHARD):
            self._write_shard(self.get(survivors[i : i + self.MAX_FACTS_PER_SHARD]), manifest)

    @staticmethod
    def _drop_unreferenced(manifest: dict) -> list[str]:
        live = {e["shard"] for e in manifest["facts"].values()}
        dead = [s for s in manifest["shards"] if s not in live]
        for s in dead:
            del manifest["shards"][s]
        return dead

    def _remove_shards(self, names: list[str]) -> None:
        for s in names:
            self._verified.pop(s, None)
            (self.path / "shards" / s).unlink(missing_ok=True)

    # -- reading ---------------------------------------------------------------------------
    def _shard(self, name: str) -> dict[str, np.ndarray]:
        if name in self._verified:
            return self._verified[name]
        path = self.path / "shards" / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ChecksumError(f"store shard {name} named by the manifest is missing") from None
        want = self._manifest["shards"][name]["sha256"]
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise ChecksumError(
                f"store shard {name} is corrupted: sha256 {got[:16]}... != committed {want[:16]}..."
            )
        tensors = st_load(data)
        if len(self._verified) >= 8:
            self._verified.pop(next(iter(self._verified)))
        self._verified[name] = tensors
        return tensors

    def discard_uncommitted(self) -> list[str]:
        """Remove the files under `shards/` the manifest does not name (a shard or temporary file
        written by a write that never committed); their names. Only with the writer's lock held:
        a concurrent writer's shard is uncommitted until its manifest lands."""
        named = set(self._manifest["shards"])
        gone = []
        for p in (self.path / "shards").glob("*"):
            if p.name not in named:
                p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone

    def verify(self) -> list[str]:
        """Read every shard the manifest names and check its sha256; the problems found (empty: all
        committed KV is intact)."""
        problems = []
        for name in self._manifest["shards"]:
            self._verified.pop(name, None)
            try:
                self._shard(name)
            except ChecksumError as e:
                problems.append(str(e))
        return problems

    def get_compact(self, fact_ids: list[str]) -> list[CompactKV]:
        """Load facts' KV as stored (codes and scales; no dequantisation), verifying each shard."""
        self._check_known(fact_ids)
        return [self._compact(fid, self._shard(self._manifest["facts"][fid]["shard"])) for fid in fact_ids]

    def _compact(self, fid: str, t: dict[str, np.ndarray]) -> CompactKV:
        """One fact's KV from its (verified) shard's tensors `t`."""
        return compact_from(self.meta, fid, t)

    def _check_known(self, fact_ids: list[str]) -> None:
        missing = [f for f in fact_ids if f not in self._manifest["facts"]]
        if missing:
            raise UnknownFactError(f"store at {self.path} has no facts {missing}")

    def get(self, fact_ids: list[str]) -> list[FactKV]:
        """Load facts (verifying each shard's checksum), in the order asked; quantised KV comes back
        as its float32 reference dequantisation (`CompactKV.values`)."""
        self._check_known(fact_ids)
        out = []
        for fid in fact_ids:
            e = self._manifest["facts"][fid]
            out.append(fact_from(self.meta, fid, self._shard(e["shard"]), e))
        return out


class ManifestCache:
    """Stores opened for reading without parsing an unchanged manifest again.

    `open(path)` stats the manifest and reuses the manifest it parsed last for that path while the
    file's identity (inode, modification time, size) is unchanged; every commit writes a new file
    and renames it into place, so a commit changes the inode. The cached manifest is shared by the
    stores handed out, which never modify it in place (`put` and `delete` commit a copy). Only for
    readers: a writer opens the store itself (`Store.open_or_create`) under its lock, so what it commits is
    built on the manifest on disk. At most `capacity` paths are kept (least recently opened go).
    """

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._by_path: OrderedDict[Path, tuple[tuple[int, int, int], StoreMeta, dict]] = OrderedDict()

    def open(self, path: str | Path, expect: StoreMeta | None = None, any_dtype: bool = False) -> "Store":
        path = Path(path)
        try:
            st = (path / Store.MANIFEST).stat()
        except FileNotFoundError:
            with self._lock:
                self._by_path.pop(path, None)  # a deleted store: keep none of its manifest
            return Store.open(path, expect, any_dtype)  # raises the store's own error
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # taken before reading: a later commit misses
        with self._lock:
            hit = self._by_path.get(path)
            if hit is not None and hit[0] != stamp:
                hit = None
            if hit is not None:
                self._by_path.move_to_end(path)
        if hit is not None:
            if expect is not None:
                hit[1].check_compatible(expect, any_dtype)
            return Store(path, hit[1], hit[2])
        store = Store.open(path, expect, any_dtype)
        with self._lock:
            self._by_path[path] = (stamp, store.meta, store._manifest)
            self._by_path.move_to_end(path)
            while len(self._by_path) > self.capacity:
                self._by_path.popitem(last=False)
        return store


class LocalKV:
    """Each user's KV in a store directory under the memory root (a `protocols.KVBackend`)."""

    shared = False

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._readers = ManifestCache()

    def open(self, user: str, expect: StoreMeta | None = None) -> Store:
        """The user's store; FileNotFoundError when the user has none."""
        return Store.open(user_store_dir(self.root, user), expect=expect)

    def open_or_create(self, user: str, meta: StoreMeta) -> Store:
        return Store.open_or_create(user_store_dir(self.root, user), meta)

    def open_reader(self, user: str, meta: StoreMeta) -> Store:
        """The user's store for reading (created when missing): its manifest is parsed again only
        when a commit changed it (`ManifestCache`), so a request does not re-read it. Writers use
        `open_or_create` under the user's lock."""
        path = user_store_dir(self.root, user)
        try:
            return self._readers.open(path, expect=meta, any_dtype=True)
        except FileNotFoundError:  # a user with no KV yet
            return Store.open_or_create(path, meta)

    def read(self, user: str) -> Store:
        """The user's store for reading, through the `ManifestCache`; FileNotFoundError when the
        user has none (nothing is created)."""
        return self._readers.open(user_store_dir(self.root, user))

    def open_shared(self, fingerprint: str, expect: StoreMeta | None = None) -> Store:
        """The model-level store (the prompt header's KV; one model per memory root)."""
        return Store.open(shared_store_dir(self.root), expect=expect)

    def open_or_create_shared(self, meta: StoreMeta) -> Store:
        return Store.open_or_create(shared_store_dir(self.root), meta)

    def read_shared(self, fingerprint: str) -> Store:
        """The model-level store for reading, through the `ManifestCache`; FileNotFoundError when
        there is none (nothing is created)."""
        return self._readers.open(shared_store_dir(self.root))

    def delete_user(self, user: str) -> None:
        shutil.rmtree(user_store_dir(self.root, user), ignore_errors=True)

    def describe(self) -> str:
        return "local files"
