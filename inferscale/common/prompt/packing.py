"""One-pass encoding plans: many (context, fact) items as a few packed rows with a tree mask.

Per-fact encoding runs every item, `[context tokens][fact tokens]`, as its own sequence. The
items of one ingest share a lot: every context starts with the prompt header, facts from the same
turn have the same window, the first facts of a conversation have windows that are prefixes of
each other, and exact (layout) encoding chains each fact's context onto the previous fact. A token's
KV depends only on the tokens before it in its item and its position, so items are merged into a
prefix tree (a trie over token ids): a shared prefix is computed once, and each token attends to
exactly its ancestors in the tree, at its position in its own item. Same KV as fact by fact (up
to float summation order), fewer tokens run.

A `PackPlan` is plain data (numpy arrays, no engine): both encoders run its rows through their
model with `PackedRow.visible()` as the attention mask and `positions` as position ids, then read
each item's fact rows at `PackPlan.where[i]`.

    tokens, positions, parent: [T] int32 per row
    visible():                 [T, T] bool, visible[q, k] = k is q or one of q's ancestors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_ROW = 512  # packed rows hold at least this many tokens, so short items (small windows) share one


@dataclass(frozen=True)
class PackedRow:
    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32: each token's position in its own item (its depth in the tree)
    parent: np.ndarray  # [T] int32: the token before it in its item, -1 for an item's first token

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """No branch: every token follows the one before it, so plain causal attention is exact."""
        return bool(np.all(self.parent[1:] == np.arange(len(self.parent) - 1)))

    def visible(self, length: int | None = None, window: int | None = None) -> np.ndarray:
        """[length, length] bool: query q sees key k iff k is q or an ancestor of q (and, with a
        sliding `window`, positions[q] - positions[k] < window). Rows past the row's own tokens
        (padding up to `length`) see only themselves."""
        T = len(self.tokens)
        vis = np.zeros((T, T), dtype=bool)
        for q in range(T):  # parents come first: a token sees what its parent sees, and itself
            p = self.parent[q]
            if p >= 0:
                vis[q, :q] = vis[p, :q]
            vis[q, q] = True
        return windowed(vis, self.positions, length, window)


@dataclass(frozen=True)
class MaskedRow:
    """A packed row whose mask is not a tree (`inferscale.common.prompt.conversation_pass`): the keys
    each query sees are given outright."""

    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    allowed: np.ndarray  # [T, T] bool: allowed[q, k] = query q sees key k (no window applied)

    def __len__(self) -> int:
        return len(self.tokens)

    is_chain = False

    def visible(self, length: int | None = None, window: int | None = None) -> np.ndarray:
        """As `PackedRow.visible`: `allowed`, a sliding `window` in positions, padding to `length`."""
        return windowed(self.allowed, self.positions, length, window)


def windowed(vis: np.ndarray, positions: np.ndarray, length: int | None, window: int | None) -> np.ndarray:
    """[T, T] mask -> [length, length]: keys at least `window` positions before the query removed,
    and the padding rows past T seeing only themselves."""
    T = len(vis)
    n = T if length is None else length
    if n < T:
        raise ValueError(f"length {n} is shorter than the row's {T} tokens")
    out = np.zeros((n, n), dtype=bool)
    out[:T, :T] = vis
    if window is not None:
        out[:T, :T] &= (positions[:, None] - positions[None, :]) < window
    idx = np.arange(T, n)
    out[idx, idx] = True
    return out


@dataclass(frozen=True)
class PackPlan:
    rows: list[PackedRow | MaskedRow]
    where: list[tuple[int, np.ndarray]]  # per item: (row, [n_fact] indices of its fact tokens there)
    item_tokens: int  # what per-fact encoding runs: the sum of the items' lengths

    @property
    def row_tokens(self) -> int:
        """What the one pass runs: the tokens of all rows (before any padding)."""
        return sum(len(r) for r in self.rows)


def check_items(items: Sequence[tuple[Sequence[int], Sequence[int]]], max_context: int, batch_size: int) -> None:
    """What every encoder refuses, naming the item: an empty fact, an item beyond the context."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, (ctx, fact) in enumerate(items):
        if len(fact) == 0:
            raise ValueError(f"encode item {i} has an empty fact")
        if len(ctx) + len(fact) > max_context:
            raise ValueError(f"encode item {i}: context {len(ctx)} + fact {len(fact)} tokens exceed "
                             f"the model's context of {max_context}")


def row_budget(items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Tokens per row the encoders pack `items` into: twice the longest item (room for its
    branches), at least `MIN_ROW`."""
    return max(MIN_ROW, 2 * max((len(c) + len(f) for c, f in items), default=0))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pack_items(items: Sequence[tuple[Sequence[int], Sequence[int]]], row_tokens: int,
               min_shared: float = 0.5) -> PackPlan:
    """Merge (context ids, fact ids) items into prefix-tree rows of at most `row_tokens` tokens
    (an item longer than that gets a row of its own).

    Items are visited in lexicographic order of their tokens, so the longest prefix an item shares
    with anything already in its row is the one it shares with the item just before it. An item
    joins the current row only if that prefix is at least `min_shared` of its tokens: a row costs
    attention over all its tokens, so an item that would save little (sharing only the prompt
    header with a long window) runs on its own, as a chain (`PackedRow.is_chain`), instead."""
    if row_tokens < 1:
        raise ValueError(f"row_tokens must be >= 1, got {row_tokens}")
    if not 0.0 <= min_shared <= 1.0:
        raise ValueError(f"min_shared must be in [0, 1], got {min_shared}")
    seqs = []
    for i, (ctx, fact) in enumerate(items):
        if len(fact) == 0:
            raise ValueError(f"encode item {i} has an empty fact")
        seqs.append((tuple(int(t) for t in ctx) + tuple(int(t) for t in fact), len(ctx)))
    order = sorted(range(len(seqs)), key=lambda i: seqs[i][0])
    rows: list[PackedRow] = []
    where: list = [None] * len(items)
    tokens: list[int] = []
    positions: list[int] = []
    parent: list[int] = []
    prev: tuple[int, ...] = ()
    path: list[int] = []  # row index of each token of `prev`

    def close() -> None:
        if tokens:
            rows.append(PackedRow(np.asarray(tokens, np.int32), np.asarray(positions, np.int32),
                                  np.asarray(parent, np.int32)))

    for i in order:
        seq, n_ctx = seqs[i]
        shared = _common_prefix(prev, seq)
        if tokens and (len(tokens) + len(seq) - shared > row_tokens or shared < min_shared * len(seq)):
            close()
            tokens, positions, parent, shared = [], [], [], 0
        path = path[:shared]
        for pos in range(shared, len(seq)):
            parent.append(path[-1] if path else -1)
            path.append(len(tokens))
            tokens.append(seq[pos])
            positions.append(pos)
        prev = seq
        where[i] = (len(rows), np.asarray(path[n_ctx:], np.int64))
    close()
    return PackPlan(rows, where, sum(len(s) for s, _ in seqs))


def batch_rows(plan: PackPlan, rows_per_batch: int) -> list[list[int]]:
    """Row indices grouped `rows_per_batch` at a time, similar lengths together; chain rows and
    branching rows never share a batch (chains run with plain causal attention, no mask)."""
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    batches = []
    for chain in (True, False):
        order = sorted((r for r, row in enumerate(plan.rows) if row.is_chain == chain),
                       key=lambda r: len(plan.rows[r]))
        batches += [order[i: i + rows_per_batch] for i in range(0, len(order), rows_per_batch)]
    return batches
