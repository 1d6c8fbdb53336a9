"""Exact composition through the vLLM connector for every family: facts encoded (by the torch
encoder) after exactly their serving prefix, injected by the connector, equal vLLM's own joint
prefill of the same prompt (greedy tokens, logprobs <= 1e-4); and vLLM serving the independently
encoded store equals the JAX reference engine injecting the same store (cross-validation of the
two paths, per family: Gemma 3's sliding windows, per-layer RoPE and soft-capping included), and
positions recomputed inside the memory by the connector (`heads:N`) against the JAX engine. One
engine per family, each a case of the session's engine processes (tests/vllm/conftest.py: vLLM
keeps one worker-side connector per engine, built for one model). One more engine runs
Llama in bfloat16: the connector writes into vLLM's bfloat16 cache (the "amx" layout on CPUs with
AMX) in the layout it learned from the backend, and exact composition still gives joint prefill's
tokens, logprobs within bfloat16's rounding."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_scripts import selected_params  # noqa: E402
from tiny_models import FAMILIES  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder
from tiny_models import make_tiny_model
from inferscale.evaluation.datasets import load_demo
from inferscale.common.storage.format import FactKV
from inferscale.common.storage.local_store import Store
from inferscale.common.storage.paths import user_store_dir
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

model, root = {model!r}, {root!r}
make_tiny_model(model, {family!r}, head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=3, max_model_len=2048, enable_prefix_caching=False,
                                kv_dtype="float32"),  # the exact KV written below must come back as written
                embedder=HashEmbedder())
try:
    conv = load_demo().conversation
    llm.memory.add("u", turns=conv.turns, facts=conv.facts[:8])
    q = "Where does Tom live now?"
    facts = [f.fact_id for f in llm.memory.search("u", q, k=5)]
    approx = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)  # independently encoded
    layout, _ = llm.composer.compose("u", q, facts)
    kvs = llm.encoder.encode_ids([(layout.prefix_ids(s), s.token_ids) for s in layout.facts])
    # the same facts for a fresh user, whose KV is replaced by the exact encoding (KV keys are immutable:
    # the connector's cache may hold u's)
    llm.memory.add("v", turns=conv.turns, facts=conv.facts[:8])
    store_v = Store.open(user_store_dir(root, "v"))
    _, plan_v = llm.composer.compose("v", q, facts)
    store_v.put([FactKV(seg.key, s.token_ids, k, v) for seg, s, (k, v) in zip(plan_v.segments[1:], layout.facts, kvs)])
    exact = llm.generate("v", q, mode="inject", fact_ids=facts, max_tokens=6)
    text = llm.generate("v", q, mode="text", fact_ids=facts, max_tokens=6)
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import EngineConfig
    jax = Engine.from_pretrained(model, EngineConfig(max_context=2048))
    ref = jax.answer(q, llm.memory.load_kv("u", facts), mode="inject", max_new_tokens=6)
    from inferscale.common.prompt.recovery import RecoveryPolicy
    heads = {{}}  # recomputed inside the memory by vLLM's model, against the JAX engine on the same store
    # heads inside the memory and the last fact whole, in one plan; the 2 most relevant moved next to the question
    for pol in ("heads:3+last:1", "top:2"):
        a = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6, policy=pol)
        b = jax.answer(q, llm.memory.load_kv("u", facts), policy=RecoveryPolicy.parse(pol), max_new_tokens=6)
        heads[pol] = [a.token_ids, a.logprobs, a.num_injected, b.token_ids, b.logprobs, b.num_injected]
    exact_heads = llm.generate("v", q, mode="inject", fact_ids=facts, max_tokens=6, policy="heads:3")
    everything = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6, policy="all")
    RESULT = {{"exact": [exact.token_ids, exact.logprobs, exact.num_injected],
                                  "heads": heads, "exact_heads": [exact_heads.token_ids, exact_heads.logprobs],
                                  "all": [everything.token_ids, everything.logprobs],
                                  "text": [text.token_ids, text.logprobs],
                                  "approx": [approx.token_ids, approx.logprobs, approx.num_injected],
                                  "jax": [ref.token_ids, ref.logprobs, ref.num_injected, len(layout)]}}
finally:
    llm.close()
"""


BF16_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder
from tiny_models import make_tiny_model
from vllm.distributed.kv_transfer import get_kv_transfer_group
from inferscale.evaluation.datasets import load_demo
from inferscale.common.storage.format import FactKV
from inferscale.common.storage.local_store import Store
from inferscale.common.storage.paths import user_store_dir
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

model, root = {model!r}, {root!r}
make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=3, max_model_len=2048, enable_prefix_caching=False,
                                kv_dtype="float32", dtype="bfloat16"), embedder=HashEmbedder())
