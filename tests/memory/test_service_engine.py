"""The memory service end to end with the real JAX engine (tiny model) and the MiniLM embedder."""

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("sentence_transformers")

from tiny_models import make_tiny_model  # noqa: E402

from inferscale.evaluation.datasets import load_demo  # noqa: E402
from inferscale.jax.engine import Engine, EngineConfig  # noqa: E402
from inferscale.retrieval.embedders import MiniLMEmbedder  # noqa: E402
from inferscale.memory.service import MemoryService  # noqa: E402
from inferscale.memory.service_types import MemoryConfig


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model(path, "llama")
    return Engine.from_pretrained(path, EngineConfig(max_context=1024))


def test_ingest_retrieve_and_serve_by_injection(engine, tmp_path):
    demo = load_demo()
    conv = demo.conversation
    # float32 KV: the store must hold what the encoder wrote (bfloat16, the default, rounds it)
    svc = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=4, kv_dtype="float32"), engine, MiniLMEmbedder())
    svc.add("maya", turns=conv.turns, facts=conv.facts)
    q = demo.questions[0]
    hits = svc.search("maya", q.question, k=5)
    gold = {f for f in conv.facts if f.source_turn in q.evidence}
    assert {h.fact_id for h in hits} & {f.id for f in gold}  # MiniLM finds the evidence
    kv = svc.load_kv("maya", [h.fact_id for h in hits])
    # the service's windows are the conversation's windows: same KV as encoding directly
    direct = {f.fact_id: f for f in engine.encode_facts([conv.fact(h.fact_id) for h in hits], conv, w=4)}
    for f in kv:
        np.testing.assert_allclose(f.k, direct[f.fact_id].k, rtol=1e-5, atol=1e-5)
    ans = engine.answer(q.question, kv, mode="inject", max_new_tokens=4)
    assert ans.num_injected > sum(f.num_tokens for f in kv)  # header + facts

    fact = next(f for f in conv.facts if f.source_turn and conv.turn_index(f.source_turn) > 4)
    window_turn = conv.context_window(fact, 4)[-1]
    before = svc.load_kv("maya", [fact.id])[0].k.copy()
    redone = svc.update_turn("maya", window_turn.id, "Actually, let's talk about something else entirely.")
    assert fact.id in redone
    assert not np.allclose(svc.load_kv("maya", [fact.id])[0].k, before)
