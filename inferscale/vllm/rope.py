"""Chunked RoPE for the vLLM path: rotate stored pre-RoPE keys to their serving positions.

    k_pre:     [n, kv_heads, head_dim]   stored keys (any float dtype)
    cos, sin:  [n, rotary_dim // 2]      float32, from `inferscale.common.rope` (one source of truth)
    -> k       [n, kv_heads, head_dim]   same dtype as k_pre

`rotate_reference` is plain torch; `rotate_triton` is a Triton kernel (one program per token and
head) for GPUs, checked against the reference (on CPU through Triton's interpreter,
TRITON_INTERPRET=1). The write into the paged cache is the attention backend's own op, so no
cache layout is assumed here.
"""

from __future__ import annotations

import numpy as np
import torch

from inferscale.common.rope import cos_sin
from inferscale.common.spec import RopeSpec


class RopeTable:
    """cos/sin for positions [0, max_position) as torch tensors, built once per process."""

    def __init__(self, rope: RopeSpec, max_position: int, device="cpu") -> None:
        cos, sin = cos_sin(rope, np.arange(max_position))
        self.rope = rope
        self.max_position = max_position
        self.cos = torch.from_numpy(cos).to(device)
        self.sin = torch.from_numpy(sin).to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() and int(positions.max()) >= self.max_position:
            raise ValueError(f"position {int(positions.max())} is beyond the model's {self.max_position}")
        return self.cos[positions], self.sin[positions]


def rotate_reference(k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    r = rope.rotary_dim
    x = k_pre.float()
    c, s = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    if rope.style == "split":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1).to(k_pre.dtype)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(k_ptr, cos_ptr, sin_ptr, out_ptr, H, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK: tl.constexpr, REST: tl.constexpr, INTERLEAVED: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        base = (t * H + h) * D
        i = tl.arange(0, BLOCK)
        m = i < HALF
        c = tl.load(cos_ptr + t * HALF + i, mask=m, other=0.0)
        s = tl.load(sin_ptr + t * HALF + i, mask=m, other=0.0)
        if INTERLEAVED:
            a_off, b_off = 2 * i, 2 * i + 1
        else:
            a_off, b_off = i, i + HALF
        a = tl.load(k_ptr + base + a_off, mask=m, other=0.0).to(tl.float32)
        b = tl.load(k_ptr + base + b_off, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + a_off, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + base + b_off, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=m)
        if REST > 0:  # channels past rotary_dim pass through
            j = tl.arange(0, REST)
            x = tl.load(k_ptr + base + 2 * HALF + j)
            tl.store(out_ptr + base + 2 * HALF + j, x)

    return rope_kernel


_KERNEL = None


def rotate_triton(k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    global _KERNEL  # the compiled kernel object, built on first use (no import-time triton)
    if _KERNEL is None:
        _KERNEL = _kernel()
    n, h, d = k_pre.shape
    half = rope.rotary_dim // 2
    rest = d - rope.rotary_dim
    if rest & (rest - 1):
        raise ValueError(f"the Triton RoPE kernel needs head_dim - rotary_dim to be 0 or a power of two, got {rest}")
    k_pre, cos, sin = k_pre.contiguous(), cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty_like(k_pre)
    if n:
        block = 1 << max(0, (half - 1).bit_length())
        _KERNEL[(n, h)](k_pre, cos, sin, out, h, D=d, HALF=half, BLOCK=block, REST=rest,
                        INTERLEAVED=rope.style == "interleaved")
    return out
