"""The paged KV cache: device arrays (one (K, V) pair per layer) and plain-Python block bookkeeping.

    cache[layer] = (k, v), each [num_blocks, block_size, kv_heads, head_dim]

Block 0 is the null block: it is never handed out, and padding entries of a block table point to
it (the causal mask keeps them out of attention). The slot of position p of a sequence is
`block_ids[p // block_size] * block_size + p % block_size`, as in vLLM.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from inferscale.common.model.spec import ModelSpec


class OutOfBlocksError(RuntimeError):
    """The cache has fewer free blocks than a request needs."""


class BlockAllocator:
    """Free list of cache blocks (block 0 reserved as the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def slots_for(block_ids: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position of a sequence owning `block_ids`."""
    positions = np.asarray(positions)
    if positions.size and positions.max() >= len(block_ids) * block_size:
        raise ValueError(
            f"position {positions.max()} is beyond the {len(block_ids)} blocks the sequence owns"
        )
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // block_size]
    return (blocks * block_size + positions % block_size).astype(np.int32)


def block_table(block_ids: list[int], max_blocks: int) -> np.ndarray:
    """The sequence's blocks padded with the null block to a fixed length."""
    if len(block_ids) > max_blocks:
        raise ValueError(f"sequence owns {len(block_ids)} blocks, the table holds {max_blocks}")
    return np.asarray(list(block_ids) + [0] * (max_blocks - len(block_ids)), dtype=np.int32)


def init_cache(spec: ModelSpec, num_blocks: int, block_size: int, dtype=jnp.float32) -> list:
    shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(spec.num_layers)]
