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


def test_the_memory_chain_is_joint_prefill_and_the_same_links_in_both_encoders(engine, tiny_model_dir, demo):
    """The memory chain (`common.prompt.chain_links`): links encoded in one pass after the header, extended from
    any link, injected in the JAX engine, are joint prefill of the whole memory; the torch encoder
    (what the server stores) computes the same links."""
    from inferscale.common.prompt.chain_links import extension_item, split_links
    from inferscale.common.storage.format import FactKV
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    facts = engine.encode_facts(demo.facts[:8], demo, w=0)  # their token ids, as the memory renders them
    tokens = [f.token_ids.tolist() for f in facts]
    header = engine.builder.header_ids
    links = []
    for start, stop in ((0, 5), (5, 8)):  # the first five, then an append of three from the stored five
        ((k, v),) = engine.encode_ids([extension_item(header, tokens[:stop], start)])
        links += split_links(np.asarray(k), np.asarray(v), [len(t) for t in tokens[start:stop]])
    chain = [FactKV(f.fact_id, f.token_ids, k, v) for f, (k, v) in zip(facts, links)]
    a = engine.answer(QUESTION, facts, mode="joint", max_new_tokens=8)
    b = engine.answer(QUESTION, chain, mode="inject", max_new_tokens=8)
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    torch_enc = TorchFactEncoder(tiny_model_dir, max_context=512)
    ((k, v),) = torch_enc.encode_ids([extension_item(header, tokens, 0)])
    for (tk, tv), (jk, jv) in zip(split_links(k, v, [len(t) for t in tokens]), links):
        assert _rel(jk, tk) <= 1e-4 and _rel(jv, tv) <= 1e-4
