"""RoPE in jax.numpy. Tables come from `inferscale.common.model.rope_tables` (one source of truth)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from inferscale.common.model.rope_tables import cos_sin
from inferscale.common.model.spec import ModelSpec, RopeSpec


def rope_table(rope: RopeSpec, max_position: int) -> jnp.ndarray:
    """cos and sin for every position, stacked: [2, max_position, rotary_dim // 2] float32."""
    cos, sin = cos_sin(rope, np.arange(max_position))
    return jnp.asarray(np.stack([cos, sin]))


def rope_tables(spec: ModelSpec, max_position: int) -> jnp.ndarray:
    """One table per distinct RoPE setting of the model (`spec.ropes`): [R, 2, max_position, r // 2]."""
    return jnp.stack([rope_table(r, max_position) for r in spec.ropes])


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, rope: RopeSpec) -> jnp.ndarray:
    """Rotate x [..., T, heads, head_dim] by cos/sin [..., T, rotary_dim // 2].

    Rotation is done in float32 and cast back to x's dtype. Channels past rotary_dim pass through.
    """
    r = rope.rotary_dim
    dtype = x.dtype
    x = x.astype(jnp.float32)
    c, s = cos[..., None, :], sin[..., None, :]
    rot, rest = x[..., :r], x[..., r:]
    if rope.style == "split":
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    return jnp.concatenate([out, rest], axis=-1).astype(dtype)
