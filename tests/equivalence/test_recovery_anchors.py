"""Recovery policies in the JAX engine: the anchors (`all` == joint prefill, `none` == plain
injection, exactly encoded facts == joint prefill under every policy) and that a partial policy
really recomputes (it moves the logits off plain injection)."""

import numpy as np
import pytest

pytest.importorskip("jax")

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.common.prompt.recovery import RecoveryPolicy  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402

QUESTION = "Where does Tom live now?"
P = RecoveryPolicy.parse


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(max_context=512))


@pytest.fixture(scope="module")
def setup(engine):
    demo = load_demo().conversation
    facts = engine.encode_facts(demo.facts[2:7], demo, w=0)  # independent encoding: approximate
    cont = engine.builder.tokenize("He lives in Leeds.")
    return facts, cont, engine.score(QUESTION, facts, cont, mode="joint")


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_recompute_all_is_joint_prefill_and_none_is_plain_injection(engine, setup):
    facts, cont, joint = setup
    assert _rel(engine.score(QUESTION, facts, cont, policy=P("all")), joint) <= 1e-4
    assert _rel(engine.score(QUESTION, facts, cont, policy=P(f"last:{len(facts)}")), joint) <= 1e-4
    plain = engine.score(QUESTION, facts, cont, mode="inject")
    assert np.array_equal(engine.score(QUESTION, facts, cont, policy=P("none")), plain)
    a = engine.answer(QUESTION, facts, policy=P("all"), max_new_tokens=6)
    b = engine.answer(QUESTION, facts, mode="joint", max_new_tokens=6)
    assert a.token_ids == b.token_ids and a.num_injected == len(engine.builder.header_ids)


@pytest.mark.parametrize("policy", ["last:2", "heads:3", "heads:1", "blend:30"])
def test_every_policy_is_exact_when_the_facts_are(engine, setup, policy):
    facts, cont, joint = setup
    exact = engine.encode_exact(engine.layout(QUESTION, facts))  # each fact after its served prefix
    assert _rel(engine.score(QUESTION, exact, cont, policy=P(policy)), joint) <= 1e-4


@pytest.mark.parametrize("policy", ["last:2", "heads:3", "blend:30"])
def test_a_partial_policy_recomputes_what_it_says(engine, setup, policy):
    facts, cont, joint = setup
    plain = engine.score(QUESTION, facts, cont, mode="inject")
    got = engine.score(QUESTION, facts, cont, policy=P(policy))
    assert _rel(got, plain) > 1e-4 and _rel(got, joint) > 1e-6  # neither plain injection nor joint
    ans = engine.answer(QUESTION, facts, policy=P(policy), max_new_tokens=2)
    layout = engine.layout(QUESTION, facts)
    assert ans.num_injected == int(P(policy).mask(layout, np.zeros(len(layout))).sum()) < layout.num_injected
    assert ans.num_prefilled == len(layout) - ans.num_injected


def test_a_policy_needs_injection(engine, setup):
    facts, cont, _ = setup
    with pytest.raises(ValueError, match="mode 'inject' only"):
        engine.score(QUESTION, facts, cont, mode="joint", policy=P("last:1"))


def test_list_context_encoding_is_exact_for_its_own_prefix(engine):
    """A fact encoded after the n facts before it equals its exact-composition KV when it is
    served right after exactly those facts."""
    demo = load_demo().conversation
    memory = demo.facts[:4]
    (kv,) = engine.encode_after_facts(memory, 3, which=[3])
    served = engine.encode_after_facts(memory, 0, which=[0, 1, 2]) + [kv]
    exact = engine.encode_exact(engine.layout(QUESTION, served))[3]
    np.testing.assert_allclose(kv.k, exact.k, rtol=1e-4, atol=1e-4 * np.abs(exact.k).max())
    np.testing.assert_allclose(kv.v, exact.v, rtol=1e-4, atol=1e-4 * np.abs(exact.v).max())
    (alone,) = engine.encode_after_facts(memory, 0, which=[3])  # without the list it differs
    assert not np.allclose(alone.k, kv.k, atol=1e-5)


def test_blend_selects_by_the_deviation_from_joint_prefill(engine, setup):
    facts, cont, joint = setup
    layout = engine.layout(QUESTION, facts)
    dev = engine.kv_deviation(layout, facts)
    assert (dev[: len(engine.builder.header_ids)] == 0).all() and dev.max() > 0
    exact = engine.encode_exact(layout)
    assert engine.kv_deviation(layout, exact).max() <= 1e-6 * dev.max()  # exactly encoded: nothing deviates
    assert _rel(engine.score(QUESTION, facts, cont, policy=P("blend:100")), joint) <= 1e-4


def test_key_scaling_of_100_is_plain_injection_and_any_other_moves_it(engine, setup):
    facts, cont, _ = setup
    plain = engine.score(QUESTION, facts, cont, mode="inject")
    assert np.array_equal(engine.score(QUESTION, facts, cont, policy=P("keys:100")), plain)
    assert _rel(engine.score(QUESTION, facts, cont, policy=P("keys:80")), plain) > 1e-4


def test_ape_at_100_100_is_plain_injection_and_its_scaling_factor_matters(engine, setup):
    """APE (`ape:T:S`): temperature 1 and scaling 1 are plain injection; the scaling factor moves
    the answer's logits beyond the temperature alone (`keys:S` is the temperature without it)."""
    facts, cont, _ = setup
    plain = engine.score(QUESTION, facts, cont, mode="inject")
    assert _rel(engine.score(QUESTION, facts, cont, policy=P("ape:100:100")), plain) <= 1e-5
    temperature_only = engine.score(QUESTION, facts, cont, policy=P("keys:110"))  # keys / 0.909...
    ape = engine.score(QUESTION, facts, cont, policy=P("ape:91:60"))
    assert _rel(ape, plain) > 1e-4 and _rel(ape, temperature_only) > 1e-4
    ans = engine.answer(QUESTION, facts, policy=P("ape:91:60"), max_new_tokens=3)
    assert ans.num_injected == engine.layout(QUESTION, facts).num_injected  # nothing recomputed
