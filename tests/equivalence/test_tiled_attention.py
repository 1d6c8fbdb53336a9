"""Tiled masked attention (`inferscale.encoders.tiled_attention`) against dense masked SDPA, its
reference: the masks the encoders build (prefix trees, conversation rows with turn windows,
sliding windows), grouped-query heads, tiles that do not divide the row, dtype-based tolerances;
and the torch encoder's KV through it equals its KV through dense SDPA."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from inferscale.common.prompt.packing import PackedRow, windowed  # noqa: E402
from inferscale.encoders.tiled_attention import (  # noqa: E402
    TILE, attention_forward, dense_sdpa, tiled_sdpa)

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def tree_mask(rng, T: int) -> np.ndarray:
    """A random prefix tree of T tokens (each token's parent an earlier token or none): [T, T]."""
    parent = np.array([-1] + [int(rng.integers(-1, q)) if rng.random() < 0.1 else q - 1 for q in range(1, T)])
    depth = np.zeros(T, dtype=np.int32)
    for q in range(1, T):
        depth[q] = depth[parent[q]] + 1 if parent[q] >= 0 else 0
    return PackedRow(np.zeros(T, np.int32), depth, parent.astype(np.int32)).visible()


def conversation_mask(T: int, header: int = 20, turn: int = 17, w: int = 5) -> np.ndarray:
    """Header + turns, each turn seeing the header and at most w turns before it: [T, T]."""
    pos = np.arange(T)
    turn_of = np.where(pos < header, -1, (pos - header) // turn)
    return (pos[None] <= pos[:, None]) & ((turn_of[None] == -1) | (turn_of[:, None] - turn_of[None] <= w))


def qkv(B, H, KVH, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, T, D, generator=g).to(dtype) for h in (H, KVH, KVH))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tree", "conversation", "sliding"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_tiled_equals_dense(dtype, kind, heads):
    rng = np.random.default_rng(1)
    T, B = 700, 2
    if kind == "tree":
        masks = [tree_mask(rng, T) for _ in range(B)]
    elif kind == "conversation":
        masks = [conversation_mask(T), conversation_mask(T, header=5, turn=40, w=2)]
    else:  # a tree row's sliding layers: ancestors within 64 positions
        masks = [windowed(tree_mask(rng, T), np.arange(T), T, 64) for _ in range(B)]
    mask = torch.from_numpy(np.stack(masks))[:, None]
    q, k, v = qkv(B, *heads, T, 32, dtype)
    ref = dense_sdpa(q.float(), k.float(), v.float(), mask, scale=0.2)
    for tile in (TILE, 100, 1000):  # the default, one that does not divide T, one longer than the row
        got = tiled_sdpa(q, k, v, mask, scale=0.2, tile=tile)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), ref, atol=TOL[dtype] * 10, rtol=TOL[dtype])


def test_a_broadcast_mask_and_visibility_are_respected():
    T = 600
    mask = torch.from_numpy(conversation_mask(T))[None, None]  # one mask for the whole batch
    q, k, v = qkv(3, 4, 2, T, 16, torch.float32, seed=2)
    got = tiled_sdpa(q, k, v, mask)
    torch.testing.assert_close(got, dense_sdpa(q, k, v, mask), atol=2e-6, rtol=2e-6)
    # a key no query sees changes nothing; a key some query sees does
    k2 = k.clone()
    k2[:, :, 100] += 5.0  # key 100 (a turn far back) is invisible to the last tile
    out2 = tiled_sdpa(q, k2, v, mask)
    seen_by = mask[0, 0, :, 100].numpy()
    assert not seen_by[-TILE:].any() and seen_by.any()
    torch.testing.assert_close(out2[:, :, -TILE:], got[:, :, -TILE:], atol=0, rtol=0)
    assert not torch.allclose(out2[:, :, seen_by], got[:, :, seen_by])


