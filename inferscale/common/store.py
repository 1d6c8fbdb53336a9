"""Store format v2: per-fact token ids + pre-RoPE K and V for every layer, in safetensors shards.

Layout on disk::

    <store>/manifest.json              # StoreMeta + fact table (token ids, text, shard) + shard table
    <store>/shards/<uuid>.safetensors  # tensors "<fact_id>/tokens" [n] int32,
                                       #         "<fact_id>/k", "<fact_id>/v" [L, n, kv_heads, head_dim]
                                       #         "<fact_id>/k_scale", "<fact_id>/v_scale" [L, kv_heads,
                                       #             head_dim] float32 (int8 / fp8 stores, `kvquant`)
                                       #         "<fact_id>/embedding" [d] float32 (optional)

KV dtypes: float32, float16, bfloat16 (as they are), int8 and float8_e4m3 (codes + per-channel
scales whose RoPE pairs share one; `inferscale.common.kvquant`). `get` returns float32 for the
quantised ones (the reference dequantisation). Version 1 stores (float only) still open and
take new facts.

Every write goes to a temporary file that is fsynced and renamed into place, shard first, then
the manifest, so a crash loses at most the write in flight and never what was committed. The
manifest records the model fingerprint, RoPE convention (and, where layers differ, each layer's
RoPE and attention window: Gemma 3), dtype, KV scale scheme, the encoding context (`context`:
"turns", "facts" or "conversation") and its size `w`, the format version and a sha256 per shard;
`Store.open` refuses any mismatch with an error naming the field (`open_or_create`, which writers
and the memory service use, accepts a store of another dtype: a store keeps the dtype it was
created with), and a shard whose bytes changed is refused when it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .kvquant import QUANTIZED, dequantize, pair_partner, quantize

if TYPE_CHECKING:
    from .spec import ModelSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: float dtypes only, no scales
KV_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3")
# What each fact was encoded after (besides the prompt header): its `w` preceding conversation
# turns (Context-Window Encoding), the `w` facts before it in the memory rendered as the memory
# block renders them (list-context encoding), or its `w` preceding turns read from one pass over
# the conversation (the conversation encoding, `conversation_pass`).
ENCODING_CONTEXTS = ("turns", "facts", "conversation")


class StoreError(Exception):
    """Base class of store errors."""


class ModelMismatchError(StoreError):
    """The store was written for another model (fingerprint or RoPE convention differ)."""


class FormatVersionError(StoreError):
    """The store's format version is not one this code reads."""


class ChecksumError(StoreError):
    """A shard's bytes do not match the checksum the manifest committed."""


