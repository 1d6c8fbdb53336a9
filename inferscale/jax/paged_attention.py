"""Attention of new tokens over a paged KV cache (causal among the new tokens).

    q:            [T, num_heads, head_dim]            already rotated to its positions
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]   one layer of the cache, which
                                                      already holds the new tokens' K and V
    block_table:  [max_blocks] int32                  the sequence's blocks in position order
    q_positions:  [T] int32                           position of each query token
    scale:        query scale (default head_dim ** -0.5); window: sliding-window size or None
    -> out        [T, num_heads, head_dim]

Query t attends to every cached position p <= q_positions[t] of its sequence (with a window, only
to q_positions[t] - p < window); since the cache holds the injected memory and the earlier new
tokens, this is causal attention over the whole prompt. `paged_attention_reference` gathers the sequence and runs dense masked softmax;
`paged_attention_pallas` walks the block table with an online softmax, one program per
(query token, kv head), never materialising the gathered sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30


def _visible(pos, qpos, window):
    """Which key positions a query at qpos sees: causal, and within the window if there is one."""
    seen = pos <= qpos
    return seen if window is None else seen & (qpos - pos < window)


def _gathered_scores(q, k_cache, v_cache, block_table, q_positions, scale, window):
    """The sequence's keys gathered and scored (the dense references' shared start): scores
    [KVH, G, T, S] float32, values [S, KVH, D] float32, which keys each query sees [T, S]."""
    T, H, D = q.shape
    KVH = k_cache.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k_cache[block_table].reshape(-1, KVH, D).astype(jnp.float32)  # [S, KVH, D]
    v = v_cache[block_table].reshape(-1, KVH, D).astype(jnp.float32)
    qg = q.reshape(T, KVH, H // KVH, D).astype(jnp.float32)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k) * jnp.float32(scale)
    return scores, v, _visible(jnp.arange(k.shape[0])[None, :], q_positions[:, None], window)


def paged_attention_reference(q, k_cache, v_cache, block_table, q_positions, *, scale=None, window=None):
    T, H, D = q.shape
    scores, v, mask = _gathered_scores(q, k_cache, v_cache, block_table, q_positions, scale, window)
    scores = jnp.where(mask[None, None], scores, _NEG)
    p = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", p, v)
    return out.reshape(T, H, D).astype(q.dtype)


def _attn_kernel(bt_ref, qpos_ref, q_ref, kc_ref, vc_ref, o_ref, *, block_size, scale, window):
    t, h = pl.program_id(0), pl.program_id(1)
    q = q_ref[0, 0].astype(jnp.float32)  # [G, D]
    G, D = q.shape
    qpos = qpos_ref[t]

    def body(j, carry):
        m, l, acc = carry
        blk = bt_ref[j]
        k = kc_ref[blk, :, h, :].astype(jnp.float32)  # [bs, D]
        v = vc_ref[blk, :, h, :].astype(jnp.float32)
        s = jnp.dot(q, k.T) * jnp.float32(scale)  # [G, bs]
        pos = j * block_size + jnp.arange(block_size)
        s = jnp.where(_visible(pos, qpos, window)[None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return m_new, alpha * l + p.sum(axis=-1), alpha[:, None] * acc + jnp.dot(p, v)

    init = (jnp.full((G,), _NEG, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, D), jnp.float32))
    first = 0 if window is None else jnp.maximum(qpos - window + 1, 0) // block_size  # blocks before: unseen
    _, l, acc = jax.lax.fori_loop(first, qpos // block_size + 1, body, init)
    o_ref[0, 0] = (acc / l[:, None]).astype(o_ref.dtype)


def paged_attention_pallas(q, k_cache, v_cache, block_table, q_positions, *, scale=None, window=None,
                           interpret=None):
    T, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    G = H // KVH
    scale = D ** -0.5 if scale is None else scale
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    qg = q.reshape(T, KVH, G, D)
    blk = pl.BlockSpec((1, 1, G, D), lambda t, h: (t, h, 0, 0))
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_attn_kernel, block_size=bs, scale=float(scale), window=window),
        grid=(T, KVH),
        in_specs=[whole, whole, blk, whole, whole],
        out_specs=blk,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
    )(block_table.astype(jnp.int32), q_positions.astype(jnp.int32), qg, k_cache, v_cache)
    return out.reshape(T, H, D)


def paged_attention_grouped(q, k_cache, v_cache, block_table, q_positions, memory, mass, *, scale=None,
                            window=None):
    """APE's attention (arXiv 2502.05431): the memory's keys form a group whose share of attention is
    rescaled. Within each group weights are softmax as usual; the groups are merged with the memory
    group's log-sum-exp multiplied by `mass` (APE's scaling factor times its temperature; the
    temperature itself is on the memory's keys, scaled when injected):

        w_j = exp(s_j - L_m + mass * L_m - Z)   for memory keys j (L_m: their log-sum-exp)
        w_j = exp(s_j - Z)                      for the others,  Z normalising the sum to 1

    `mass` = 1 is plain attention. memory: [max_blocks * block_size] bool by sequence position;
    mass: a float32 scalar. Plain jnp (no fast path: only the JAX engine's `ape` policy uses it)."""
    T, H, D = q.shape
    scores, v, seen = _gathered_scores(q, k_cache, v_cache, block_table, q_positions, scale, window)
    mem = memory[: v.shape[0]][None, :]
    in_mem, in_rest = seen & mem, seen & ~mem
    lse = lambda m: jax.nn.logsumexp(jnp.where(m[None, None], scores, _NEG), axis=-1, keepdims=True)
    l_mem, l_rest = lse(in_mem), lse(in_rest)  # [KVH, G, T, 1]
    has_mem = in_mem.any(-1)[None, None, :, None]
    a_mem = jnp.where(has_mem, jnp.float32(mass) * l_mem, _NEG)  # the memory group's rescaled log-mass
    z = jnp.logaddexp(a_mem, l_rest)
    logw = jnp.where(mem[None, None], scores - l_mem + a_mem - z, scores - z)
    p = jnp.where(seen[None, None], jnp.exp(logw), 0.0)
    out = jnp.einsum("kgts,skd->tkgd", p, v)
    return out.reshape(T, H, D).astype(q.dtype)
