"""A Flax (linen) decoder of every supported family (`inferscale.common.model.families`).

The canonical network is the Llama block; the spec's switches add what other families need: q/k
bias (Qwen2), q/k RMSNorm (Qwen3, Gemma 3), per-layer sliding-window attention with its own RoPE
table (Gemma 3), (1 + w) RMSNorm, sandwich norms, GELU-tanh, scaled embeddings, a query scale
and final-logit soft-capping (Gemma 3).

Parameter names mirror Hugging Face's (`layers_3/self_attn/q_proj/kernel` <- `model.layers.3.
self_attn.q_proj.weight`), see `weights.py`. One forward, two attention modes:

- dense (`cache=None`): causal self-attention over `tokens` [B, T]; used by the fact encoder and
  by model-parity tests. Right padding is harmless (causal: real tokens never see later pads).
  With a `TreeMask` the rows are packed prefix trees (`inferscale.common.prompt.packing`): each token
  attends to exactly its ancestors, sliding windows measured in its own item's positions.
- paged (`cache` given, B == 1): each layer writes the new tokens' K/V into the paged cache
  through the injection kernel (rotating the pre-RoPE keys exactly like injected facts), then the
  new queries attend over the cache with the paged-attention kernel.

Every layer also returns its pre-RoPE K and V (`[B, T, kv_heads, head_dim]`), which is what the
store keeps. RoPE tables arrive stacked per distinct setting, `cos`/`sin` [R, B, T, rotary_dim // 2]
(R = len(spec.ropes): 1, or 2 with sliding layers' local base); layer i uses `spec.layer_rope_index(i)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from inferscale.common.model.spec import ModelSpec
from inferscale.jax.inject import inject_pallas, inject_reference
from inferscale.jax.paged_attention import (
    paged_attention_grouped,
    paged_attention_pallas,
    paged_attention_reference,
)
from inferscale.jax.rope import apply_rope

KERNELS = ("reference", "pallas")


@jax.tree_util.register_dataclass
@dataclass
class PagedBatch:
    """Where the new tokens of one sequence go in the paged cache."""

    slots: jax.Array  # [T] int32, -1 for padding tokens
    block_table: jax.Array  # [max_blocks] int32
    positions: jax.Array  # [T] int32
    memory: jax.Array | None = None  # APE: [max_blocks * block_size] bool, the memory's positions
    mass: jax.Array | None = None  # APE: float32 scalar, the memory group's log-mass factor


@jax.tree_util.register_dataclass
@dataclass
class TreeMask:
    """Which keys each query of a packed row sees (`PackedRow.visible`) and the token positions."""

    visible: jax.Array  # [B, T, T] bool
    positions: jax.Array  # [B, T] int32


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight), in float32; Gemma stores weight - 1 (offset 1)."""

    eps: float
    offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        w = self.param("weight", init, (x.shape[-1],), jnp.float32)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (self.offset + w.astype(jnp.float32))).astype(x.dtype)


