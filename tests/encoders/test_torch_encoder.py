"""The torch (transformers) fact encoder writes the same store as the JAX encoder."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402
from inferscale.encoders.torch_encoder import TorchFactEncoder  # noqa: E402


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


def test_multimodal_gemma3_checkpoint_encodes_as_its_text_decoder(tmp_path):
    """transformers loads a `gemma3` checkpoint as Gemma3ForConditionalGeneration; the encoder taps
    its language model and writes the text decoder's KV (and its store meta)."""
    import shutil

    import transformers as tf

    from tiny_models import make_tiny_model

    text = make_tiny_model(tmp_path / "text", "gemma3_text")
    cfg = tf.Gemma3Config(text_config=text.config.to_dict(), mm_tokens_per_image=4,
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14))
    mm = tf.Gemma3ForConditionalGeneration(cfg)
    decoder = {f"model.language_model.{k[len('model.'):]}": v for k, v in text.state_dict().items()
               if k.startswith("model.")}
    assert not [k for k in mm.load_state_dict(decoder, strict=False).missing_keys if "language_model" in k]
    mm.save_pretrained(tmp_path / "mm")
    for f in (tmp_path / "text").iterdir():
        if f.name.startswith(("tokenizer", "special", "chat_template")):
            shutil.copy(f, tmp_path / "mm")
    a, b = TorchFactEncoder(tmp_path / "text"), TorchFactEncoder(tmp_path / "mm")
    assert type(b.model).__name__ == "Gemma3ForConditionalGeneration" and a.spec == b.spec
    (ka, va), = a.encode_ids([([1, 5, 9, 30], [40, 41, 42])])
    (kb, vb), = b.encode_ids([([1, 5, 9, 30], [40, 41, 42])])
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(va, vb)
