"""Chunked RoPE for the vLLM path: rotate stored pre-RoPE keys to their serving positions.

    k_pre:     [n, kv_heads, head_dim]   stored keys (any float dtype)
    cos, sin:  [n, rotary_dim // 2]      float32, from `inferscale.common.model.rope_tables` (one source of truth)
    -> k       [n, kv_heads, head_dim]   same dtype as k_pre

`rotate_reference` is plain torch; `rotate_torch` is the CPU fast path (two passes over the keys,
the stored dtype widened on the way); `rotate_triton` is a Triton kernel (one program per token and
head) for GPUs. Both are checked against the reference (the kernel on CPU through Triton's
interpreter, TRITON_INTERPRET=1). The write into the paged cache is the attention backend's own op, so no
cache layout is assumed here.

Compact (quantised) keys are dequantised and rotated in the same pass, straight into the cache's
dtype (`dequantize_rotate_triton`; reference `dequantize_rotate_reference`):

    codes:       [n, kv_heads, head_dim]   int8, or float8_e4m3 codes as uint8 bytes
    scale:       [F, kv_heads, head_dim]   float32 per-channel scales of F facts
    token_fact:  [n] int64                 each token's fact (its row of `scale`)

RoPE pairs share a scale (`inferscale.common.storage.kvquant`), so scaling then rotating is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from inferscale.common.model.rope_tables import cos_sin
from inferscale.common.model.spec import RopeSpec


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


def rotate_torch(k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`rotate_reference`'s result as `dtype`, in two passes over the keys (the CPU fast path):
    k * [c, c] + swap(k) * [-s, s], where swap exchanges each RoPE pair's halves. Stored bf16 / fp16
    keys are widened by the first multiply (no separate float copy); rounded once to `dtype`.

        k_pre [n, H, D]; cos, sin [n, r // 2] -> [n, H, D]
    """
    n, h, d = k_pre.shape
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    c, s = cos.float()[:, None], sin.float()[:, None]  # [n, 1, half]
    rot = k_pre[..., :r]
    if rope.style == "split":  # pairs (j, j + half)
        cc, ss = torch.cat([c, c], -1), torch.cat([-s, s], -1)  # [n, 1, r]
        swapped = rot.reshape(n, h, 2, half).flip(2).reshape(n, h, r)
    else:  # interleaved pairs (2j, 2j + 1)
        cc, ss = c.repeat_interleave(2, -1), torch.stack([-s, s], -1).flatten(-2)
        swapped = rot.reshape(n, h, half, 2).flip(3).reshape(n, h, r)
    out = torch.mul(rot, cc).addcmul_(swapped, ss)  # float32 [n, H, r]
    if r < d:  # channels past rotary_dim pass through
        out = torch.cat([out, k_pre[..., r:].float()], -1)
    return out.to(dtype)


def _values(codes: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """float32 values of stored codes (int8 or e4m3 bytes) before their scales."""
    if kv_dtype == "float8_e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    if kv_dtype == "int8":
        return codes.float()
    raise ValueError(f"not a quantised KV dtype: {kv_dtype!r}")


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor, token_fact: torch.Tensor, kv_dtype: str,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes * their fact's scales, [n, kv_heads, head_dim] as `dtype` (values: no rotation)."""
    return (_values(codes, kv_dtype) * scale.float()[token_fact]).to(dtype)


def dequantize_rotate_reference(codes: torch.Tensor, scale: torch.Tensor, token_fact: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec, kv_dtype: str,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return rotate_reference(dequantize_reference(codes, scale, token_fact, kv_dtype), cos, sin, rope).to(dtype)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(k_ptr, scale_ptr, fact_ptr, cos_ptr, sin_ptr, out_ptr, H, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK: tl.constexpr, REST: tl.constexpr, INTERLEAVED: tl.constexpr, SCALED: tl.constexpr,
                    FP8: tl.constexpr):
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
        a = tl.load(k_ptr + base + a_off, mask=m, other=0)
        b = tl.load(k_ptr + base + b_off, mask=m, other=0)
        if FP8:  # e4m3 codes arrive as bytes
            a, b = a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True)
        a, b = a.to(tl.float32), b.to(tl.float32)
        if SCALED:  # this token's fact's per-channel scales (a RoPE pair shares one)
            sbase = (tl.load(fact_ptr + t) * H + h) * D
            a = a * tl.load(scale_ptr + sbase + a_off, mask=m, other=0.0)
            b = b * tl.load(scale_ptr + sbase + b_off, mask=m, other=0.0)
        tl.store(out_ptr + base + a_off, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + base + b_off, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=m)
        if REST > 0:  # channels past rotary_dim pass through (dequantised)
            j = tl.arange(0, REST)
            x = tl.load(k_ptr + base + 2 * HALF + j)
            if FP8:
                x = x.to(tl.float8e4nv, bitcast=True)
            if SCALED:
                x = x.to(tl.float32) * tl.load(scale_ptr + sbase + 2 * HALF + j)
            tl.store(out_ptr + base + 2 * HALF + j, x.to(out_ptr.dtype.element_ty))

    return rope_kernel


_KERNEL = None


def _launch(x: torch.Tensor, scale, token_fact, cos, sin, rope: RopeSpec, out: torch.Tensor, fp8: bool):
    global _KERNEL  # the compiled kernel object, built on first use (no import-time triton)
    if _KERNEL is None:
        _KERNEL = _kernel()
    n, h, d = x.shape
    half = rope.rotary_dim // 2
    rest = d - rope.rotary_dim
    if rest & (rest - 1):
        raise ValueError(f"the Triton RoPE kernel needs head_dim - rotary_dim to be 0 or a power of two, got {rest}")
    if n:
        block = 1 << max(0, (half - 1).bit_length())
        scaled = scale is not None
        dummy = cos  # an unused pointer when there are no scales
        _KERNEL[(n, h)](x.contiguous(), scale.float().contiguous() if scaled else dummy,
                        token_fact.contiguous() if scaled else dummy, cos.float().contiguous(),
                        sin.float().contiguous(), out, h, D=d, HALF=half, BLOCK=block, REST=rest,
                        INTERLEAVED=rope.style == "interleaved", SCALED=scaled, FP8=fp8)
    return out


def rotate_triton(k_pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    return _launch(k_pre, None, None, cos, sin, rope, torch.empty_like(k_pre.contiguous()), fp8=False)


def dequantize_rotate_triton(codes: torch.Tensor, scale: torch.Tensor, token_fact: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, rope: RopeSpec, kv_dtype: str,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Compact keys -> rotated keys as `dtype` in one pass (no float copy in between)."""
    if kv_dtype not in ("int8", "float8_e4m3"):
        raise ValueError(f"not a quantised KV dtype: {kv_dtype!r}")
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    return _launch(codes, scale, token_fact, cos, sin, rope, out, fp8=kv_dtype == "float8_e4m3")
