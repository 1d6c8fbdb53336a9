"""One-pass encoding (prefix-tree rows, ancestor masks) equals fact-by-fact encoding, in both
encoders and on every family (the memory service's bulk add encodes through these encoders)."""

import numpy as np
import pytest

pytest.importorskip("jax")

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.common.prompt.packing import pack_items, row_budget  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402


def items_of(builder, w):
    """The service's plans for the demo facts at window `w`, plus a prefix chain (exact layout)."""
    conv = load_demo().conversation
    facts = conv.facts
    plans = builder.windowed_plans(facts, [conv.context_window(f, w) for f in facts])
    ctx, fact = plans[0]
    plans.append((ctx + fact, plans[1][1]))  # a fact whose context holds another item whole
    plans.append(plans[2])  # the same item twice
    plans.append((plans[3][0], plans[4][1]))  # another fact after the same context: a branch
    return plans


def assert_same(one, ref):
    assert len(one) == len(ref)
    for (k1, v1), (k0, v0) in zip(one, ref):
        assert k1.shape == k0.shape and v1.shape == v0.shape
        scale = max(np.abs(k0).max(), np.abs(v0).max())
        np.testing.assert_allclose(k1, k0, atol=2e-6 * scale, rtol=1e-5)
        np.testing.assert_allclose(v1, v0, atol=2e-6 * scale, rtol=1e-5)


def test_jax_one_pass_equals_per_fact(tiny_model_dir):
    w = 4
    per_fact = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512, encode_mode="per-fact"))
    one_pass = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512, encode_batch_size=2))
    items = items_of(per_fact.builder, w)
    plan = pack_items(items, row_budget(items))  # the torch encoder's plan (JAX: a power of two above)
    assert plan.row_tokens < plan.item_tokens  # the header (at least) is shared
    assert any(not r.is_chain for r in plan.rows) and any(r.is_chain for r in plan.rows)  # both paths run
    if per_fact.spec.sliding_window:  # Gemma 3's tiny window: items longer than it do occur
        assert max(len(c) + len(f) for c, f in items) > per_fact.spec.sliding_window
    assert_same(one_pass.encode_ids(items), per_fact.encode_ids(items))


def test_torch_one_pass_equals_per_fact(tiny_model_dir):
    pytest.importorskip("torch")
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    per_fact = TorchFactEncoder(tiny_model_dir, max_context=512, encode_mode="per-fact")
    one_pass = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2)
    items = items_of(per_fact.builder, 4)
    assert_same(one_pass.encode_ids(items), per_fact.encode_ids(items))


def test_encode_mode_is_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="encode_mode must be one of one-pass, per-fact"):
        EngineConfig(encode_mode="batched")
    pytest.importorskip("torch")
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    with pytest.raises(ValueError, match="encode_mode"):
        TorchFactEncoder(tiny_model_dir, encode_mode="fast")
    enc = TorchFactEncoder(tiny_model_dir, max_context=64)
    with pytest.raises(ValueError, match="encode item 0: context 60 \\+ fact 10 tokens exceed"):
        enc.encode_ids([(list(range(3, 63)), list(range(3, 13)))])