class UnknownFactError(StoreError, KeyError):
    """A fact id the store does not hold."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


@dataclass(frozen=True)
class StoreMeta:
    """What a store is valid for. Two stores are interchangeable iff their metas are equal."""

    model_fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: dict  # RopeSpec.to_dict()
    dtype: str = "float32"
    kv_scale: str = "none"  # quantisation scale scheme; "none" for float stores
    w: int = 0  # context window (turns or facts, see `context`) the facts were encoded with
    format_version: int = FORMAT_VERSION
    context: str = "turns"  # one of ENCODING_CONTEXTS (stores written before it existed: "turns")
    # per-layer {"rope": RopeSpec dict, "window": int | None} when layers differ (Gemma 3's sliding
    # and global layers); None when every layer uses `rope` and full attention
    layers: list | None = None

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"store dtype must be one of {KV_DTYPES}, got {self.dtype!r}")
        want_scale = "channel" if self.dtype in QUANTIZED else "none"
        if self.kv_scale != want_scale:
            raise ValueError(f"a {self.dtype} store needs kv_scale {want_scale!r}, got {self.kv_scale!r}")
        if self.w < 0:
            raise ValueError(f"w must be >= 0, got {self.w}")
        if self.context not in ENCODING_CONTEXTS:
            raise ValueError(f"store context must be one of {ENCODING_CONTEXTS}, got {self.context!r}")

    @classmethod
    def for_model(cls, spec: "ModelSpec", fingerprint: str, *, dtype: str = "float32", w: int = 0,
                  context: str = "turns") -> "StoreMeta":
        """The meta of a store holding `spec`'s KV (both encoders and the CLI build it here)."""
        return cls(fingerprint, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.rope.to_dict(),
                   dtype=dtype, kv_scale="channel" if dtype in QUANTIZED else "none", w=w, context=context,
                   layers=spec.layer_settings())

    def with_dtype(self, dtype: str) -> "StoreMeta":
        """The same store meta holding KV as `dtype` (its scale scheme follows)."""
        return replace(self, dtype=dtype, kv_scale="channel" if dtype in QUANTIZED else "none")

    def check_model(self, spec: "ModelSpec", fingerprint: str) -> None:
        """Raise unless the store holds KV of this model (any float dtype and w are servable)."""
        if self.model_fingerprint != fingerprint:
            raise ModelMismatchError("store was written for another model (weights fingerprint differs)")
        want = replace(StoreMeta.for_model(spec, fingerprint, dtype=self.dtype, w=self.w, context=self.context),
                       format_version=self.format_version)
        if self != want:
            raise ModelMismatchError("store has another KV shape or RoPE convention than the model")

    def check_compatible(self, other: "StoreMeta", any_dtype: bool = False) -> None:
        """Raise naming the first field where `other` (what the caller expects) differs; with
        `any_dtype`, a store of another dtype (and its scale layout) is accepted: `other` is what a
        new store would get, and an existing store keeps KV the way it was created."""
        if self.format_version not in READABLE_VERSIONS:
            raise FormatVersionError(
                f"store format version {self.format_version}, this code reads {READABLE_VERSIONS}"
            )
        if self.model_fingerprint != other.model_fingerprint:
            raise ModelMismatchError(
                "store was written for another model: fingerprint "
                f"{self.model_fingerprint[:16]}... != served model {other.model_fingerprint[:16]}..."
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "rope", "layers", "dtype", "kv_scale", "context", "w"):
            if any_dtype and name in ("dtype", "kv_scale"):
                continue
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                raise ModelMismatchError(f"store {name} is {a!r}, expected {b!r}")


@dataclass
class FactKV:
    """One fact's stored state. k and v: [num_layers, n_tokens, num_kv_heads, head_dim], pre-RoPE."""

    fact_id: str
    token_ids: np.ndarray  # [n] int32
    k: np.ndarray
    v: np.ndarray
    text: str = ""
    embedding: np.ndarray | None = None  # [d] float32
    source_turn: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        n = self.token_ids.shape[0]
        if self.token_ids.ndim != 1 or n == 0:
            raise ValueError(f"fact {self.fact_id!r}: token_ids must be a non-empty 1-D array")
        if self.k.shape != self.v.shape or self.k.ndim != 4 or self.k.shape[1] != n:
            raise ValueError(
                f"fact {self.fact_id!r}: k {self.k.shape} and v {self.v.shape} must both be "
                f"[layers, {n}, kv_heads, head_dim]"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


@dataclass
class CompactKV:
    """One fact's KV as its store keeps it, for the fused dequantise-rotate-write kernels.

    k, v: [L, n, KVH, D] in the store's `dtype`: float32 / float16 / bfloat16 values, int8 codes, or
    float8_e4m3 codes as uint8 bytes; k_scale, v_scale: [L, KVH, D] float32 for the quantised dtypes
    (x = code * scale, `kvquant`), None otherwise. `dequantized()` is the float32 reference, what
    `Store.get` returns."""

    fact_id: str
    token_ids: np.ndarray  # [n] int32
    k: np.ndarray
    v: np.ndarray
    dtype: str
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in (self.k, self.v, self.k_scale, self.v_scale) if x is not None)

    def values(self, which: str) -> np.ndarray:
        """Float K or V: the reference dequantisation (float32) of a quantised one, else as stored."""
        x, scale = (self.k, self.k_scale) if which == "k" else (self.v, self.v_scale)
        return dequantize(x, scale, self.dtype) if self.dtype in QUANTIZED else x

    def dequantized(self) -> FactKV:
        return FactKV(self.fact_id, self.token_ids, self.values("k"), self.values("v"))


