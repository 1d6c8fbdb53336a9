"""What a load pipeline is: one backend's dequantise -> rotate -> write of a staged load's memory
KV into vLLM's paged KV cache. There are two, and the connector's worker picks one per staged load
(`ConnectorWorker._pipeline`):

- `cpu_pipeline.CpuPagedPipeline`: CPU caches whose layout was learned from the backend's own
  write, every stored dtype one the Numba kernels read, `kv_write` not "backend": one Numba pass
  per layer writes straight into the paged cache (`paged_write.PreparedWrite`);
- `backend_pipeline.BackendPipeline`: everything else (GPU caches, `kv_write: "backend"`, a layout
  not learned, a dtype the CPU kernels do not read): `compact.layer_kv` (Triton on CUDA, Numba or
  torch on CPU), then the attention backend's own `layer.impl.do_kv_cache_update`.

Both take the same staged parts and write the same bytes into a CPU cache where both apply
(tests/vllm/kernels/test_load_pipelines.py). A load is prepared once (`prepare`, in
`start_load_kv`) and its layers written in any groups (`write`): all at once (sync), one at a time
right before each layer's attention (layerwise), or on the writer thread (background).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

from inferscale.vllm.kernels.compact import LoadPart

# One stored dtype's share of a staged load (`ConnectorWorker._stage`):
#   part    LoadPart: its pieces as stored, K / V [L, n, KVH, D] (+ scales) and positions [n]
#   slots   [n] int64 cache slots of its tokens (block_ids[pos // block_size] * block_size + pos % block_size)
#   tables  per distinct RoPE setting r: (cos, sin) [n, ropes[r].rotary_dim // 2] at its serving positions
StagedPart = tuple[LoadPart, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]

P = TypeVar("P")


class LoadPipeline(Protocol[P]):
    """Dequantise -> rotate -> write, one backend's way. `paged`: whether it writes straight into
    the paged cache with the CPU kernel (the worker counts those tokens in `paged_write_tokens`)."""

    paged: bool

    def prepare(self, parts: list[StagedPart], layers: dict[int, Any]) -> P:
        """Set up one staged load's write once: its parts (one per stored dtype) into the caches of
        `layers` (layer index -> vLLM attention layer, its `kv_cache` and `impl`)."""
        ...

    def write(self, prepared: P, ids: list[int]) -> None:
        """Write layers `ids` of a prepared load into their paged caches (any subset, any thread)."""
        ...
