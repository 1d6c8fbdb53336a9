"""A request reads the memory once: `search_plan`, `list_plan` and `get_plan` return the facts and
their `FactPlan` from one catalog snapshot, and they are exactly what `search`, `list`, `get` and
`fact_plan` return on their own, whatever the memory, the deletions, the filter and k."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doubles import ChainEncoder, HashEmbedder
from inferscale.common.facts import Fact, Turn
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

TURNS = [Turn(f"T{i}", "Tom" if i % 2 else "Maya", f"turn {i} about topic {i}") for i in range(6)]
WORDS = ["garden", "tomatoes", "Leeds", "cycling", "piano", "sister", "coffee", "the office"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.sampled_from(WORDS), min_size=1, max_size=8),
       deleted=st.sets(st.integers(0, 7), max_size=3), k=st.integers(1, 10), query=st.sampled_from(WORDS),
       category=st.sampled_from([None, "work", "home"]))
def test_the_plans_read_with_the_facts_equal_the_separate_reads(tmp_path_factory, texts, deleted, k, query, category):
    root = tmp_path_factory.mktemp("mem")
    svc = MemoryService(MemoryConfig(root=str(root), w=2, index="exact", kv_dtype="float32"), ChainEncoder(),
                        HashEmbedder())
    facts = [Fact(f"f{i}", f"Maya likes {t} number {i}.", f"T{i % 6}", metadata={"category": ["work", "home"][i % 2]})
             for i, t in enumerate(texts)]
    svc.add("maya", facts=facts, turns=TURNS)
    for i in sorted(deleted):
        if i < len(facts) - 1:  # one fact stays
            svc.delete("maya", f"f{i}")
    filters = None if category is None else {"category": category}

    hits, plan = svc.search_plan("maya", query, k, filters=filters)
    assert [(h.fact_id, h.score) for h in hits] == [(h.fact_id, h.score) for h in svc.search("maya", query, k,
                                                                                                 filters=filters)]
    assert plan == svc.fact_plan("maya", [h.fact_id for h in hits])

    listed, plan = svc.list_plan("maya", filters)
    assert [f.fact_id for f in listed] == [f.fact_id for f in svc.list("maya", filters)]
    assert plan == svc.fact_plan("maya", [f.fact_id for f in listed])

    ids = [f.fact_id for f in reversed(listed)]
    named, plan = svc.get_plan("maya", ids)
    assert [f.fact_id for f in named] == ids and [f.text for f in named] == [svc.get("maya", i).text for i in ids]
    assert [fid for fid, _, _ in plan.facts] == ids
    svc.close()
