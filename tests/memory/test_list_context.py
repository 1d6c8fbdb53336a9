"""Memory encoded with list context (`MemoryConfig.context="facts"`): each fact after the `w` facts
added before it. Every change re-encodes exactly the facts whose context it touched, and a
forgotten text survives in no fact's KV."""

from __future__ import annotations

import numpy as np
import pytest

from doubles import HashEmbedder, WindowEncoder, all_bytes, encoded_after
from inferscale.common.facts import Fact, Turn
from inferscale.common.storage.format import ModelMismatchError
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

TURNS = [Turn(f"T{i}", "Tom" if i % 2 else "Maya", f"turn {i} about topic {i}") for i in range(6)]
FACTS = [Fact(f"f{i}", f"Fact number {i} about the garden.", f"T{i}") for i in range(6)]


def service(root, encoder=None, **config):
    config = {"w": 2, "context": "facts", "index": "exact", **config}
    return MemoryService(MemoryConfig(root=str(root), **config), encoder or WindowEncoder(), HashEmbedder())


def contexts(svc, user="maya"):
    """fact id -> the fact ids its stored KV was encoded after."""
    return encoded_after(svc, user)


def test_each_fact_is_encoded_after_the_w_facts_added_before_it(tmp_path):
    svc = service(tmp_path / "mem", ingest_batch=2)  # the context crosses batches and adds
    svc.add("maya", facts=FACTS[:5], turns=TURNS)
    svc.add("maya", facts=FACTS[5:])
    assert contexts(svc) == {"f0": [], "f1": ["f0"], "f2": ["f0", "f1"], "f3": ["f1", "f2"], "f4": ["f2", "f3"],
                             "f5": ["f3", "f4"]}
    assert svc.meta.context == "facts" and svc.meta.w == 2


def test_an_update_reencodes_the_fact_and_the_facts_that_saw_it(tmp_path):
    enc = WindowEncoder()
    svc = service(tmp_path / "mem", enc)
    svc.add("maya", facts=FACTS, turns=TURNS)
    before = {kv.fact_id.split("~")[0]: kv.k.copy() for kv in svc.load_kv("maya", [f.id for f in FACTS])}
    enc.calls.clear()
    svc.update("maya", "f2", "Maya planted tomatoes.")
    assert enc.calls == [["f2", "f3", "f4"]]
    after = {kv.fact_id.split("~")[0]: kv for kv in svc.load_kv("maya", [f.id for f in FACTS])}
    for f in ("f0", "f1", "f5"):
        np.testing.assert_array_equal(after[f].k, before[f])
    for f in ("f2", "f3", "f4"):
        assert not np.array_equal(after[f].k, before[f])
    for f in ("f3", "f4"):  # they saw the new text, not the old
        assert "f2:Maya planted tomatoes." in after[f].meta["ctx"] and "f2:Fact number 2" not in after[f].meta["ctx"]
    assert [e["event"] for e in svc.history("maya", "f3")] == ["ADD", "REENCODE"]


def test_a_deleted_fact_survives_in_no_kv_and_no_file(tmp_path):
    root = tmp_path / "mem"
    enc = WindowEncoder()
    svc = service(root, enc)
    secret = "Maya's locker code is QUOKKA-7731."
    svc.add("maya", facts=FACTS[:2] + [Fact("gone", secret, "T2")] + FACTS[2:], turns=TURNS)
    enc.calls.clear()
    svc.delete("maya", "gone")
    assert enc.calls == [["f2", "f3"]]  # the two facts whose context held it
    assert contexts(svc) == {"f0": [], "f1": ["f0"], "f2": ["f0", "f1"], "f3": ["f1", "f2"], "f4": ["f2", "f3"],
                             "f5": ["f3", "f4"]}
    assert secret.encode() not in all_bytes(root)
    again = service(root)  # and what a fresh process reads
    assert [k.fact_id.split("~")[0] for k in again.load_kv("maya", [f.id for f in FACTS])] == [f.id for f in FACTS]


def test_turn_edits_reencode_nothing_under_list_context(tmp_path):
    enc = WindowEncoder()
    svc = service(tmp_path / "mem", enc)
    svc.add("maya", facts=FACTS, turns=TURNS)
    enc.calls.clear()
    assert svc.update_turn("maya", "T1", "an edited turn") == [] and enc.calls == []


def test_a_store_of_the_other_context_is_refused(tmp_path):
    turns = service(tmp_path / "mem", context="turns")
    turns.add("maya", facts=FACTS[:2], turns=TURNS)
    with pytest.raises(ModelMismatchError, match="context is 'turns', expected 'facts'"):
        service(tmp_path / "mem").load_kv("maya", ["f0"])


def test_context_is_validated():
    with pytest.raises(ValueError, match="MemoryConfig.context must be one of turns, facts"):
        MemoryConfig(root="m", context="sessions")
