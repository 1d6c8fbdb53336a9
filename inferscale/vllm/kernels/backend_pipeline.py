"""The backend load pipeline: each layer's K (rotated) and V built from the stored facts, then
written by the attention backend's own cache write, whatever its layout. The connector's path on
a GPU, and on CPU where the kernel's does not apply (`kv_write: "backend"`, a layout not learned,
a stored dtype the CPU kernels do not read):

    per stored dtype (a `StagedPart`), per layer i written:
      part.k, part.v       [L, n, KVH, D]  as stored (float32/16, bfloat16, int8 or e4m3 codes), joined
      part.k_scale, v_scale [L, F, KVH, D] float32 scales of the part's F facts (quantised only)
      part.token_fact      [n]             each token's fact
      cos, sin             [n, rotary_dim // 2] at the serving positions (layer i's RoPE setting)
    1+2. dequantise, rotate  `compact.layer_kv`: K dequantised and rotated in one pass over the codes
                   (Triton `dequantize_rotate_triton` on CUDA, the Numba kernels of `cpu_kernels`
                   on CPU, `rotate_torch` without Numba), V dequantised
                   -> k_rot, v [n, KVH, D] in the cache's dtype (float32 for a cache of fp8 codes)
    3. write       `layer.impl.do_kv_cache_update(layer, k_rot, v, layer.kv_cache, slots [n])`
                   -> the backend's paged cache (and its own quantisation, where it keeps one)

The per-layer K / V exist once per layer and part; the write is vLLM's, so any backend and cache
dtype work. `cpu_pipeline` skips both on CPU caches whose layout it learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inferscale.common.model.spec import ModelSpec
from inferscale.vllm.kernels.compact import layer_kv
from inferscale.vllm.kernels.load_pipeline import StagedPart


@dataclass
class BackendWrites:
    """One staged load for the backend's write: its parts as staged, the layers they go into."""

    parts: list[StagedPart]
    layers: dict[int, Any]


class BackendPipeline:
    """`layer_kv`, then the attention backend's cache write (`LoadPipeline[BackendWrites]`)."""

    paged = False

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def prepare(self, parts: list[StagedPart], layers: dict[int, Any]) -> BackendWrites:
        return BackendWrites(parts, layers)  # nothing to set up: each layer's K / V is built as it is written

    def write(self, prepared: BackendWrites, ids: list[int]) -> None:
        for i in ids:
            layer = prepared.layers[i]
            dtype = layer.kv_cache.dtype if layer.kv_cache.is_floating_point() else torch.float32
            r = self.spec.layer_rope_index(i)
            for part, slots, tables in prepared.parts:
                k_rot, v = layer_kv(part, i, *tables[r], self.spec.ropes[r], dtype, slots.device)
                layer.impl.do_kv_cache_update(layer, k_rot, v, layer.kv_cache, slots)
