"""Memory encoded with the conversation encoding (`MemoryConfig.context="conversation"`): each fact
is encoded from its span (`Conversation.context_span`), the same span through the service as
through the conversation, and a turn edit re-encodes exactly the facts whose span held the turn."""

from __future__ import annotations

import numpy as np

from doubles import HashEmbedder, WindowEncoder, encoded_after
from inferscale.common.facts import Conversation, Fact, Turn
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

TURNS = [Turn(f"T{i}", "Tom" if i % 2 else "Maya", f"turn {i} about topic {i}") for i in range(14)]
FACTS = [Fact(f"f{i}", f"Fact number {i} about the garden.", f"T{i}") for i in range(1, 14, 2)]


def service(root, encoder=None, **config):
    config = {"w": 3, "context": "conversation", "index": "exact", **config}
    return MemoryService(MemoryConfig(root=str(root), **config), encoder or WindowEncoder(), HashEmbedder())


def spans(svc, user="maya"):
    """fact id -> the turn ids its stored KV was encoded from."""
    return encoded_after(svc, user)


def test_each_fact_is_encoded_from_its_span(tmp_path):
    svc = service(tmp_path / "mem", ingest_batch=2)  # spans cross batches
    svc.add("maya", facts=FACTS, turns=TURNS)
    conv = Conversation("c", TURNS, FACTS)
    assert spans(svc) == {f.id: [t.id for t in conv.context_span(f, 3)] for f in FACTS}
    assert spans(svc)["f9"] == ["T3", "T4", "T5", "T6", "T7", "T8"]  # blocks of 3: T3.. for a window T6-T8
    assert svc.meta.context == "conversation"


def test_a_turn_edit_reencodes_the_facts_whose_span_held_it(tmp_path):
    enc = WindowEncoder()
    svc = service(tmp_path / "mem", enc)
    svc.add("maya", facts=FACTS, turns=TURNS)
    before = {kv.fact_id.split("~")[0]: kv.k.copy() for kv in svc.load_kv("maya", [f.id for f in FACTS])}
    enc.calls.clear()
    # T4 is in f5's and f7's windows, and in f9's span only (its window is T6-T8)
    assert set(svc.update_turn("maya", "T4", "an edited turn")) == {"f5", "f7", "f9"}
    after = {kv.fact_id.split("~")[0]: kv.k for kv in svc.load_kv("maya", [f.id for f in FACTS])}
    for f in FACTS:
        assert np.array_equal(after[f.id], before[f.id]) == (f.id not in ("f5", "f7", "f9"))


def test_a_deleted_turn_keeps_its_place_in_the_blocks(tmp_path):
    svc = service(tmp_path / "mem")
    svc.add("maya", facts=FACTS, turns=TURNS)
    assert set(svc.delete_turn("maya", "T7")) == {"f9", "f11"}  # f7 comes from T7: its span ends before it
    got = spans(svc)
    assert got["f9"] == ["T3", "T4", "T5", "T6", "T8"]  # a window of the 3 live turns before T9: T5, T6, T8
    assert got["f11"] == ["T6", "T8", "T9", "T10"]  # blocks did not move: T6.. for T11
    assert got["f13"] == ["T9", "T10", "T11", "T12"]
