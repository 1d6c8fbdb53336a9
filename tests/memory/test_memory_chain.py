"""Each user's memory chain (`memory.chain`): links that are the joint encoding of the whole memory,
extended by an append, re-encoded after an update or a delete from the changed fact on, never stale
on any replica, apart per user, held to a token budget, and an interrupted extension loses nothing."""

from __future__ import annotations

import numpy as np
import pytest

from doubles import ChainEncoder, HashEmbedder
from inferscale.common.prompt.chain_links import is_chain_key
from inferscale.common.facts import Fact, Turn
from inferscale.memory.chain import MemoryChain
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

TURNS = [Turn(f"T{i}", "Tom" if i % 2 else "Maya", f"turn {i} about topic {i}") for i in range(8)]
FACTS = [Fact(f"f{i}", f"Fact number {i} about the garden.", f"T{i}") for i in range(8)]
BUDGET = 10_000


def service(root, **storage) -> MemoryService:
    return MemoryService(MemoryConfig(root=str(root), w=2, index="exact", kv_dtype="float32", **storage), ChainEncoder(), HashEmbedder())


def chain_of(svc, budget=BUDGET) -> MemoryChain:
    return MemoryChain(svc, svc.encoder, ChainEncoder.HEADER, budget)


def check_links(svc, chain, user="maya"):
    """Every link the user's store holds is on the current chain, and is the joint encoding."""
    facts = svc.list(user)
    plan = svc.fact_plan(user, [f.fact_id for f in facts])
    tokens = [list(t) for _, _, t in plan.facts]
    keys = chain.keys(plan.incarnation, tokens)
    store = svc.kv.read(user)
    held = [k for k in store.fact_ids() if is_chain_key(k)]
    assert set(held) <= set(keys)
    joint_k, joint_v = ChainEncoder.joint(list(ChainEncoder.HEADER) + [t for f in tokens for t in f])
    pos = len(ChainEncoder.HEADER)
    for key, ids in zip(keys, tokens):
        if key in held:
            (link,) = store.get([key])
            assert list(link.token_ids) == ids
            np.testing.assert_array_equal(link.k, joint_k[:, pos:pos + len(ids)])
            np.testing.assert_array_equal(link.v, joint_v[:, pos:pos + len(ids)])
        pos += len(ids)


def test_the_chain_is_the_joint_encoding_of_the_whole_memory(tmp_path):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS[:5], turns=TURNS)
    chain = chain_of(svc)
    assert chain.status("maya") == {"facts": 5, "held": 5, "stored": 0}
    assert chain.extend("maya") == {"encoded": 5, "dropped": 0}
    assert chain.status("maya")["stored"] == 5
    check_links(svc, chain)
    assert chain.extend("maya") == {"encoded": 0, "dropped": 0}  # nothing left to do
    assert chain.stats["extensions"] == 1 and chain.stats["links_encoded"] == 5


def test_an_append_encodes_the_new_fact_alone_and_a_restart_keeps_the_links(tmp_path):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS[:5], turns=TURNS)
    chain_of(svc).extend("maya")
    svc = service(tmp_path / "mem")  # a restart: the first write recovers the user's store
    chain = chain_of(svc)
    svc.add("maya", facts=[FACTS[5]])
    assert chain.status("maya") == {"facts": 6, "held": 6, "stored": 5}  # crash recovery kept them
    svc.encoder.encoded.clear()
    assert chain.extend("maya") == {"encoded": 1, "dropped": 0}
    n_before = len(ChainEncoder.HEADER) + sum(len(f.text) + 0 for f in FACTS[:5])
    assert svc.encoder.encoded == [(n_before, len(FACTS[5].text))]  # one pass over the new fact only
    check_links(svc, chain)


