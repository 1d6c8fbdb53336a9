"""Tiled masked attention for the torch encoder: SDPA over only the keys each query tile can see.

The one-pass rows (prefix trees, `inferscale.common.prompt.packing`) and the conversation encoding's rows
(`inferscale.common.prompt.conversation_pass`) run with a 4-D boolean mask in which most (query, key)
pairs are invisible: a conversation row's turn sees the header and at most `w` turns before it, a
tree row's branch sees its own ancestors. Dense masked SDPA pays for every pair of the row.
`tiled_sdpa` cuts the queries into tiles of `tile` rows, gathers the keys that any query of the
tile sees, and runs SDPA on that block with the matching slice of the mask: the same softmax over
the same visible keys, up to float summation order, at the cost of the pairs the tiles' unions
cover (a conversation row at w=20: about 2x fewer than dense). Which keys each tile sees depends
on the mask alone, so that plan (`tile_plan`) is built once per mask tensor and shared by every
layer of the forward pass.

`dense_sdpa` is the reference (transformers' own path: KV heads repeated, one SDPA with the whole
mask); `tests/equivalence/test_tiled_attention.py` compares them, and the one-pass and
conversation-encoding equivalence tests run the encoder (on CPU) through this path wherever a
masked row is longer than a tile.

    query:       [B, H, T, D]
    key, value:  [B, KVH, S, D]   H a multiple of KVH (grouped-query attention)
    mask:        [B or 1, 1, T, S] bool, True = attend
    out:         [B, H, T, D]
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

ATTENTION_IMPLS = ("tiled", "sdpa")  # the torch encoder's choices; "sdpa" (dense) is the reference
TILE = 256  # query rows per block: measured on CPU, 128 pays more per-call overhead, 512 wider key unions
NAME = "inferscale_tiled"  # the name it is registered under in transformers' attention interface


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(f"query [B, H, T, D] and key/value [B, KVH, S, D] expected, got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    B, H, T, _ = query.shape
    if key.shape[0] != B or H % key.shape[1]:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)} "
                         f"(same batch; query heads a multiple of KV heads)")
    if mask.dtype != torch.bool or mask.ndim != 4 or mask.shape[0] not in (1, B) or mask.shape[1] != 1 \
            or mask.shape[2:] != (T, key.shape[2]):
        raise ValueError(f"mask must be bool [B or 1, 1, T, S] = [{B}, 1, {T}, {key.shape[2]}], "
                         f"got {mask.dtype} {tuple(mask.shape)}")


def dense_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
    """The reference: every (query, key) pair through one SDPA call with the whole mask."""
    _check(query, key, value, mask)
    g = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                          attn_mask=mask, scale=scale)


def tile_plan(mask: torch.Tensor, tile: int = TILE) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per row of `mask` [B or 1, 1, T, S], per tile of `tile` queries: (cols [n], the keys some
    query of the tile sees; sub-mask [1, 1, t, n]). It depends on the mask alone, so every layer
    of one forward pass (they share the mask tensor) uses the same plan (`_plan_of`)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    plan = []
    for m_b in mask[:, 0]:  # [T, S]
        row = []
        for q0 in range(0, m_b.shape[0], tile):
            m = m_b[q0: q0 + tile]  # [t, S]
            cols = m.any(0).nonzero().squeeze(1)  # [n]
            row.append((cols, m[:, cols][None, None]))
        plan.append(row)
    return plan


_PLANS: dict[tuple[int, int], list] = {}  # (id(mask), tile) -> plan; dropped when the mask is freed


def _plan_of(mask: torch.Tensor, tile: int) -> list:
    """`tile_plan(mask, tile)`, built on the first layer that gets this mask tensor and kept until
    the tensor is freed (transformers builds a forward pass's masks once and never edits them)."""
    key = (id(mask), tile)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = tile_plan(mask, tile)
        weakref.finalize(mask, _PLANS.pop, key, None)
    return plan


def tiled_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
               scale: float | None = None, tile: int = TILE) -> torch.Tensor:
    """`dense_sdpa`'s result, each tile of `tile` queries attending over only the keys it sees."""
    _check(query, key, value, mask)
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    B, H, T, _ = query.shape
    g = H // key.shape[1]
    plan = _plan_of(mask, tile)
    out = torch.empty_like(query)
    for b in range(B):
        for q0, (cols, m) in zip(range(0, T, tile), plan[b if mask.shape[0] > 1 else 0]):
            k = key[b: b + 1, :, cols].repeat_interleave(g, 1)  # [1, H, n, D]
            v = value[b: b + 1, :, cols].repeat_interleave(g, 1)
            out[b: b + 1, :, q0: q0 + tile] = F.scaled_dot_product_attention(
                query[b: b + 1, :, q0: q0 + tile], k, v, attn_mask=m, scale=scale)
    return out


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      **kwargs):
    """transformers' attention-interface signature. Tiled for a boolean 4-D mask longer than one
    tile; anything else (no mask: causal rows with SDPA's causal kernel; float masks, dropout, logit
    soft-capping, a position bias) goes to transformers' own SDPA unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.ndim != 4
             or query.shape[2] <= TILE or dropout or kwargs.get("softcap") is not None
             or kwargs.get("position_bias") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = tiled_sdpa(query, key, value, attention_mask, scaling)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D], as transformers' own interfaces return


def use_tiled_attention(model) -> None:
    """Register the tiled attention with transformers (masks are built as for SDPA) and switch
    `model` to it. Registering is idempotent; only models passed here use it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
