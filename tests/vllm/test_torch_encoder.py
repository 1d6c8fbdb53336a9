"""The torch (transformers) fact encoder writes the same store as the JAX encoder."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from inferscale.common.datasets import load_demo  # noqa: E402
from inferscale.common.store import Store  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402
from inferscale.vllm.encoder import TorchFactEncoder  # noqa: E402


def test_torch_and_jax_encoders_agree(tiny_model_dir, tmp_path):
    conv = load_demo().conversation
    facts = conv.facts[4:9]
    windows = [conv.context_window(f, 3) for f in facts]
    torch_enc = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=3)
    jax_enc = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512))
    assert torch_enc.store_meta(3) == jax_enc.store_meta(3)  # either can open the other's store
    a = torch_enc.encode_windowed(facts, windows, 3)
    b = jax_enc.encode_windowed(facts, windows, 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
        scale = max(np.abs(y.k).max(), np.abs(y.v).max())
        np.testing.assert_allclose(x.k, y.k, atol=1e-5 * scale, rtol=1e-5)
        np.testing.assert_allclose(x.v, y.v, atol=1e-5 * scale, rtol=1e-5)
    Store.create(tmp_path / "s", torch_enc.store_meta(3)).put(a)
    loaded = Store.open(tmp_path / "s", expect=jax_enc.store_meta(3)).get([f.fact_id for f in a])
    ans_t = jax_enc.answer("Where does Tom live?", loaded, max_new_tokens=5)
    ans_j = jax_enc.answer("Where does Tom live?", b, max_new_tokens=5)
    assert ans_t.token_ids == ans_j.token_ids


def test_torch_and_jax_list_context_encodings_agree(tiny_model_dir):
    facts = load_demo().conversation.facts[:5]
    torch_enc = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2)
    jax_enc = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512))
    assert torch_enc.store_meta(2, "facts") == jax_enc.store_meta(2, "facts") != jax_enc.store_meta(2)
    previous = [facts[:i] for i in range(len(facts))]
    a = torch_enc.encode_listed(facts, previous, 2)
    b = jax_enc.encode_listed(facts, previous, 2)
    for x, y in zip(a, b):
        assert x.meta == y.meta and x.meta["context"] == "facts"
        scale = max(np.abs(y.k).max(), np.abs(y.v).max())
        np.testing.assert_allclose(x.k, y.k, atol=1e-5 * scale, rtol=1e-5)
        np.testing.assert_allclose(x.v, y.v, atol=1e-5 * scale, rtol=1e-5)
