"""The research engine: store round trips, orbax reloads, and clear errors for bad input."""

import json

import numpy as np
import pytest

jnp = pytest.importorskip("jax.numpy")

from tiny_models import make_tiny_model  # noqa: E402

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.common.facts import Fact  # noqa: E402
from inferscale.common.model.spec import UnsupportedModelError  # noqa: E402
from inferscale.common.storage.format import ModelMismatchError  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402
from inferscale.jax.weights import load_params, params_to_numpy  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model(path, "llama")
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_pretrained(model_dir, EngineConfig(max_context=512))


def test_store_round_trip_serves_the_same_answer(engine, tmp_path):
    conv = load_demo().conversation
    facts = engine.encode_facts(conv.facts[:4], conv, w=3)
    store = Store.create(tmp_path / "store", engine.store_meta(w=3))
    store.put(facts)
    loaded = Store.open(tmp_path / "store", expect=engine.store_meta(w=3)).get([f.fact_id for f in facts])
    a = engine.answer("What is Maya's cat called?", facts, max_new_tokens=6)
    b = engine.answer("What is Maya's cat called?", loaded, max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert set(a.timings) >= {"compose", "inject", "prefill"} and a.ttft_s > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3", "bfloat16"])
@pytest.mark.parametrize("policy", ["none", "last:1", "keys:80"])
def test_compact_memory_is_injected_from_its_stored_layout(engine, tmp_path, kv_dtype, policy):
    """Facts as their store keeps them (`get_compact`: codes and scales, or bfloat16) are dequantised
    inside the injection kernel; the answer equals injecting the store's reference dequantisation
    (`get`), with every recovery policy that injects them (keys:S scales the key scales)."""
    from inferscale.common.prompt.recovery import RecoveryPolicy

    conv = load_demo().conversation
    facts = engine.encode_facts(conv.facts[:4], conv, w=3)
    store = Store.create(tmp_path / "store", engine.store_meta(w=3).with_dtype(kv_dtype))
    store.put(facts)
    ids = [f.fact_id for f in facts]
    compact, reference = store.get_compact(ids), store.get(ids)
    assert all(c.dtype == kv_dtype and (c.k_scale is None) == (kv_dtype == "bfloat16") for c in compact)
    pol = RecoveryPolicy.parse(policy)
    a = engine.answer("What is Maya's cat called?", compact, max_new_tokens=6, policy=pol)
    b = engine.answer("What is Maya's cat called?", reference, max_new_tokens=6, policy=pol)
    assert a.token_ids == b.token_ids and a.num_injected == b.num_injected > 0
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_store_of_another_model_is_refused(engine, tmp_path):
    other = tmp_path / "other"
    make_tiny_model(other, "llama", seed=1)
    other_engine = Engine.from_pretrained(other, EngineConfig(max_context=64))
    assert other_engine.fingerprint != engine.fingerprint
    Store.create(tmp_path / "store", other_engine.store_meta(w=0))
    with pytest.raises(ModelMismatchError, match="another model"):
        Store.open(tmp_path / "store", expect=engine.store_meta(w=0))


def test_orbax_checkpoint_reload_is_exact(model_dir, engine, tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    first = load_params(model_dir, engine.spec, engine.fingerprint, checkpoint_dir=checkpoint_dir)
    assert any(checkpoint_dir.iterdir())
    again = load_params(model_dir, engine.spec, engine.fingerprint, checkpoint_dir=checkpoint_dir)
    a, b = params_to_numpy(first), params_to_numpy(again)
    np.testing.assert_array_equal(a["layers_1"]["mlp"]["up_proj"]["kernel"], b["layers_1"]["mlp"]["up_proj"]["kernel"])
    np.testing.assert_array_equal(a["embed_tokens"]["embedding"], b["embed_tokens"]["embedding"])


def test_unsupported_model_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="supported: llama, mistral, qwen2, qwen3, phi3"):
        Engine.from_pretrained(tmp_path)


def test_bad_input_gets_clear_errors(engine):
    with pytest.raises(ValueError, match="empty text"):
        Fact("f1", "  ")
    with pytest.raises(ValueError, match="invalid fact id"):
        Fact("../etc/passwd", "x")
    with pytest.raises(ValueError, match="does not fit the model's context"):
        engine.encode_facts([Fact("long", "word " * 400)])
    facts = engine.encode_facts([Fact("f1", "Tom lives in Leeds.")])
    with pytest.raises(ValueError, match="mode"):
        engine.answer("Where?", facts, mode="telepathy")
    with pytest.raises(ValueError, match="question"):
        engine.answer("  ", facts)
    with pytest.raises(ValueError, match="exceed the context"):
        engine.answer("Where?", facts, max_new_tokens=10_000)
    layout = engine.layout("Where?", facts)
    stale = engine.encode_facts([Fact("f1", "Tom lives in York.")])  # same id, other tokens
    blocks = engine.allocator.allocate(8)
    try:
        with pytest.raises(ValueError, match="differ from its prompt span"):
            engine._inject_memory(layout, stale, blocks, layout.inject_mask())
    finally:
        engine.allocator.free(blocks)


@pytest.mark.parametrize("kw,field", [(dict(block_size=3), "block_size"), (dict(kernels="cuda"), "kernels"),
                                       (dict(dtype="int8"), "dtype"), (dict(max_context=4), "max_context")])
def test_engine_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)