def dense_causal_attention(q, k, v, scale: float, window: int | None = None, tree: TreeMask | None = None):
    """q [B,T,H,D], k/v [B,T,KVH,D] (rotated) -> [B,T,H,D]; GQA by grouping query heads.

    Query t attends to positions s <= t, and with a window only to t - s < window. With `tree`,
    query t attends to the keys `tree.visible[:, t]`, with a window only to those less than
    `window` positions before it."""
    B, T, H, D = q.shape
    KVH = k.shape[2]
    qg = q.reshape(B, T, KVH, H // KVH, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * jnp.float32(scale)
    if tree is None:
        t, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        allowed = (j <= t) if window is None else (j <= t) & (t - j < window)
    else:
        allowed = tree.visible
        if window is not None:
            pos = tree.positions
            allowed = allowed & (pos[:, :, None] - pos[:, None, :] < window)
        allowed = allowed[:, None, None]  # [B, 1, 1, T, T]
    s = jnp.where(allowed, s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, H, D).astype(q.dtype)


class Attention(nn.Module):
    spec: ModelSpec
    kernels: str
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, layer_cache=None, paged: PagedBatch | None = None, tree: TreeMask | None = None):
        s = self.spec
        rope, window = s.layer_rope(self.layer), s.layer_window(self.layer)
        B, T, _ = x.shape
        dense = lambda n, name, bias: nn.Dense(n, use_bias=bias, dtype=x.dtype, param_dtype=x.dtype, name=name)
        q = dense(s.num_heads * s.head_dim, "q_proj", s.qkv_bias)(x).reshape(B, T, s.num_heads, s.head_dim)
        k = dense(s.num_kv_heads * s.head_dim, "k_proj", s.qkv_bias)(x).reshape(B, T, s.num_kv_heads, s.head_dim)
        v = dense(s.num_kv_heads * s.head_dim, "v_proj", s.qkv_bias)(x).reshape(B, T, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = RMSNorm(s.rms_norm_eps, s.norm_offset, name="q_norm")(q)
            k = RMSNorm(s.rms_norm_eps, s.norm_offset, name="k_norm")(k)
        k_pre = k  # what the store keeps
        q = apply_rope(q, cos, sin, rope)
        if layer_cache is None:
            o = dense_causal_attention(q, apply_rope(k, cos, sin, rope), v, s.query_scale, window, tree)
        else:
            kc, vc = layer_cache  # [num_blocks, block_size, KVH, D]
            nb, bs = kc.shape[:2]
            flat = lambda c: c.reshape(nb * bs, *c.shape[2:])
            inject = inject_pallas if self.kernels == "pallas" else inject_reference
            kf, vf = inject(flat(kc), flat(vc), k_pre[0], v[0], cos[0], sin[0], paged.slots, rope)
            layer_cache = (kf.reshape(kc.shape), vf.reshape(vc.shape))
            if paged.memory is not None:  # APE: the memory's share of attention rescaled
                o = paged_attention_grouped(q[0], *layer_cache, paged.block_table, paged.positions, paged.memory,
                                            paged.mass, scale=s.query_scale, window=window)[None]
            else:
                attend = paged_attention_pallas if self.kernels == "pallas" else paged_attention_reference
                o = attend(q[0], *layer_cache, paged.block_table, paged.positions, scale=s.query_scale,
                           window=window)[None]
        out = dense(s.hidden_size, "o_proj", False)(o.reshape(B, T, -1))
        return out, layer_cache, (k_pre, v)


ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": lambda x: nn.gelu(x, approximate=True)}


class MLP(nn.Module):
    spec: ModelSpec

    @nn.compact
    def __call__(self, x):
        d = lambda n, name: nn.Dense(n, use_bias=False, dtype=x.dtype, param_dtype=x.dtype, name=name)
        act = ACTIVATIONS[self.spec.hidden_act]
        return d(self.spec.hidden_size, "down_proj")(
            act(d(self.spec.intermediate_size, "gate_proj")(x)) * d(self.spec.intermediate_size, "up_proj")(x)
        )


class DecoderLayer(nn.Module):
    spec: ModelSpec
    kernels: str
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, layer_cache=None, paged=None, tree=None):
        s = self.spec
        norm = lambda name: RMSNorm(s.rms_norm_eps, s.norm_offset, name=name)
        i = s.layer_rope_index(self.layer)
        h, layer_cache, kv = Attention(s, self.kernels, self.layer, name="self_attn")(
            norm("input_layernorm")(x), cos[i], sin[i], layer_cache, paged, tree
        )
        if s.sandwich_norm:  # Gemma: post_attention_layernorm normalises the attention output
            x = x + norm("post_attention_layernorm")(h)
            x = x + norm("post_feedforward_layernorm")(MLP(s, name="mlp")(norm("pre_feedforward_layernorm")(x)))
        else:
            x = x + h
            x = x + MLP(s, name="mlp")(norm("post_attention_layernorm")(x))
        return x, layer_cache, kv


class Transformer(nn.Module):
    """tokens [B, T], cos/sin [R, B, T, rotary_dim // 2] -> (logits, new cache, per-layer pre-RoPE KV).

    logit_index [B, M] (optional) picks the positions whose logits are computed (a prefill only
    needs its last one); with `want_logits=False` no logits are computed at all (the encoder).
    `tree` (dense mode only) replaces the causal mask with packed prefix-tree rows.
    """

    spec: ModelSpec
    kernels: str = "reference"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, cos, sin, cache=None, paged=None, logit_index=None, want_logits=True, tree=None):
        s = self.spec
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        embed = nn.Embed(s.vocab_size, s.hidden_size, dtype=self.dtype, param_dtype=self.dtype, name="embed_tokens")
        x = embed(tokens)
        if s.embed_scale:  # Gemma: sqrt(hidden_size), rounded to the activation dtype first
            x = x * jnp.asarray(s.hidden_size ** 0.5, dtype=x.dtype)
        new_cache, kvs = [], []
        for i in range(s.num_layers):
            x, lc, kv = DecoderLayer(s, self.kernels, i, name=f"layers_{i}")(
                x, cos, sin, None if cache is None else cache[i], paged, tree
            )
            new_cache.append(lc)
            kvs.append(kv)
        if not want_logits:
            return None, (new_cache if cache is not None else None), kvs
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[..., None], axis=1)
        x = RMSNorm(s.rms_norm_eps, s.norm_offset, name="norm")(x)
        if s.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(s.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        if s.final_logit_softcap is not None:
            c = jnp.float32(s.final_logit_softcap)
            logits = c * jnp.tanh(logits / c)
        return logits, (new_cache if cache is not None else None), kvs
