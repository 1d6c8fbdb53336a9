"""The conversation encoding (`inferscale.common.prompt.conversation_pass`) in both encoders: facts that
share a row get the KV of a row of their own (the reference), the facts whose span is their window
get exactly turn-window encoding's KV, and the JAX engine and the torch encoder agree."""

import numpy as np
import pytest

from inferscale.common.prompt.conversation_pass import conversation_plan
from inferscale.evaluation.datasets import load_demo

W = 4


def demo():
    conv = load_demo().conversation
    return conv, conv.facts, [conv.context_span(f, W) for f in conv.facts]


def assert_close(got, ref, tol=2e-6):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert np.array_equal(a.token_ids, b.token_ids)
        scale = max(np.abs(b.k).max(), np.abs(b.v).max())
        np.testing.assert_allclose(a.k, b.k, atol=tol * scale, rtol=1e-5)
        np.testing.assert_allclose(a.v, b.v, atol=tol * scale, rtol=1e-5)


def first_block(conv, facts):
    """The facts whose span is their window (source turn within the first w turns)."""
    return [i for i, f in enumerate(facts) if conv.turn_index(f.source_turn) <= W]


def test_torch_conversation_encoding(tiny_model_dir):
    pytest.importorskip("torch")
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    enc = TorchFactEncoder(tiny_model_dir, max_context=512, batch_size=2)
    conv, facts, spans = demo()
    plan = conversation_plan(enc.builder.header_ids, enc.builder.span_items(facts, spans, W), W, enc.max_context)
    assert len(plan.rows) < len(facts)  # facts do share rows, so the comparison below means something
    shared = enc.encode_conversation(facts, spans, W)
    assert_close(shared, enc.encode_conversation(facts, spans, W, share=False))
    first = first_block(conv, facts)
    assert len(first) >= 3
    turns = enc.encode_windowed([facts[i] for i in first], [conv.context_window(facts[i], W) for i in first], W)
    assert_close([shared[i] for i in first], turns)
    assert all(kv.meta["context"] == "conversation" and kv.meta["w"] == W for kv in shared)


def test_jax_conversation_encoding_matches_torch(tmp_path_factory):
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    from tiny_models import make_tiny_model

    from inferscale.encoders.torch_encoder import TorchFactEncoder
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import EngineConfig

    path = tmp_path_factory.mktemp("tiny-gemma3-conversation")
    make_tiny_model(path, "gemma3_text")  # sliding layers: windows measured in the row's positions
    engine = Engine.from_pretrained(path, EngineConfig(max_context=512, encode_batch_size=4))
    conv, facts, spans = demo()
    got = engine.encode_conversation(facts, spans, W)
    assert_close(got, engine.encode_conversation(facts, spans, W, share=False), tol=1e-5)
    torch_enc = TorchFactEncoder(path, max_context=512, batch_size=4)
    assert_close(got, torch_enc.encode_conversation(facts, spans, W), tol=1e-5)
