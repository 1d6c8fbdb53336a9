"""Compact KV: int8 and fp8 (e4m3) storage with explicit scales, and the float reference.

Scales are per channel, per layer and KV head, over one fact's tokens ("channel" scheme):

    x:     [L, n, KVH, D] float32 (pre-RoPE K, or V)
    scale: [L, KVH, D]    float32, so that x ~= q * scale[:, None]   (q int8 or e4m3)

The two channels that RoPE rotates together share one scale (split halves (i, i + r/2) or
interleaved pairs (2i, 2i + 1), over the first `rotary_dim` channels), so rotating the dequantised
pair equals dequantising the rotated pair: a kernel may rotate the compact values and scale after.

Bounds per element, with m = the scale group's max |x|: int8 |x - x'| <= m / 254; fp8 e4m3 (max
448, 3 mantissa bits) |x - x'| <= max(2^-4 |x|, m / 448 * 2^-10) (relative in the normal range,
half the subnormal spacing below it). Quantising what was dequantised gives the same codes, so a
shard rewritten after a deletion loses nothing more.
"""

from __future__ import annotations

import numpy as np

QUANTIZED = {"int8": 127.0, "float8_e4m3": 448.0}  # dtype -> the largest code value


def _fp8():
    import ml_dtypes  # jax's dependency

    return ml_dtypes.float8_e4m3fn


def pair_partner(head_dim: int, rotary_dim: int, style: str) -> np.ndarray:
    """[head_dim] int: for each channel, the channel RoPE rotates it with (itself past rotary_dim)."""
    idx = np.arange(head_dim)
    half = rotary_dim // 2
    if style == "split":
        idx[:half], idx[half:rotary_dim] = np.arange(half, rotary_dim), np.arange(half)
    elif style == "interleaved":
        idx[:rotary_dim] = np.arange(rotary_dim) ^ 1
    else:
        raise ValueError(f"unknown RoPE style {style!r}")
    return idx


def channel_scales(x: np.ndarray, dtype: str, partner: np.ndarray | None = None) -> np.ndarray:
    """[L, KVH, D] float32 scales of x [L, n, KVH, D]; pairs given by `partner` share theirs."""
    m = np.abs(x).max(axis=1)  # [L, KVH, D]
    if partner is not None:
        m = np.maximum(m, m[..., partner])
    return (np.where(m > 0, m, 1.0) / QUANTIZED[dtype]).astype(np.float32)


def quantize(x: np.ndarray, dtype: str, partner: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale): int8 [L, n, KVH, D], or e4m3 stored as uint8 bytes; scale [L, KVH, D]."""
    if dtype not in QUANTIZED:
        raise ValueError(f"not a quantised KV dtype: {dtype!r} (one of {', '.join(QUANTIZED)})")
    scale = channel_scales(x, dtype, partner)
    y = np.asarray(x, np.float32) / scale[:, None]
    if dtype == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8), scale
    return np.clip(y, -448.0, 448.0).astype(_fp8()).view(np.uint8), scale


def dequantize(codes: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 reference: codes * scale, [L, n, KVH, D]."""
    if dtype == "int8":
        values = codes.astype(np.float32)
    elif dtype == "float8_e4m3":
        values = codes.view(_fp8()).astype(np.float32)
    else:
        raise ValueError(f"not a quantised KV dtype: {dtype!r}")
    return values * scale[:, None]
