"""Chunked-RoPE injection: rotate stored pre-RoPE keys to serving positions, scatter K and V.

    k_pre, v:   [n, kv_heads, head_dim]        stored (pre-RoPE) keys and values of n tokens
    cos, sin:   [n, rotary_dim // 2]           RoPE tables at each token's serving position
    slots:      [n] int32                      cache slot of each token (block * block_size + offset);
                                               a negative slot means "padding, write nothing"
    k_cache, v_cache: [num_slots, kv_heads, head_dim]   one layer of the paged cache (flat view)

Two implementations with one contract: `inject_reference` (jax.numpy scatter) and
`inject_pallas` (a Pallas kernel: one program per chunk of tokens, aliased in/out cache so every
slot it does not name keeps its bytes). On CPU the kernel runs with `interpret=True`. Stored
bfloat16 / float16 KV goes in as it is (the kernels rotate in float32 and cast to the cache's dtype).

Compact (quantised) KV is dequantised, rotated and written in one pass by `inject_compact_pallas`
(reference: `inject_compact_reference`), with no float copy of the memory in between:

    k_codes, v_codes: [n, kv_heads, head_dim]   int8 or float8_e4m3fn codes
    k_scale, v_scale: [F, kv_heads, head_dim]   float32 per-channel scales of F facts
    token_fact:       [n] int32                 each token's row of the scales (its fact)

The scales of the two channels RoPE rotates together are equal (`inferscale.common.storage.kvquant`), so
scaling before rotating equals the reference's dequantise-then-rotate exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from inferscale.common.model.spec import RopeSpec
from inferscale.jax.rope import apply_rope


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


def _pad_to_chunks(chunk: int, slots, *per_token):
    """Pad every per-token array (first axis) to whole chunks; padded tokens get slot -1 and write
    nothing. Returns (slots, *per_token)."""
    pad = (-slots.shape[0]) % chunk
    if not pad:
        return (slots, *per_token)
    grow = lambda x: jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    return (jnp.pad(slots, (0, pad), constant_values=-1), *map(grow, per_token))


def inject_pallas(k_cache, v_cache, k_pre, v, cos, sin, slots, rope: RopeSpec, *, chunk=16, interpret=None):
    n, h, d = k_pre.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    slots, k_pre, v, cos, sin = _pad_to_chunks(chunk, slots, k_pre, v, cos, sin)
    tok, whole = _token_spec(chunk), pl.BlockSpec()
    r2 = cos.shape[-1]
    call = _cache_call(functools.partial(_inject_kernel, rope=rope, chunk=chunk), slots.shape[0] // chunk,
                       [whole, tok((r2,)), tok((r2,)), tok((h, d)), tok((h, d))], k_cache, v_cache, interpret)
    return call(slots.astype(jnp.int32), cos, sin, k_pre, v, k_cache, v_cache)


def _token_spec(chunk: int):
    """The BlockSpec of a per-token array: `chunk` tokens per program."""
    return lambda shape: pl.BlockSpec((chunk, *shape), lambda i: (i,) + (0,) * len(shape))


def _cache_call(kernel, chunks: int, in_specs: list, k_cache, v_cache, interpret: bool):
    """A pallas_call over `chunks` programs whose last two inputs are the caches, aliased to its
    outputs (every slot no program writes keeps its bytes)."""
    whole = pl.BlockSpec()
    n_in = len(in_specs) + 2
    return pl.pallas_call(
        kernel,
        grid=(chunks,),
        in_specs=in_specs + [whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        interpret=interpret,
    )


def inject_compact_reference(k_cache, v_cache, k_codes, v_codes, k_scale, v_scale, token_fact, cos, sin, slots,
                             rope: RopeSpec):
    k = k_codes.astype(jnp.float32) * k_scale[token_fact]  # [n, h, d] float32: the reference dequantisation
    v = v_codes.astype(jnp.float32) * v_scale[token_fact]
    return inject_reference(k_cache, v_cache, k, v, cos, sin, slots, rope)


def _inject_compact_kernel(slots_ref, fact_ref, cos_ref, sin_ref, k_ref, v_ref, ks_ref, vs_ref, kc_in, vc_in,
                           kc_out, vc_out, *, rope, chunk):
    del kc_in, vc_in  # aliased to kc_out / vc_out
    c = pl.program_id(0)

    def body(j, carry):
        slot = slots_ref[c * chunk + j]

        @pl.when(slot >= 0)
        def _():
            f = fact_ref[c * chunk + j]
            k = k_ref[j].astype(jnp.float32) * ks_ref[f]  # [h, d]: this token's codes times its fact's scales
            k = apply_rope(k[None], cos_ref[j][None], sin_ref[j][None], rope)[0]
            kc_out[slot] = k.astype(kc_out.dtype)
            vc_out[slot] = (v_ref[j].astype(jnp.float32) * vs_ref[f]).astype(vc_out.dtype)

        return carry

    jax.lax.fori_loop(0, chunk, body, 0)


def inject_compact_pallas(k_cache, v_cache, k_codes, v_codes, k_scale, v_scale, token_fact, cos, sin, slots,
                          rope: RopeSpec, *, chunk=16, interpret=None):
    n, h, d = k_codes.shape
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    slots, k_codes, v_codes, cos, sin, token_fact = _pad_to_chunks(chunk, slots, k_codes, v_codes, cos, sin,
                                                                   token_fact)
    tok, whole = _token_spec(chunk), pl.BlockSpec()
    r2 = cos.shape[-1]
    call = _cache_call(functools.partial(_inject_compact_kernel, rope=rope, chunk=chunk), slots.shape[0] // chunk,
                       [whole, whole, tok((r2,)), tok((r2,)), tok((h, d)), tok((h, d)), whole, whole],
                       k_cache, v_cache, interpret)
    return call(slots.astype(jnp.int32), token_fact.astype(jnp.int32), cos, sin, k_codes, v_codes,
                k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), k_cache, v_cache)