@pytest.mark.parametrize("change", ["update", "delete"])
def test_a_change_invalidates_only_the_links_from_it_on(tmp_path, change):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS[:6], turns=TURNS)
    chain = chain_of(svc)
    chain.extend("maya")
    if change == "update":
        svc.update("maya", "f2", "Maya planted tomatoes.")
    else:
        svc.delete("maya", "f2")
    assert chain.status("maya")["stored"] == 2  # what a request injects now: the links before f2
    out = chain.extend("maya")
    assert out == {"encoded": 4 if change == "update" else 3, "dropped": 4}
    assert chain.status("maya")["stored"] == (6 if change == "update" else 5)
    check_links(svc, chain)


def test_replicas_never_serve_a_stale_link(tmp_path, shared_storage):
    catalog, kv = shared_storage
    a, b = service(tmp_path / "a", catalog=catalog, kv_store=kv), service(tmp_path / "b", catalog=catalog, kv_store=kv)
    a.add("maya", facts=FACTS[:6], turns=TURNS)
    chain_a, chain_b = chain_of(a), chain_of(b)
    chain_a.extend("maya")
    assert chain_b.status("maya")["stored"] == 6  # replica b reads a's links
    b.update("maya", "f3", "Tom moved to Porto.")
    assert chain_a.status("maya")["stored"] == 3  # a sees the update: nothing after f3 is served
    chain_b.extend("maya")
    assert chain_a.status("maya")["stored"] == 6
    check_links(a, chain_a)


def test_chains_are_kept_apart_per_user_and_per_incarnation(tmp_path):
    svc = service(tmp_path / "mem")
    for user in ("alice", "bob"):
        svc.add(user, facts=FACTS[:4], turns=TURNS)
    chain = chain_of(svc)
    chain.extend("alice")
    assert chain.status("bob")["stored"] == 0  # the same facts, another user: nothing of alice's
    assert not [k for k in svc.kv.read("bob").fact_ids() if is_chain_key(k)]
    svc.delete_user("alice")
    svc.add("alice", facts=FACTS[:4], turns=TURNS)
    assert chain.status("alice")["stored"] == 0  # a re-created user starts a chain of its own


def test_a_chain_holds_its_budget_and_retrieval_serves_the_rest(tmp_path):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS, turns=TURNS)
    budget = sum(len(f.text) for f in FACTS[:3])
    chain = chain_of(svc, budget)
    assert chain.extend("maya") == {"encoded": 3, "dropped": 0}
    assert chain.status("maya") == {"facts": 8, "held": 3, "stored": 3}
    facts, n, plan = chain.select("maya", "Fact number 6 about the garden.", rest_k=2)
    assert n == 3 and [f.fact_id for f in facts[:3]] == ["f0", "f1", "f2"]
    rest = [f.fact_id for f in facts[3:]]
    assert len(rest) == 2 and not set(rest) & {"f0", "f1", "f2"} and rest[0] == "f6"  # the most relevant first
    # the plan is read with the facts: the same facts, in order, as `fact_plan` reads them
    assert plan == svc.fact_plan("maya", [f.fact_id for f in facts])


def test_an_interrupted_extension_loses_nothing_and_leaves_no_wrong_link(tmp_path, monkeypatch):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS[:6], turns=TURNS)
    chain = chain_of(svc)
    chain.extend("maya")
    svc.update("maya", "f2", "Maya planted tomatoes.")
    store_type = type(svc.kv.read("maya"))

    def crash(self, facts):
        raise OSError("disk gone")

    with monkeypatch.context() as m:
        m.setattr(store_type, "put", crash)
        assert chain.schedule("maya").result() == {"encoded": 0, "dropped": 0}  # logged, counted, not raised
    assert chain.stats["errors"] == 1
    assert [f.text for f in svc.list("maya")][2] == "Maya planted tomatoes."  # every acknowledged write
    assert chain.status("maya")["stored"] == 2
    check_links(svc, chain)
    chain.schedule("maya").result()
    chain.drain()
    assert chain.status("maya")["stored"] == 6
    check_links(svc, chain)
    chain.close()
