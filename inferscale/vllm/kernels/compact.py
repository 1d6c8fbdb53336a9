"""The connector's loads in the stores' own layout: gathered per stored dtype, dequantised and
rotated layer by layer, straight into the cache's dtype.

A load covers plan positions [first, end) whose segments come from the user's store and the
shared one (the header), which may keep different dtypes. `gather` groups the pieces by dtype
(plain numpy, no dequantisation); `layer_kv` turns one group's layer into the K (rotated to its
serving positions) and V that the attention backend writes:

    part.k, part.v:      [L, n, KVH, D]   as stored (float32/16, bfloat16, int8 or e4m3 bytes)
    part.k_scale, v_scale: [L, F, KVH, D] float32 scales of the part's F facts (quantised only)
    part.token_fact:     [n]              each token's fact in the part
    -> k_rot, v          [n, KVH, D]      in the cache's dtype

Keys are dequantised and rotated in one pass over the stored codes, with no float copy of the
memory in between: by `dequantize_rotate_triton` on CUDA, by the Numba kernels of `cpu_kernels` on
CPU (`rotate_torch`, several torch passes, where Numba is missing); values are scaled per layer.

On CPU (float32 or bfloat16 caches, in the layout learned from the attention backend's own write:
`paged_write.py`), `prepare_paged` goes further: the pieces are read where the host tier keeps them
and written straight into the cache slots (any layers per call: all at once, one at a time, or split
over threads; `write_paged` does all it is given in one), so neither the joined part nor the
per-layer K / V exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from inferscale.common.storage.kvquant import QUANTIZED
from inferscale.common.model.spec import RopeSpec
from inferscale.common.storage.format import CompactKV
from inferscale.vllm.kernels import cpu_kernels, paged_write
from inferscale.vllm.kernels.chunked_rope import (
    dequantize_reference,
    dequantize_rotate_reference,
    dequantize_rotate_triton,
    rotate_reference,
    rotate_torch,
    rotate_triton,
)
from inferscale.vllm.kernels.cache_layout import PagedLayout


@dataclass
class LoadPart:
    """The positions of one load that one stored dtype holds: its pieces (a fact's tokens [a, b),
    in position order), and, joined on first use, their K / V / scales (`layer_kv` reads those;
    `write_paged` reads the pieces themselves and never joins them)."""

    dtype: str
    positions: np.ndarray  # [n] int64
    pieces: list[tuple[CompactKV, int, int]]

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def on_device(self) -> bool:
        return isinstance(self.pieces[0][0].k, torch.Tensor)

    def _join(self, name: str):
        cat = torch.cat if self.on_device else np.concatenate
        return cat([getattr(f, name)[:, a:b] for f, a, b in self.pieces], 1)

    @cached_property
    def k(self):  # [L, n, KVH, D]
        return self._join("k")

    @cached_property
    def v(self):
        return self._join("v")

    @cached_property
    def k_scale(self):  # [L, F, KVH, D]
        return self._stack("k_scale")

    @cached_property
    def v_scale(self):
        return self._stack("v_scale")

    @cached_property
    def token_fact(self):  # [n]
        return np.repeat(np.arange(len(self.pieces)), [b - a for _, a, b in self.pieces]) if self.quantized else None

    def _stack(self, name: str):
        if not self.quantized:
            return None
        return (torch.stack if self.on_device else np.stack)([getattr(f, name) for f, _, _ in self.pieces], 1)


def gather(pieces: list[tuple[CompactKV, int, int, int]]) -> list[LoadPart]:
    """(fact KV, first token, end token, serving position of the first) pieces -> one part per dtype.
    A fact's arrays are numpy (host tier, store) or torch tensors already on the device (the
    device tier, `on_device`); a part holds one kind (device pieces of a mixed part come back)."""
    by_dtype: dict[str, list] = {}
    for f, a, b, start in pieces:
        by_dtype.setdefault(f.dtype, []).append((f, a, b, start))
    parts = []
    for dtype, group in by_dtype.items():
        pos = np.concatenate([np.arange(start, start + b - a) for _, a, b, start in group])
        if not all(isinstance(f.k, torch.Tensor) for f, *_ in group):  # a mix: rare (tiers disagree mid-load)
            group = [(_host(f), a, b, start) for f, a, b, start in group]
        parts.append(LoadPart(dtype, pos, [(f, a, b) for f, a, b, _ in group]))
    return parts


def prepare_paged(part: LoadPart, slots: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
                  ropes: list[RopeSpec], layer_rope: list[int], layout: PagedLayout,
                  streaming: bool = True) -> paged_write.PreparedWrite:
    """The CPU path that skips `layer_kv` and the backend's cache write: the part's pieces, read as
    stored, set up once for `paged_write`'s kernel, which then writes any layers into their caches
    (`prepared(layers, caches)`) in the layout the connector learned from the backend's own write
    (`paged_write.learn_layout`)."""
    host = [_host(f) for f, _, _ in part.pieces]  # device-tier tensors on CPU: numpy views, no copy
    k_sc = [f.k_scale for f in host] if part.quantized else None
    v_sc = [f.v_scale for f in host] if part.quantized else None
    return paged_write.PreparedWrite([f.k for f in host], [f.v for f in host], [(a, b) for _, a, b in part.pieces],
                                     k_sc, v_sc, part.dtype, [c for c, _ in tables], [s for _, s in tables], ropes,
                                     layer_rope, slots, layout, streaming)


def write_paged(part: LoadPart, layers: list[int], caches: list[torch.Tensor], slots: torch.Tensor,
                tables: list[tuple[torch.Tensor, torch.Tensor]], ropes: list[RopeSpec], layer_rope: list[int],
                layout: PagedLayout, streaming: bool = True) -> None:
    """`prepare_paged`, then layers `layers` written into `caches` (caches[j]: layer layers[j]'s;
    `streaming`: full blocks in streaming stores, see `paged_write.PreparedWrite`)."""
    prepare_paged(part, slots, tables, ropes, layer_rope, layout, streaming)(layers, caches)


def on_device(f: CompactKV, device) -> CompactKV:
    """`f` with its codes, values and scales as torch tensors on `device` (a device-tier entry)."""
    move = lambda x: None if x is None else to_torch(x, device)  # noqa: E731
    return CompactKV(f.fact_id, f.token_ids, move(f.k), move(f.v), f.dtype, move(f.k_scale), move(f.v_scale))


def _host(f: CompactKV) -> CompactKV:
    if not isinstance(f.k, torch.Tensor):
        return f
    back = lambda x: None if x is None else _to_numpy(x)  # noqa: E731
    return CompactKV(f.fact_id, f.token_ids, back(f.k), back(f.v), f.dtype, back(f.k_scale), back(f.v_scale))


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    x = x.cpu()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def to_torch(x, device) -> torch.Tensor:
    """A numpy array (ml_dtypes bfloat16 included), or a tensor, as a torch tensor on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(x).to(device)