try:
    conv = load_demo().conversation
    llm.memory.add("u", turns=conv.turns, facts=conv.facts[:8])
    q = "Where does Tom live now?"
    facts = [f.fact_id for f in llm.memory.search("u", q, k=5)]
    approx = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)
    layout, plan = llm.composer.compose("u", q, facts)
    kvs = llm.encoder.encode_ids([(layout.prefix_ids(s), s.token_ids) for s in layout.facts])
    llm.memory.add("v", turns=conv.turns, facts=conv.facts[:8])
    _, plan_v = llm.composer.compose("v", q, facts)
    Store.open(user_store_dir(root, "v")).put(
        [FactKV(seg.key, s.token_ids, k, v) for seg, s, (k, v) in zip(plan_v.segments[1:], layout.facts, kvs)])
    exact = llm.generate("v", q, mode="inject", fact_ids=facts, max_tokens=6)
    text = llm.generate("v", q, mode="text", fact_ids=facts, max_tokens=6)
    w = get_kv_transfer_group()
    RESULT = {{"exact": [exact.token_ids, exact.logprobs, exact.num_injected],
                                  "text": [text.token_ids, text.logprobs],
                                  "approx": [approx.token_ids, approx.logprobs, approx.num_injected],
                                  "paged_write_tokens": w.stats["paged_write_tokens"],
                                  "layouts": [[str(k[0]), str(k[1]), v is not None] for k, v in w.worker.layouts.learned.items()]}}
finally:
    llm.close()
"""
BF16_TEST = "test_exact_composition_in_a_bfloat16_engine_through_the_learned_cache_layout"


def engine_cases(items, root):
    """The selected tests' cases (tests/vllm/conftest.py): "family:F" per family, and
    "family:llama-bfloat16"."""
    codes = {f"family:{f}": SCRIPT.format(tests=str(TESTS), model=str(root / f), root=str(root / f"mem-{f}"), family=f)
             for f in selected_params(items, "family")}
    if any(it.name == BF16_TEST for it in items):
        codes["family:llama-bfloat16"] = BF16_SCRIPT.format(tests=str(TESTS), model=str(root / "llama-bf16"),
                                                            root=str(root / "mem-llama-bf16"))
    return codes


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_composition_through_the_connector_equals_joint_prefill(family, engine_runs):
    r = engine_runs[f"family:{family}"].result()
    (tokens, logprobs, injected), (text_tokens, text_logprobs) = r["exact"], r["text"]
    assert injected > 0 and tokens == text_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, text_logprobs)) <= 1e-4
    approx_tokens, approx_logprobs, approx_injected = r["approx"]
    assert max(abs(a - b) for a, b in zip(approx_logprobs, text_logprobs)) > 1e-4  # the control: approximate
    jax_tokens, jax_logprobs, jax_injected, prompt_len = r["jax"]
    assert jax_tokens == approx_tokens and jax_injected == approx_injected
    assert max(abs(a - b) for a, b in zip(jax_logprobs, approx_logprobs)) <= 1e-4
    if family == "gemma3_text":  # the prompt outgrows the tiny model's sliding window (24)
        assert prompt_len > 2 * 24


@pytest.mark.parametrize("family", FAMILIES)
def test_heads_through_vllm_equals_the_jax_engine_and_its_anchors(family, engine_runs):
    """Positions inside the memory recomputed by the connector with vLLM's own model:
    `heads:3+last:1` (and `top:2`, the facts laid out in its order) equals the JAX engine's on the
    same store and positions; with exactly encoded
    facts `heads:3` equals joint prefill; `all` equals joint prefill."""
    r = engine_runs[f"family:{family}"].result()
    text_tokens, text_logprobs = r["text"]
    approx_logprobs = r["approx"][1]
    for pol, (tokens, logprobs, injected, jax_tokens, jax_logprobs, jax_injected) in r["heads"].items():
        assert tokens == jax_tokens and injected == jax_injected, pol
        assert max(abs(a - b) for a, b in zip(logprobs, jax_logprobs)) <= 1e-4, pol
        assert max(abs(a - b) for a, b in zip(logprobs, approx_logprobs)) > 1e-5, pol  # it recomputed
    for tokens, logprobs in (r["exact_heads"], r["all"]):
        assert tokens == text_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, text_logprobs)) <= 1e-4


def test_exact_composition_in_a_bfloat16_engine_through_the_learned_cache_layout(engine_runs):
    r = engine_runs["family:llama-bfloat16"].result()
    (tokens, logprobs, injected), (text_tokens, text_logprobs) = r["exact"], r["text"]
    approx_injected = r["approx"][2]
    assert injected > 0 and tokens == text_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, text_logprobs)) <= 0.05  # bfloat16 KV and activations
    # every injected token went straight into vLLM's bfloat16 cache, in the layout learned from its backend
    assert r["paged_write_tokens"] == injected + approx_injected
    assert r["layouts"] and all(dtype == "torch.bfloat16" and learned for _, dtype, learned in r["layouts"])
