"""Per-user vector index for cosine top-k retrieval of fact embeddings.

Two implementations with one interface:

* `ExactIndex` - the numpy reference: a dense [n, dim] float32 matrix and a brute-force matmul.
* `FaissIndex` (`retrieval.faiss_index`) - faiss `IndexIDMap2(IndexFlatIP(dim))`, i.e. the same
  exact search, on the GPU when faiss sees one.

`make_index` (`retrieval.index_factory`) picks one by name. This module holds the interface's
checks, shared by both, and the reference.

Vectors and queries are L2-normalised on the way in, so inner product is cosine similarity. Ids
are non-negative int64 (faiss uses -1 for "no result"). Adding an id that is already present
replaces its vector. `search` returns `(scores [m, k] float32, ids [m, k] int64)` sorted by
descending score, ties broken by the smaller id, padded with score -inf and id -1 when the index
holds fewer than k vectors.

`save` writes one file atomically (temp file in the same directory, fsync, rename, fsync the
directory). `ExactIndex` files are safetensors (ids + vectors, no pickle); `FaissIndex` files are
`faiss.serialize_index` bytes. faiss is imported lazily, so this module imports without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from inferscale.common.storage.atomic import atomic_write_bytes

EXACT_FORMAT = "inferscale.exact_index"
EXACT_FORMAT_VERSION = 1
# faiss GPU k-selection supports k up to 2048; larger k searches the CPU copy.
_GPU_MAX_K = 2048
_NORM_BLOCK = 1 << 15  # rows normalised per float64 block


# -- validation helpers ----------------------------------------------------------------------
def _check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim <= 0:
        raise ValueError(f"index dim must be a positive integer, got {dim!r}")
    return int(dim)


def _check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
        raise ValueError(f"search k must be a positive integer, got {k!r}")
    return int(k)


def _as_ids(ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """`ids` as a 1-D int64 array of non-negative values (what: 'add' or 'remove', for messages)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what}(): ids must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}(): ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what}(): ids must fit in int64, got {int(arr.max())}")
    arr = arr.astype(np.int64)
    if int(arr.min()) < 0:
        bad = arr[arr < 0][:5].tolist()
        raise ValueError(f"{what}(): ids must be >= 0 (-1 means 'no result'), got {bad}")
    return arr


def _normalise(x: Any, dim: int, what: str) -> np.ndarray:
    """Validate a [n, dim] array and return its rows L2-normalised as contiguous float32."""
    arr = np.asarray(x)
    if arr.ndim != 2 or arr.shape[1] != dim:
        raise ValueError(f"{what} must have shape [n, {dim}], got {arr.shape}")
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} must be a real numeric array, got dtype {arr.dtype}")
    out = np.empty(arr.shape, dtype=np.float32)
    # float64 arithmetic, in row blocks so a large batch needs no full-size float64 copy
    for lo in range(0, arr.shape[0], _NORM_BLOCK):
        a64 = arr[lo : lo + _NORM_BLOCK].astype(np.float64)
        finite = np.isfinite(a64).all(axis=1)
        if not finite.all():
            rows = (lo + np.flatnonzero(~finite)[:5]).tolist()
            raise ValueError(f"{what} contain NaN or inf (rows {rows})")
        norms = np.linalg.norm(a64, axis=1)
        if not (norms > 0).all():
            rows = (lo + np.flatnonzero(~(norms > 0))[:5]).tolist()
            raise ValueError(f"{what} contain zero vectors, which have no direction (rows {rows})")
        out[lo : lo + _NORM_BLOCK] = a64 / norms[:, None]
    return out