def test_bad_input_is_refused():
    q, k, v = qkv(1, 4, 2, 300, 16, torch.float32)
    with pytest.raises(ValueError, match="mask must be bool"):
        tiled_sdpa(q, k, v, torch.ones(1, 1, 300, 300))
    with pytest.raises(ValueError, match="mask must be bool"):
        tiled_sdpa(q, k, v, torch.ones(1, 1, 300, 299, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tiled_sdpa(q[:, :3], k, v, torch.ones(1, 1, 300, 300, dtype=torch.bool))
    with pytest.raises(ValueError, match="tile must be"):
        tiled_sdpa(q, k, v, torch.ones(1, 1, 300, 300, dtype=torch.bool), tile=0)


def test_unmasked_calls_are_transformers_sdpa():
    """No mask (causal rows), a float mask, or a row within one tile: transformers' own SDPA, exactly."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    q, k, v = qkv(1, 4, 2, 300, 16, torch.float32, seed=3)
    for mask in (None, torch.zeros(1, 1, 300, 300)):
        got, _ = attention_forward(Attn(), q, k, v, mask, scaling=0.25)
        ref, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.25)
        assert torch.equal(got, ref)
    mask = torch.from_numpy(conversation_mask(300))[None, None]
    got, _ = attention_forward(Attn(), q, k, v, mask, scaling=0.25)  # tiled: [B, T, H, D] back
    torch.testing.assert_close(got, dense_sdpa(q, k, v, mask, scale=0.25).transpose(1, 2), atol=2e-6, rtol=2e-6)


def test_encoder_kv_through_tiled_equals_dense(tiny_model_dir):
    from inferscale.common.prompt.conversation_pass import conversation_plan
    from inferscale.evaluation.datasets import load_demo
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    conv, w = load_demo().conversation, 4
    facts = conv.facts[:12]
    spans = [conv.context_span(f, w) for f in facts]
    tiled = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2)
    dense = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2, attention="sdpa")
    assert tiled.attention == "tiled" and dense.attention == "sdpa"  # tiled is the CPU default
    plan = conversation_plan(tiled.builder.header_ids, tiled.builder.span_items(facts, spans, w), w, 512)
    assert max(len(r) for r in plan.rows) > TILE  # the rows do take the tiled path
    for a, b in zip(tiled.encode_conversation(facts, spans, w), dense.encode_conversation(facts, spans, w)):
        scale = max(np.abs(b.k).max(), np.abs(b.v).max())
        np.testing.assert_allclose(a.k, b.k, atol=2e-6 * scale, rtol=1e-5)
        np.testing.assert_allclose(a.v, b.v, atol=2e-6 * scale, rtol=1e-5)
    with pytest.raises(ValueError, match="attention must be one of"):
        TorchFactEncoder(tiny_model_dir, attention="flash")


def test_one_tile_plan_per_mask_shared_by_every_layer(tiny_model_dir, monkeypatch):
    """The visible-key plan depends on the mask alone: built once per mask tensor (every layer of a
    kind gets the same one in a forward pass), not once per layer; forgotten with the mask."""
    import gc

    import inferscale.encoders.tiled_attention as ta
    from inferscale.evaluation.datasets import load_demo
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    built, masks, real_plan, real_sdpa = [], [], ta.tile_plan, ta.tiled_sdpa

    def plan(mask, tile=TILE):
        built.append(mask)
        return real_plan(mask, tile)

    def sdpa(query, key, value, mask, *a, **kw):
        masks.append(mask)  # kept alive here, so ids stay distinct
        return real_sdpa(query, key, value, mask, *a, **kw)

    monkeypatch.setattr(ta, "tile_plan", plan)
    monkeypatch.setattr(ta, "tiled_sdpa", sdpa)
    conv, w = load_demo().conversation, 4
    facts = conv.facts[:12]
    enc = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2)
    enc.encode_conversation(facts, [conv.context_span(f, w) for f in facts], w)
    distinct = {id(m) for m in masks}
    assert masks and len(built) == len(distinct)  # one plan per mask tensor
    assert len(masks) == enc.spec.num_layers * len(distinct) // len(set(enc.spec.layer_types or ["full"]))
    built.clear(), masks.clear()
    gc.collect()
    assert not ta._PLANS  # no plan outlives its mask