PATHS = ("auto", "numba", "torch", "reference")


def layer_kv(part: LoadPart, layer: int, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec,
             dtype: torch.dtype, device, path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """K rotated to the part's positions (`cos`/`sin` at them) and V, for one layer, as `dtype`.

    path: "auto" - Triton on CUDA; on CPU the Numba kernels (`cpu_kernels`) where Numba is
          installed, else "torch"; "numba" / "torch" - that CPU path; "reference" - the torch
          references (what tests and `benchmarks/cpu_paths.py` compare the others with)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    k, v = to_torch(part.k[layer], device), to_torch(part.v[layer], device)
    if path == "auto":
        path = "triton" if device.type == "cuda" else "numba" if cpu_kernels.supports(part.dtype) else "torch"
    if path == "numba":
        return _layer_numba(part, layer, k, v, cos, sin, rope, dtype)
    if not part.quantized:  # rotated in float32, rounded once to the cache's dtype
        if path in ("triton", "reference"):
            rotate = rotate_triton if path == "triton" else rotate_reference
            return rotate(k.float(), cos, sin, rope).to(dtype), v.to(dtype)
        return rotate_torch(k, cos, sin, rope, dtype), v.to(dtype)
    ks, vs = to_torch(part.k_scale[layer], device), to_torch(part.v_scale[layer], device)
    tf = torch.from_numpy(part.token_fact).to(device)
    if path in ("triton", "reference"):
        fused = dequantize_rotate_triton if path == "triton" else dequantize_rotate_reference
        k_rot = fused(k, ks, tf, cos, sin, rope, part.dtype, dtype)
    else:  # scales, then rotation: a RoPE pair shares its scale, so the order does not matter
        k_rot = rotate_torch(dequantize_reference(k, ks, tf, part.dtype), cos, sin, rope, dtype)
    return k_rot, dequantize_reference(v, vs, tf, part.dtype, dtype)


def _layer_numba(part: LoadPart, layer: int, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rope: RopeSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernels: keys dequantised and rotated in one pass (float32, then rounded once to
    `dtype`); values widened by torch (one pass already) or dequantised by the kernel."""
    if not part.quantized:
        k_rot = cpu_kernels.dequantize_rotate_cpu(k, None, None, cos, sin, rope, part.dtype)
        return k_rot.to(dtype), v.to(dtype)
    ks, vs = to_torch(part.k_scale[layer], "cpu"), to_torch(part.v_scale[layer], "cpu")
    tf = torch.from_numpy(part.token_fact)
    k_rot = cpu_kernels.dequantize_rotate_cpu(k, ks, tf, cos, sin, rope, part.dtype)
    return k_rot.to(dtype), cpu_kernels.dequantize_cpu(v, vs, tf, part.dtype).to(dtype)
