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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inferscale.common.kvquant import QUANTIZED
from inferscale.common.spec import RopeSpec
from inferscale.common.store import CompactKV

from . import cpu_kernels
from .rope import (dequantize_reference, dequantize_rotate_reference, dequantize_rotate_triton, rotate_reference,
                   rotate_torch, rotate_triton)


@dataclass
class LoadPart:
    """The positions of one load that one stored dtype holds."""

    dtype: str
    positions: np.ndarray  # [n] int64
    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None
    token_fact: np.ndarray | None = None

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED


def gather(pieces: list[tuple[CompactKV, int, int, int]]) -> list[LoadPart]:
    """(fact KV, first token, end token, serving position of the first) pieces -> one part per dtype.
    A fact's arrays are numpy (host tier, store) or torch tensors already on the device (the
    device tier, `on_device`); a part joins them with the same library."""
    by_dtype: dict[str, list] = {}
    for f, a, b, start in pieces:
        by_dtype.setdefault(f.dtype, []).append((f, a, b, start))
    parts = []
    for dtype, group in by_dtype.items():
        pos = np.concatenate([np.arange(start, start + b - a) for _, a, b, start in group])
        on_dev = all(isinstance(f.k, torch.Tensor) for f, *_ in group)
        cat, stack = (torch.cat, torch.stack) if on_dev else (np.concatenate, np.stack)
        if not on_dev:  # a mix: bring the device pieces back (rare: the tiers disagree mid-load)
            group = [(_host(f), a, b, start) for f, a, b, start in group]
        k = cat([f.k[:, a:b] for f, a, b, _ in group], 1)
        v = cat([f.v[:, a:b] for f, a, b, _ in group], 1)
        part = LoadPart(dtype, pos, k, v)
        if dtype in QUANTIZED:
            part.k_scale = stack([f.k_scale for f, *_ in group], 1)  # [L, F, KVH, D]
            part.v_scale = stack([f.v_scale for f, *_ in group], 1)
            part.token_fact = np.repeat(np.arange(len(group)), [b - a for _, a, b, _ in group])
        parts.append(part)
    return parts


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
