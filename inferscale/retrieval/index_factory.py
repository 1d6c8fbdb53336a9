"""Vector indexes by name: "exact" (the numpy reference), "faiss", "auto" (faiss where importable)."""

from __future__ import annotations

from inferscale.common.modes import INDEX_KINDS
from inferscale.retrieval.faiss_index import FaissIndex, faiss_available
from inferscale.retrieval.vector_index import ExactIndex, _check_dim


def make_index(kind: str = "auto", *, dim: int) -> ExactIndex | FaissIndex:
    """An empty index: kind "faiss", "exact", or "auto" (faiss when importable, else exact)."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; choose one of {', '.join(INDEX_KINDS)}")
    dim = _check_dim(dim)
    if kind == "exact" or (kind == "auto" and not faiss_available()):
        return ExactIndex(dim)
    return FaissIndex(dim)


__all__ = ["INDEX_KINDS", "make_index"]
