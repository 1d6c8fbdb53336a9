"""Store format v2: per-fact token ids + pre-RoPE K and V for every layer, in safetensors shards.

Layout on disk::

    <store>/manifest.json              # StoreMeta + fact table (token ids, text, shard) + shard table
    <store>/shards/<uuid>.safetensors  # tensors "<fact_id>/tokens" [n] int32,
                                       #         "<fact_id>/k", "<fact_id>/v" [L, n, kv_heads, head_dim]
                                       #         "<fact_id>/k_scale", "<fact_id>/v_scale" [L, kv_heads,
                                       #             head_dim] float32 (int8 / fp8 stores, `kvquant`)
                                       #         "<fact_id>/embedding" [d] float32 (optional)

KV dtypes: float32, float16, bfloat16 (as they are), int8 and float8_e4m3 (codes + per-channel
scales whose RoPE pairs share one; `inferscale.common.storage.kvquant`). `get` returns float32 for the
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

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from inferscale.common.storage.kvquant import QUANTIZED, dequantize, pair_partner, quantize
from inferscale.common.modes import ENCODING_CONTEXTS, KV_DTYPES

if TYPE_CHECKING:
    from inferscale.common.model.spec import ModelSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # v1: float dtypes only, no scales


class StoreError(Exception):
    """Base class of store errors."""


class ModelMismatchError(StoreError):
    """The store was written for another model (fingerprint or RoPE convention differ)."""


class FormatVersionError(StoreError):
    """The store's format version is not one this code reads."""


class ChecksumError(StoreError):
    """A shard's bytes do not match the checksum the manifest committed."""


class UnknownFactError(StoreError, KeyError):
    """A fact id the store does not hold, or (raised by the memory service, which re-exports it
    from `inferscale.memory.service_types`) a fact the user's memory does not hold."""

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


def stored_nbytes(meta: StoreMeta, f: FactKV) -> int:
    """The bytes `f`'s tensors take in a store of `meta` (what quotas count)."""
    if meta.dtype in QUANTIZED or f.embedding is not None:
        return sum(int(t.nbytes) for t in fact_tensors(meta, f).values())
    itemsize = np.dtype("float32").itemsize if meta.dtype == "float32" else 2  # float16 / bfloat16
    return int(np.asarray(f.token_ids).nbytes) + (f.k.size + f.v.size) * itemsize


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
