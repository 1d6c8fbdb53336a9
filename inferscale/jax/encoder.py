"""Fact encoding (Context-Window Encoding) with pre-RoPE K/V capture.

Each item is `[context tokens][fact tokens]` run through the model at positions 0..; only the
fact tokens' pre-RoPE K and V are kept, for every layer. Two ways to run the items:

- `encode_items` (per fact, the reference): items sorted by length and batched; each batch is
  right-padded to a power-of-two length so a handful of shapes are ever compiled (causal attention
  means real tokens never see the padding).
- `encode_packed` (one pass): the items merged into prefix-tree rows (`inferscale.common.prompt.packing`),
  each shared prefix run once, each token attending to exactly its ancestors; rows are padded to a
  power of two as well. Same KV within float tolerance, fewer tokens.

`run_plan` runs any plan's rows, also the conversation encoding's (`inferscale.common.
conversation_pass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from inferscale.common.prompt.packing import (
    PackPlan,
    batch_rows,
    check_items,
    pack_items,
    row_budget,
)


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
# forward(tokens [B, T], positions [B, T], visible [B, T, T] bool) -> (k, v) as above
ForwardTreeKV = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def encode_items(
    forward: ForwardKV,
    items: Sequence[EncodeItem],
    max_context: int,
    batch_size: int = 8,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run every item; return per item (k, v), each [L, n_fact_tokens, kv_heads, head_dim]."""
    check_items([(it.context_ids, it.fact_ids) for it in items], max_context, batch_size)
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


def encode_packed(
    forward: ForwardTreeKV,
    forward_chain: ForwardKV,
    items: Sequence[EncodeItem],
    max_context: int,
    batch_size: int = 8,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One-pass encoding: the same result as `encode_items`, each shared prefix computed once.
    Branching rows run through `forward` with their ancestor masks, chain rows through the causal
    `forward_chain`."""
    pairs = [(it.context_ids, it.fact_ids) for it in items]
    check_items(pairs, max_context, batch_size)
    if not items:
        return []
    plan = pack_items(pairs, min(bucket(row_budget(pairs)), bucket(max_context)))  # rows padded to a power of two
    return run_plan(forward, forward_chain, plan, batch_size, progress)


def run_plan(
    forward: ForwardTreeKV,
    forward_chain: ForwardKV,
    plan: PackPlan,
    batch_size: int = 8,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run a plan's rows, padded to powers of two: chains through the causal `forward_chain`, the
    others through `forward` with their masks (`PackedRow.visible`, `MaskedRow.visible`); per
    item (k, v), each [L, n_fact_tokens, kv_heads, head_dim]."""
    batches = batch_rows(plan, batch_size)
    kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> its (k, v), [L, T, KVH, D] each
    for idx in progress(batches) if progress else batches:
        T = bucket(max(len(plan.rows[r]) for r in idx))
        B = bucket(len(idx), minimum=1)
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        chain = plan.rows[idx[0]].is_chain
        for b, r in enumerate(idx):
            row = plan.rows[r]
            tokens[b, : len(row)] = row.tokens
            positions[b, : len(row)] = row.positions
        if chain:
            k, v = forward_chain(tokens, np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)))
        else:
            visible = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T)).copy()  # padding sees itself
            for b, r in enumerate(idx):
                visible[b] = plan.rows[r].visible(T)
            k, v = forward(tokens, positions, visible)
        k, v = np.asarray(k), np.asarray(v)
        for b, r in enumerate(idx):
            kv[r] = (k[:, b], v[:, b])
    return [(kv[r][0][:, at].copy(), kv[r][1][:, at].copy()) for r, at in plan.where]
