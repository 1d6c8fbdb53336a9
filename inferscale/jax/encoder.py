"""Fact encoding (Context-Window Encoding) with pre-RoPE K/V capture.

Each item is `[context tokens][fact tokens]` run through the model at positions 0..; only the
fact tokens' pre-RoPE K and V are kept, for every layer. Items are sorted by length and batched;
each batch is right-padded to a power-of-two length so a handful of shapes are ever compiled
(causal attention means real tokens never see the padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class EncodeItem:
    context_ids: tuple[int, ...]
    fact_ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.context_ids) + len(self.fact_ids)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


# forward(tokens [B, T] int32, positions [B, T] int32) -> (k, v), each [L, B, T, kv_heads, head_dim]
ForwardKV = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def encode_items(
    forward: ForwardKV,
    items: Sequence[EncodeItem],
    max_context: int,
    batch_size: int = 8,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run every item; return per item (k, v), each [L, n_fact_tokens, kv_heads, head_dim]."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, it in enumerate(items):
        if not it.fact_ids:
            raise ValueError(f"encode item {i} has an empty fact")
        if it.length > max_context:
            raise ValueError(
                f"encode item {i}: context {len(it.context_ids)} + fact {len(it.fact_ids)} tokens "
                f"exceed the model's context of {max_context}"
            )
    order = sorted(range(len(items)), key=lambda i: items[i].length)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    out: list = [None] * len(items)
    for idx in progress(batches) if progress else batches:
        T = bucket(max(items[i].length for i in idx))  # the RoPE table covers bucket(max_context)
        B = bucket(len(idx), minimum=1)
        tokens = np.zeros((B, T), np.int32)
        for row, i in enumerate(idx):
            ids = items[i].context_ids + items[i].fact_ids
            tokens[row, : len(ids)] = ids
        positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
        k, v = forward(tokens, positions)
        k, v = np.asarray(k), np.asarray(v)
        for row, i in enumerate(idx):
            a, b = len(items[i].context_ids), items[i].length
            out[i] = (k[:, row, a:b].copy(), v[:, row, a:b].copy())
    return out
