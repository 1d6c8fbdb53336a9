"""RoPE frequency and cos/sin tables: the one source of truth for both engines.

Tables are computed in float64 and handed out as float32. `apply_rope` here is the numpy
reference of the rotation; the engines have their own array-library versions and are tested
against it.
"""

from __future__ import annotations

import math

import numpy as np

from inferscale.common.model.spec import RopeSpec


def inv_freq(rope: RopeSpec) -> np.ndarray:
    """Inverse frequencies, shape [rotary_dim // 2], float64 (llama3 or linear scaling applied)."""
    d = rope.rotary_dim
    freqs = 1.0 / (rope.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if rope.scaling == "linear":  # position interpolation: positions / factor
        return freqs / rope.factor
    if rope.scaling == "longrope":  # within the original context: one short factor per pair
        return freqs / np.asarray(rope.short_factor, dtype=np.float64)
    if rope.scaling == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / freqs
        scaled = np.where(wavelen > low_wavelen, freqs / rope.factor, freqs)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freqs = np.where(medium, smoothed, scaled)
    return freqs


def cos_sin(rope: RopeSpec, positions) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position * inv_freq, each [*positions.shape, rotary_dim // 2], float32."""
    pos = np.asarray(positions, dtype=np.float64)
    if pos.size and pos.min() < 0:
        raise ValueError(f"RoPE positions must be >= 0, got min {pos.min()}")
    angles = pos[..., None] * inv_freq(rope)
    m = rope.attention_factor  # 1 except for longrope, whose tables carry its attention scale
    return (m * np.cos(angles)).astype(np.float32), (m * np.sin(angles)).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope: RopeSpec) -> np.ndarray:
    """Rotate x [..., T, heads, head_dim] by tables [..., T, rotary_dim // 2] (numpy reference)."""
    r = rope.rotary_dim
    c, s = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    rot, rest = x[..., :r], x[..., r:]
    if rope.style == "split":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    return np.concatenate([out.astype(x.dtype), rest], axis=-1)
