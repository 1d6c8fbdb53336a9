"""Exact composition (injection == joint prefill when facts are encoded after their exact serving
prefix), Context-Window Encoding's context, and the measured approximation of independent encoding."""

import numpy as np
import pytest

pytest.importorskip("jax")

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402

QUESTION = "Where does Tom live now?"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512))


@pytest.fixture(scope="module")
def demo():
    return load_demo().conversation


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("k", [1, 3, 8])
def test_exact_composition_reproduces_joint_prefill(engine, demo, k):
    facts = engine.encode_facts(demo.facts[3 : 3 + k], demo, w=4)  # CWE with w > 0 gives the spans
    layout = engine.layout(QUESTION, facts)
    exact = engine.encode_exact(layout)  # same token ids, each after its exact serving prefix
    cont = engine.builder.tokenize("He lives in Leeds.")
    joint = engine.score(QUESTION, facts, cont, mode="joint")
    inject = engine.score(QUESTION, exact, cont, mode="inject")
    assert _rel(inject, joint) <= 1e-4
    a = engine.answer(QUESTION, facts, mode="joint", max_new_tokens=8)
    b = engine.answer(QUESTION, exact, mode="inject", max_new_tokens=8)
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert b.num_injected == layout.num_injected and b.num_prefilled == len(layout) - layout.num_injected


def test_independent_encoding_is_measurably_different(engine, demo):
    """Control: the comparison above can fail. Independently encoded facts change the logits."""
    facts = engine.encode_facts(demo.facts[:6], demo, w=0)
    joint = engine.score(QUESTION, facts, [], mode="joint")
    inject = engine.score(QUESTION, facts, [], mode="inject")
    assert _rel(inject, joint) > 1e-3


def test_context_window_encoding_is_exact_for_its_own_prefix(engine, demo):
    """A CWE fact's KV equals its exact-composition KV when served right after its window text."""
    fact = demo.facts[12]
    (cwe,) = engine.encode_facts([fact], demo, w=5)
    window = engine.builder.window_ids(demo.context_window(fact, 5))[len(engine.builder.header_ids):]
    assert len(window) > 0
    from inferscale.common.storage.format import FactKV

    pseudo = FactKV("window", np.asarray(window), np.zeros((1, len(window), 1, 1)), np.zeros((1, len(window), 1, 1)))
    layout = engine.layout(QUESTION, [pseudo, cwe])
    exact = engine.encode_exact(layout)[1]
    np.testing.assert_allclose(cwe.k, exact.k, rtol=1e-4, atol=1e-4 * np.abs(exact.k).max())
    np.testing.assert_allclose(cwe.v, exact.v, rtol=1e-4, atol=1e-4 * np.abs(exact.v).max())


def test_pallas_engine_matches_reference_engine(tiny_model_dir, engine, demo):
    pallas = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512, kernels="pallas"))
    facts = engine.encode_facts(demo.facts[:3], demo, w=2)
    cont = engine.builder.tokenize("Leeds")
    for mode in ("joint", "inject"):
        ref = engine.score(QUESTION, facts, cont, mode=mode)
        got = pallas.score(QUESTION, facts, cont, mode=mode)
        assert _rel(got, ref) <= 1e-4