def _add_args(ids: Sequence[int] | np.ndarray, vectors: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated (ids, normalised vectors) of an add() call: same count, no id twice."""
    arr = _as_ids(ids, "add")
    vecs = _normalise(vectors, dim, "vectors")
    if arr.shape[0] != vecs.shape[0]:
        raise ValueError(f"add(): got {arr.shape[0]} ids but {vecs.shape[0]} vectors")
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"add(): ids appear more than once in one call: {uniq[counts > 1][:5].tolist()}")
    return arr, vecs


def _queries(queries: Any, dim: int) -> np.ndarray:
    q = np.asarray(queries)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2:
        raise ValueError(f"queries must have shape [{dim}] or [m, {dim}], got {np.shape(queries)}")
    return _normalise(q, dim, "queries")


def _sort_rows(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order each row by descending score, then ascending id; -1 padding (score -inf) goes last."""
    s = np.asarray(scores, dtype=np.float32).copy()
    i = np.asarray(ids, dtype=np.int64).copy()
    pad = i < 0
    s[pad] = -np.inf
    # padding sorts after every real id with the same (-inf) score
    key_id = np.where(pad, np.iinfo(np.int64).max, i)
    for r in range(s.shape[0]):
        order = np.lexsort((key_id[r], -s[r]))
        s[r], i[r] = s[r][order], i[r][order]
    return s, i


def top_k(sims: np.ndarray, ids: np.ndarray, scores: np.ndarray, out: np.ndarray) -> None:
    """Fill `scores`/`out` [m, k] with the best of `sims` [m, n] (ids [n]) by descending score,
    then ascending id; rows past n keep their padding."""
    n, k = ids.shape[0], scores.shape[1]
    take = min(k, n)
    for r in range(sims.shape[0]):
        row = sims[r]
        if take < n:
            # every candidate that could be in the top k, ties at the k-th score included
            kth = np.partition(row, n - take)[n - take]
            cand = np.flatnonzero(row >= kth)
        else:
            cand = np.arange(n)
        order = np.lexsort((ids[cand], -row[cand]))[:take]
        scores[r, :take] = row[cand[order]]
        out[r, :take] = ids[cand[order]]


def _read(path: Path, kind: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"no {kind} index file at {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{kind} index path {path} is a directory, not an index file") from None


class ExactIndex:
    """Brute-force cosine index in numpy; the reference `FaissIndex` is tested against."""

    kind = "exact"

    def __init__(self, dim: int) -> None:
        self.dim = _check_dim(dim)
        self._ids = np.zeros(0, dtype=np.int64)  # row -> id
        self._vecs = np.zeros((0, self.dim), dtype=np.float32)  # row -> normalised vector
        self._row: dict[int, int] = {}  # id -> row

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __contains__(self, fact_id: object) -> bool:
        return isinstance(fact_id, (int, np.integer)) and int(fact_id) in self._row

    def __repr__(self) -> str:
        return f"ExactIndex(dim={self.dim}, n={len(self)})"

    def ids(self) -> np.ndarray:
        """All ids in the index, sorted ascending (int64)."""
        return np.sort(self._ids)

    def vectors(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The stored (normalised) vectors of `ids`, [len(ids), dim]; unknown ids raise ValueError."""
        arr = _as_ids(ids, "vectors")
        missing = [int(i) for i in arr if int(i) not in self._row]
        if missing:
            raise ValueError(f"vectors(): ids not in the index: {missing[:5]}")
        return self._vecs[[self._row[int(i)] for i in arr]].copy()

    def add(self, ids: Sequence[int] | np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors under `ids` (normalised here); an id already present gets the new vector."""
        arr, vecs = _add_args(ids, vectors, self.dim)
        if arr.size == 0:
            return
        rows = np.fromiter((self._row.get(int(i), -1) for i in arr), dtype=np.int64, count=arr.size)
        old = rows >= 0
        if old.any():
            self._vecs[rows[old]] = vecs[old]
        new = ~old
        if new.any():
            start = len(self)
            new_ids = arr[new]
            new_vecs = vecs if new.all() else vecs[new]
            self._ids = np.concatenate([self._ids, new_ids])
            self._vecs = new_vecs if start == 0 else np.concatenate([self._vecs, new_vecs])
            self._row.update(zip(new_ids.tolist(), range(start, start + new_ids.size)))

    def remove(self, ids: Sequence[int] | np.ndarray) -> int:
        """Remove `ids` (unknown ids are ignored); return how many were removed."""
        arr = _as_ids(ids, "remove")
        drop = {int(i) for i in arr if int(i) in self._row}
        if not drop:
            return 0
        keep = np.ones(len(self), dtype=bool)
        keep[[self._row[i] for i in drop]] = False
        self._ids = self._ids[keep]
        self._vecs = np.ascontiguousarray(self._vecs[keep])
        self._row = {int(i): r for r, i in enumerate(self._ids.tolist())}
        return len(drop)

    def search(self, queries: np.ndarray, k: int, among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine: (scores [m, k] float32, ids [m, k] int64); see the module docstring.
        `among`: only these ids are candidates (a filter's matches)."""
        k = _check_k(k)
        q = _queries(queries, self.dim)
        ids, vecs = self._ids, self._vecs
        if among is not None:
            keep = np.isin(ids, _as_ids(among, "search"))
            ids, vecs = ids[keep], vecs[keep]
        m, n = q.shape[0], ids.shape[0]
        scores = np.full((m, k), -np.inf, dtype=np.float32)
        out = np.full((m, k), -1, dtype=np.int64)
        if n == 0 or m == 0:
            return scores, out
        top_k(q @ vecs.T, ids, scores, out)  # [m, n] float32
        return scores, out

    # -- persistence -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """safetensors bytes: "ids" [n] int64 and "vectors" [n, dim] float32, rows sorted by id."""
        from safetensors.numpy import save as st_save

        order = np.argsort(self._ids, kind="stable")
        tensors = {
            "ids": np.ascontiguousarray(self._ids[order]),
            "vectors": np.ascontiguousarray(self._vecs[order]),
        }
        meta = {"format": EXACT_FORMAT, "version": str(EXACT_FORMAT_VERSION), "dim": str(self.dim)}
        return st_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> "ExactIndex":
        """Inverse of `to_bytes`; `source` names the data in error messages."""
        from safetensors.numpy import load as st_load

        try:
            tensors = st_load(data)
        except Exception as e:  # safetensors raises its own error types for malformed data
            raise ValueError(f"exact index file {source} is not a readable safetensors file: {e}") from None
        # safetensors.numpy.load does not return metadata; read the header directly
        meta = _safetensors_metadata(data, source)
        if meta.get("format") != EXACT_FORMAT:
            raise ValueError(f"{source} is not an InferScale exact index (format {meta.get('format')!r})")
        if meta.get("version") != str(EXACT_FORMAT_VERSION):
            raise ValueError(
                f"exact index {source} has format version {meta.get('version')!r}; "
                f"this code reads {EXACT_FORMAT_VERSION}"
            )
        ids, vecs = tensors.get("ids"), tensors.get("vectors")
        try:
            dim = int(meta.get("dim", ""))
        except ValueError:
            raise ValueError(f"exact index {source} has an invalid dim {meta.get('dim')!r}") from None
        if (
            ids is None or vecs is None or ids.dtype != np.int64 or vecs.dtype != np.float32
            or ids.ndim != 1 or vecs.ndim != 2 or vecs.shape != (ids.shape[0], dim)
        ):
            raise ValueError(f"exact index {source} has malformed ids/vectors tensors")
        if ids.size and (int(ids.min()) < 0 or np.unique(ids).size != ids.size):
            raise ValueError(f"exact index {source} has negative or duplicate ids")
        if not np.isfinite(vecs).all():
            raise ValueError(f"exact index {source} has non-finite vectors")
        idx = cls(dim)
        idx._ids = ids.copy()
        idx._vecs = np.ascontiguousarray(vecs.copy())
        idx._row = {int(i): r for r, i in enumerate(ids.tolist())}
        return idx

    def save(self, path: str | Path) -> None:
        """Write the index to `path` atomically."""
        atomic_write_bytes(Path(path), self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> "ExactIndex":
        """Read an index written by `save`; a missing file raises FileNotFoundError, a bad one ValueError."""
        path = Path(path)
        return cls.from_bytes(_read(path, "exact"), source=str(path))


def _safetensors_metadata(data: bytes, source: str) -> dict:
    """The `__metadata__` dict of a safetensors blob (8-byte little-endian header length + JSON)."""
    try:
        (n,) = np.frombuffer(data[:8], dtype="<u8")
        header = json.loads(data[8 : 8 + int(n)])
        meta = header.get("__metadata__") or {}
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"exact index file {source} has an unreadable safetensors header") from None
    if not isinstance(meta, dict):
        raise ValueError(f"exact index file {source} has malformed metadata")
    return meta


__all__ = ["ExactIndex"]
