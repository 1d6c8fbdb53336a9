"""The CPU load pipeline: stored facts straight into vLLM's CPU paged KV cache, in the layout the
connector learned from the attention backend's own write (`paged_write.learn_layout`), by one
Numba kernel that does all three steps per layer in one pass (`paged_write.PreparedWrite`):

    per stored dtype (a `StagedPart`), read where the host tier keeps it (never joined):
      ks[p], vs[p]         [L, n_p, KVH, D]  a fact's K / V as stored (float32, bfloat16, int8, e4m3)
      k_scale, v_scale     [L, KVH, D]       float32 per fact (int8 / e4m3 only)
      cos, sin             [n, rotary_dim // 2] at the n serving positions, per RoPE setting
      slots                [n]               int64 cache slots
    1. dequantise  K and V codes * their fact's scales, in float32 registers
    2. rotate      K's RoPE pairs to the serving positions (layer l: its own RoPE setting)
    3. write       rounded once to the cache's dtype (float32, or bfloat16 nearest-even), stored
                   at the slot's elements of the learned layout; whole blocks in streaming stores
                   (`kv_write: "auto"`), else plain stores (`"plain"`); the same bits either way
    -> cache[layer]        [num_blocks, ...] vLLM's, only the load's slots written

No float copy of the memory exists between the steps. Layers that share a layout (one kind of
layer) share one prepared write; a write of several layers is split over threads, disjoint layers
each (`write_threads.WritePool`, `split_write`: the cores of vLLM's worker team, idle while the
connector writes). It applies where every stored dtype is one the kernels read
(`cpu_kernels.supports`) and every layer's layout is known (`CacheLayouts.of`); the connector
uses `backend_pipeline` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inferscale.common.model.spec import ModelSpec
from inferscale.vllm.kernels.compact import prepare_paged
from inferscale.vllm.kernels.load_pipeline import StagedPart
from inferscale.vllm.kernels.paged_write import PreparedWrite
from inferscale.vllm.write_threads import WritePool, split_write

if TYPE_CHECKING:
    from inferscale.vllm.cache_layouts import CacheLayouts


@dataclass
class PagedWrites:
    """One staged load set up for the kernel: per stored dtype and group of layers sharing a
    layout, its prepared write and those layers; the layers themselves (their caches)."""

    groups: list[tuple[PreparedWrite, set[int]]]
    layers: dict[int, Any]


class CpuPagedPipeline:
    """The CPU kernel's pipeline (`LoadPipeline[PagedWrites]`); `close()` stops its helper threads."""

    paged = True

    def __init__(self, spec: ModelSpec, layouts: "CacheLayouts", streaming: bool = True,
                 threads: int | None = None) -> None:
        self.spec, self.layouts, self.streaming = spec, layouts, streaming
        self._threads = threads  # a write of several layers split over this many (None: torch's intra-op threads)
        self._pool: WritePool | None = None  # the helpers, built at the first write of several layers

    def prepare(self, parts: list[StagedPart], layers: dict[int, Any]) -> PagedWrites:
        layouts = self.layouts.of(layers)  # learned already (the worker chose this pipeline by them)
        if layouts is None:
            raise RuntimeError("the CPU paged write needs every layer's cache layout")
        groups: dict[int, set[int]] = {}  # layers that share a layout
        for i in layers:
            groups.setdefault(id(layouts[i]), set()).add(i)
        spec = self.spec
        layer_rope = [spec.layer_rope_index(i) for i in range(spec.num_layers)]
        return PagedWrites([(prepare_paged(part, slots, tables, spec.ropes, layer_rope, layouts[min(group)],
                                           self.streaming), group)
                            for group in groups.values() for part, slots, tables in parts], layers)

    def write(self, prepared: PagedWrites, ids: list[int]) -> None:
        threads = self._pool_threads() if len(ids) > 1 else 1  # (one layer: also the background writer's call)
        pool = self._pool.pool if threads > 1 else None
        for write, group in prepared.groups:
            mine = [i for i in ids if i in group]
            if mine:
                split_write(write, mine, [prepared.layers[i].kv_cache for i in mine], pool, threads)

    def _pool_threads(self) -> int:
        """How many threads a write of several layers is split over (the helpers built once)."""
        if self._pool is None:
            self._pool = WritePool(self._threads or torch.get_num_threads())
        return self._pool.threads

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
