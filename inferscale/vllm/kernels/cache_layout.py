"""Where vLLM's CPU attention backend puts each element of a paged-cache block, learned from the
backend's own cache write (`learn_layout`), so `paged_write` can write memory KV straight into it.

vLLM's CPU backends lay a block out differently per ISA: "vec" (float32) stores each (block,
head) as K channel-major [D, block_size] then V token-major [block_size, D]; "amx" (bfloat16)
packs channel pairs of 16-token groups for its tiles; others differ again. Rather than hard-code
them, `learn_layout` writes numbered K / V through the backend into a scratch cache and reads
back where each (slot, head, channel) landed (`probe_layout`):

    layout.inv[q]   int64 [block elements]: what the backend puts at element q of a block, as an
                    index into [2 (K, V), block_size, KVH, D], or -1 (an element it never writes)
    layout.slot[q]  int64 [block elements]: that element's slot in the block (-1 likewise)

and accepts the map only if it is block-local, one-to-one, and a random write through the kernel
equals the backend's write bit for bit (else the connector keeps the backend's write).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

CACHE_DTYPES = (torch.float32, torch.bfloat16)
_DIGIT = 64  # numbers written per probe pass: small integers, exact in bfloat16


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """Where the backend's write puts each K / V element inside one block (see the module doc)."""

    dtype: torch.dtype  # the cache's element type
    block_size: int
    heads: int
    head_dim: int
    inv: np.ndarray  # [block elements] int64
    slot: np.ndarray  # [block elements] int64

    @functools.cached_property
    def runs(self) -> np.ndarray:
        """[R, 6] int64 (first element, outer, inner, first source, outer step, inner step): the
        block's written elements as runs of `outer` x `inner` consecutive elements, whose sources
        in [2, block_size, KVH, D] step evenly within a row of `inner` and from row to row. "vec":
        one run per head for K (a channel's slots, channel after channel), one for V (a slot's
        channels, slot after slot); "amx": channel pairs of 16 tokens (K), token pairs (V)."""
        q = np.flatnonzero(self.inv >= 0)
        src = self.inv[q]
        rows: list[list[int]] = []  # (first, n, source, step): evenly stepping consecutive elements
        for i in range(len(q)):
            if rows:
                first, n, s0, step = rows[-1]
                if q[i] == first + n and (n == 1 or src[i] == s0 + n * step):
                    rows[-1][1], rows[-1][3] = n + 1, (src[i] - s0 if n == 1 else step)
                    continue
            rows.append([int(q[i]), 1, int(src[i]), 1])
        runs: list[list[int]] = []  # rows of one length and step, back to back, sources stepping evenly
        for first, n, s0, step in rows:
            if runs:
                f, outer, inner, r0, ostep, istep = runs[-1]
                if inner == n and istep == step and first == f + outer * inner and \
                        (outer == 1 or s0 == r0 + outer * ostep):
                    runs[-1][1], runs[-1][4] = outer + 1, (s0 - r0 if outer == 1 else ostep)
                    continue
            runs.append([first, 1, n, s0, 0, step])
        return np.asarray(runs, np.int64).reshape(-1, 6)

    @functools.cached_property
    def where(self) -> np.ndarray:
        """[2 * block_size * KVH * D] int64: the block element each K / V (slot, head, channel) goes to."""
        out = np.zeros(2 * self.block_size * self.heads * self.head_dim, np.int64)
        q = np.flatnonzero(self.inv >= 0)
        out[self.inv[q]] = q
        return out

    @functools.cached_property
    def flush_runs(self) -> np.ndarray:
        """`runs` where their rows are long enough to be worth walking (8 elements on average), else
        none: the kernel then scatters each token's elements through `where`."""
        runs = self.runs
        rows = runs[:, 1].sum()
        return runs if runs[:, 1:3].prod(1).sum() >= 8 * rows else runs[:0]


def probe_layout(write, like, bs, heads, d):
    """Write the numbers of every (K/V, slot, head, channel) of block 1, base-64 digit by digit,
    and decode where each landed. (None, None) if the write is not block-local or one-to-one."""
    count = bs * heads * d
    passes = max(1, math.ceil(math.log(count, _DIGIT)))
    order = torch.randperm(bs, generator=torch.Generator().manual_seed(0))
    slots = order + bs  # block 1, slots out of order
    number = (order[:, None, None] * heads + torch.arange(heads)[:, None]) * d + torch.arange(d)  # [bs, H, D]
    found = None
    for p in range(passes):
        digit = (number // _DIGIT ** p % _DIGIT + 1).to(like.dtype)
        cache = torch.zeros((3, *like.shape[1:]), dtype=like.dtype)
        write(digit, -digit, cache, slots)
        if cache[0].any() or cache[2].any():
            return None, None
        got = cache[1].reshape(-1).to(torch.int64)
        written = got != 0
        if found is None:
            found, k_part, value = written, got > 0, torch.zeros_like(got)
        elif not torch.equal(written, found) or not torch.equal(got > 0, k_part):
            return None, None
        value += (got.abs() - 1) * _DIGIT ** p
    inv = torch.where(k_part, value, value + count)
    if int(k_part.sum()) != count or int((found & ~k_part).sum()) != count:
        return None, None
    if torch.unique(inv[found]).numel() != 2 * count or int(inv[found].max()) >= 2 * count:
        return None, None
    inv = torch.where(found, inv, torch.full_like(inv, -1))
    slot = torch.where(found, inv % count // (heads * d), torch.full_like(inv, -1))
    return inv.numpy(), slot.numpy()


def read_paged(cache: torch.Tensor, layout: PagedLayout, block_ids, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, n) as a request's blocks hold them, read back through the layout
    (the inverse of the backend's write; float32):

        cache [num_blocks, ...] in layout.dtype; block_ids: the request's blocks, in position order
        -> K, V [n, KVH, D] float32
    """
    bs, heads, d = layout.block_size, layout.heads, layout.head_dim
    nb = -(-n // bs)
    if nb > len(block_ids):
        raise ValueError(f"{n} positions need {nb} blocks, the request has {len(block_ids)}")
    blocks = cache[torch.as_tensor(list(block_ids[:nb]), dtype=torch.int64)].reshape(nb, -1)  # [nb, block elements]
    kv = blocks[:, torch.from_numpy(layout.where)].float()  # [nb, 2 * bs * KVH * D], in [2, bs, KVH, D] order
    kv = kv.reshape(nb, 2, bs, heads, d).transpose(0, 1).reshape(2, nb * bs, heads, d)[:, :n]
    return kv[0], kv[1]