def fact_kvs(facts, plans, kvs, meta: dict) -> list[FactKV]:
    """`FactKV`s of encoded facts: `plans` are their (context ids, fact ids), `kvs` their (k, v);
    `meta` is recorded on each (with the fact's date). Shared by both encoders."""
    return [FactKV(f.id, ids, k, v, text=f.text, source_turn=f.source_turn,
                   meta=dict(meta, date=f.date) if f.date else dict(meta))
            for f, (_, ids), (k, v) in zip(facts, plans, kvs)]


def _to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes  # jax's dependency; only needed for bf16 stores

        return np.ascontiguousarray(np.asarray(x).astype(ml_dtypes.bfloat16)).view(np.uint16)
    return np.ascontiguousarray(np.asarray(x, dtype=dtype))


def _from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return x.view(ml_dtypes.bfloat16)
    return x


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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


# -- one fact's tensors, shared by every KV backend (`Store`, `RedisStore`) ------------------------
def check_put(meta: StoreMeta, facts: list[FactKV]) -> set[str]:
    """Refuse a `put` batch a store of `meta` cannot hold (empty, a KV shape of another model, an
    id twice); returns the batch's ids."""
    if not facts:
        raise ValueError("put() needs at least one fact")
    seen: set[str] = set()
    for f in facts:
        want = (meta.num_layers, f.num_tokens, meta.num_kv_heads, meta.head_dim)
        if f.k.shape != want:
            raise ValueError(f"fact {f.fact_id!r}: KV shape {f.k.shape}, this store holds {want}")
        if f.fact_id in seen:
            raise ValueError(f"fact {f.fact_id!r} appears twice in one put()")
        seen.add(f.fact_id)
    return seen


def fact_tensors(meta: StoreMeta, f: FactKV) -> dict[str, np.ndarray]:
    """`f` as the named tensors a backend stores: tokens, K and V in `meta.dtype` (codes + scales for
    int8 / fp8), and the embedding when it has one."""
    t = {f"{f.fact_id}/tokens": f.token_ids}
    if meta.dtype in QUANTIZED:
        partner = pair_partner(meta.head_dim, meta.rope["rotary_dim"], meta.rope.get("style", "split"))
        t[f"{f.fact_id}/k"], t[f"{f.fact_id}/k_scale"] = quantize(f.k, meta.dtype, partner)
        t[f"{f.fact_id}/v"], t[f"{f.fact_id}/v_scale"] = quantize(f.v, meta.dtype)
    else:
        t[f"{f.fact_id}/k"] = _to_storage(f.k, meta.dtype)
        t[f"{f.fact_id}/v"] = _to_storage(f.v, meta.dtype)
    if f.embedding is not None:
        t[f"{f.fact_id}/embedding"] = np.asarray(f.embedding, dtype=np.float32)
    return t


def fact_entry(f: FactKV) -> dict:
    """What a backend records about `f` beside its tensors (read without reading the KV)."""
    return {
        "n_tokens": f.num_tokens,
        "tokens": f.token_ids.tolist(),  # lets a scheduler check prompt spans without reading KV
        "text": f.text,
        "source_turn": f.source_turn,
        "meta": f.meta,
    }


def compact_from(meta: StoreMeta, fid: str, t: dict[str, np.ndarray]) -> CompactKV:
    """Fact `fid`'s KV as stored, from the tensors `fact_tensors` wrote."""
    dtype, quantized = meta.dtype, meta.dtype in QUANTIZED
    return CompactKV(fid, t[f"{fid}/tokens"], _from_storage(t[f"{fid}/k"], dtype), _from_storage(t[f"{fid}/v"], dtype),
                     dtype, t[f"{fid}/k_scale"] if quantized else None, t[f"{fid}/v_scale"] if quantized else None)


def fact_from(meta: StoreMeta, fid: str, t: dict[str, np.ndarray], entry: dict) -> FactKV:
    """Fact `fid` in float (the reference dequantisation), from its tensors and `fact_entry`."""
    c = compact_from(meta, fid, t)
    return FactKV(fid, c.token_ids, c.values("k"), c.values("v"), text=entry["text"],
                  embedding=t.get(f"{fid}/embedding"), source_turn=entry["source_turn"], meta=entry["meta"])
