"""Chunked-RoPE injection: rotate stored pre-RoPE keys to serving positions, scatter K and V.

    k_pre, v:   [n, kv_heads, head_dim]        stored (pre-RoPE) keys and values of n tokens
    cos, sin:   [n, rotary_dim // 2]           RoPE tables at each token's serving position
    slots:      [n] int32                      cache slot of each token (block * block_size + offset);
                                               a negative slot means "padding, write nothing"
    k_cache, v_cache: [num_slots, kv_heads, head_dim]   one layer of the paged cache (flat view)

Two implementations with one contract: `inject_reference` (jax.numpy scatter) and
`inject_pallas` (a Pallas kernel: one program per chunk of tokens, aliased in/out cache so every
slot it does not name keeps its bytes). On CPU the kernel runs with `interpret=True`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from inferscale.common.spec import RopeSpec

from .rope import apply_rope


def inject_reference(k_cache, v_cache, k_pre, v, cos, sin, slots, rope: RopeSpec):
    k = apply_rope(k_pre[None], cos[None], sin[None], rope)[0]
    num_slots = k_cache.shape[0]
    idx = jnp.where(slots >= 0, slots, num_slots)  # out of range -> dropped
    k_cache = k_cache.at[idx].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[idx].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def _inject_kernel(slots_ref, cos_ref, sin_ref, k_ref, v_ref, kc_in, vc_in, kc_out, vc_out, *, rope, chunk):
    del kc_in, vc_in  # aliased to kc_out / vc_out
    c = pl.program_id(0)
    k = apply_rope(k_ref[...][None], cos_ref[...][None], sin_ref[...][None], rope)[0]  # [chunk, h, d]
    v = v_ref[...]

    def body(j, carry):
        slot = slots_ref[c * chunk + j]

        @pl.when(slot >= 0)
        def _():
            kc_out[slot] = k[j].astype(kc_out.dtype)
            vc_out[slot] = v[j].astype(vc_out.dtype)

        return carry

    jax.lax.fori_loop(0, chunk, body, 0)


def inject_pallas(k_cache, v_cache, k_pre, v, cos, sin, slots, rope: RopeSpec, *, chunk=16, interpret=None):
    n, h, d = k_pre.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    pad = (-n) % chunk
    if pad:  # pad to whole chunks; padded tokens get slot -1 and write nothing
        k_pre = jnp.pad(k_pre, ((0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, pad), (0, 0), (0, 0)))
        cos = jnp.pad(cos, ((0, pad), (0, 0)))
        sin = jnp.pad(sin, ((0, pad), (0, 0)))
        slots = jnp.pad(slots, (0, pad), constant_values=-1)
    r2 = cos.shape[-1]
    tok = lambda shape: pl.BlockSpec((chunk, *shape), lambda i: (i,) + (0,) * len(shape))
    whole = pl.BlockSpec()
    kernel = functools.partial(_inject_kernel, rope=rope, chunk=chunk)
    return pl.pallas_call(
        kernel,
        grid=((n + pad) // chunk,),
        in_specs=[whole, tok((r2,)), tok((r2,)), tok((h, d)), tok((h, d)), whole, whole],
        out_specs=[whole, whole],
        out_shape=[
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret,
    )(slots.astype(jnp.int32), cos, sin, k_pre, v, k_cache, v_cache)
