"""`FaissIndex`: the vector index on faiss `IndexIDMap2(IndexFlatIP(dim))` (GPU when faiss sees
one), the same exact cosine search and interface as the numpy reference (`vector_index.ExactIndex`).
faiss is imported lazily, so this module imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from inferscale.common.storage.atomic import atomic_write_bytes
from inferscale.retrieval.vector_index import (_GPU_MAX_K, _add_args, _as_ids, _check_dim, _check_k, _queries, _read,
                                               _sort_rows, top_k)


BRUTE_AMONG = 8192  # up to this many candidate ids, their vectors are scored directly (else IDSelectorBatch)


def _import_faiss() -> Any:
    try:
        import faiss  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError as e:
        raise ImportError(
            f"FaissIndex needs faiss (pip install 'inferscale[index]' or 'inferscale[index-gpu]'): {e}"
        ) from e
    return faiss


def faiss_available() -> bool:
    """Whether faiss can be imported here."""
    try:
        _import_faiss()
    except ImportError:
        return False
    return True


# -- the numpy reference -------------------------------------------------------------------


class FaissIndex:
    """Exact cosine search with faiss `IndexIDMap2(IndexFlatIP(dim))` (GPU when available).

    The CPU index is the source of truth: every add/remove applies to it, and, where faiss sees
    GPUs, the flat vectors are re-cloned to them (`index_cpu_to_all_gpus`) before the next search.
    The GPU copy holds the inner flat index only; its row numbers map to ids through the CPU
    index's id map. Per-user indices are small, so re-cloning after a write is cheap.
    """

    kind = "faiss"

    def __init__(self, dim: int, *, use_gpu: bool | None = None) -> None:
        """`use_gpu`: None = when `faiss.get_num_gpus() > 0`; False forces the CPU."""
        self.dim = _check_dim(dim)
        faiss = _import_faiss()
        self._faiss = faiss
        self._flat: Any = faiss.IndexFlatIP(self.dim)  # referenced here: the id map does not own it
        self._cpu = faiss.IndexIDMap2(self._flat)
        if use_gpu is None:
            use_gpu = faiss.get_num_gpus() > 0
        self.use_gpu = bool(use_gpu)
        self._gpu: tuple[Any, np.ndarray] | None = None  # (GPU flat copy, row -> id); None = stale

    @classmethod
    def _wrap(cls, cpu_index: Any, *, use_gpu: bool | None = None) -> "FaissIndex":
        idx = cls(cpu_index.d, use_gpu=use_gpu)
        idx._flat = None  # a deserialised id map owns its flat index
        idx._cpu = cpu_index
        return idx

    def __len__(self) -> int:
        return int(self._cpu.ntotal)

    def __contains__(self, fact_id: object) -> bool:
        if not isinstance(fact_id, (int, np.integer)) or len(self) == 0:
            return False
        return bool((self._id_map() == int(fact_id)).any())

    def __repr__(self) -> str:
        return f"FaissIndex(dim={self.dim}, n={len(self)}, gpu={self.use_gpu})"

    def _id_map(self) -> np.ndarray:
        return self._faiss.vector_to_array(self._cpu.id_map).astype(np.int64, copy=False)

    def ids(self) -> np.ndarray:
        """All ids in the index, sorted ascending (int64)."""
        return np.sort(self._id_map())

    def vectors(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The stored (normalised) vectors of `ids`, [len(ids), dim]; unknown ids raise ValueError."""
        arr = _as_ids(ids, "vectors")
        present = set(self._id_map().tolist())
        missing = [int(i) for i in arr if int(i) not in present]
        if missing:
            raise ValueError(f"vectors(): ids not in the index: {missing[:5]}")
        out = np.zeros((arr.size, self.dim), dtype=np.float32)
        for j, i in enumerate(arr.tolist()):
            out[j] = self._cpu.reconstruct(i)
        return out

    def add(self, ids: Sequence[int] | np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors under `ids` (normalised here); an id already present gets the new vector."""
        arr, vecs = _add_args(ids, vectors, self.dim)
        if arr.size == 0:
            return
        if self._cpu.ntotal:
            self._cpu.remove_ids(np.ascontiguousarray(arr))
        self._cpu.add_with_ids(vecs, np.ascontiguousarray(arr))
        self._gpu = None

    def remove(self, ids: Sequence[int] | np.ndarray) -> int:
        """Remove `ids` (unknown ids are ignored); return how many were removed."""
        arr = _as_ids(ids, "remove")
        if arr.size == 0 or self._cpu.ntotal == 0:
            return 0
        n = int(self._cpu.remove_ids(np.ascontiguousarray(np.unique(arr))))
        if n:
            self._gpu = None
        return n

    def _device_index(self) -> tuple[Any, np.ndarray]:
        """(GPU copy of the flat vectors, row -> id), cloned again after any write."""
        if self._gpu is None:
            self._gpu = (self._faiss.index_cpu_to_all_gpus(self._cpu.index), self._id_map().copy())
        return self._gpu

    def search(self, queries: np.ndarray, k: int, among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top-k by cosine: (scores [m, k] float32, ids [m, k] int64); see the module docstring.
        `among`: only these ids are candidates (a filter's matches; faiss `IDSelectorBatch`, on
        the CPU copy)."""
        k = _check_k(k)
        q = _queries(queries, self.dim)
        m, n = q.shape[0], len(self)
        scores = np.full((m, k), -np.inf, dtype=np.float32)
        out = np.full((m, k), -1, dtype=np.int64)
        if among is not None:
            among = np.ascontiguousarray(_as_ids(among, "search"))
            n = min(n, among.size)
        if n == 0 or m == 0:
            return scores, out
        take = min(k, n)
        if among is not None and among.size <= BRUTE_AMONG:  # a few candidates: score just those
            present = among[np.isin(among, self._id_map())]
            if present.size:
                top_k(q @ self._cpu.reconstruct_batch(present).T, present, scores, out)
            return scores, out
        if among is not None:
            params = self._faiss.SearchParameters(sel=self._faiss.IDSelectorBatch(among))
            s, labels = self._cpu.search(q, take, params=params)
        elif self.use_gpu and take <= _GPU_MAX_K:
            device, id_map = self._device_index()
            s, rows = device.search(q, take)
            labels = np.where(rows >= 0, id_map[np.clip(rows, 0, n - 1)], -1)
        else:
            s, labels = self._cpu.search(q, take)
        s, labels = _sort_rows(s, labels)
        scores[:, :take], out[:, :take] = s, labels
        return scores, out

    # -- persistence -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """`faiss.serialize_index` bytes of the CPU index."""
        return self._faiss.serialize_index(self._cpu).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>", *, use_gpu: bool | None = None) -> "FaissIndex":
        """Inverse of `to_bytes`; `source` names the data in error messages."""
        faiss = _import_faiss()
        try:
            idx = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except Exception as e:  # faiss raises RuntimeError carrying its C++ exception text
            why = " ".join(str(e).split())[:400] or type(e).__name__
            raise ValueError(f"faiss index file {source} is unreadable: {why}") from None
        if not isinstance(idx, faiss.IndexIDMap2):
            raise ValueError(f"faiss index file {source} holds a {type(idx).__name__}, expected IndexIDMap2")
        inner = faiss.downcast_index(idx.index)
        if not isinstance(inner, faiss.IndexFlat) or inner.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise ValueError(
                f"faiss index file {source} wraps a {type(inner).__name__} (metric {inner.metric_type}), "
                "expected an inner-product IndexFlatIP"
            )
        return cls._wrap(idx, use_gpu=use_gpu)

    def save(self, path: str | Path) -> None:
        """Write the (CPU) index to `path` atomically."""
        atomic_write_bytes(Path(path), self.to_bytes())

    @classmethod
    def load(cls, path: str | Path, *, use_gpu: bool | None = None) -> "FaissIndex":
        """Read an index written by `save`; a missing file raises FileNotFoundError, a bad one ValueError."""
        path = Path(path)
        return cls.from_bytes(_read(path, "faiss"), source=str(path), use_gpu=use_gpu)


__all__ = ["FaissIndex", "faiss_available"]
