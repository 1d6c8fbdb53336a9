"""Metadata filters against the plain-Python reference (`filters.matches`) over random facts and
random filters, and expiry at its boundary second, on SQLite and on PostgreSQL + Redis."""

from __future__ import annotations

import random
import sqlite3

import numpy as np
import pytest

from doubles import Clock, all_bytes
from inferscale.common.facts import Fact
from inferscale.common.storage.filters import matches, parse_filter
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig, UnknownFactError

T0 = 1_800_000_000.0
WORDS = ["tea", "coffee", "work", "trip", "Leeds", "Lisbon", "piano", "dog", "garden", "bike"]
CATEGORIES = ["work", "home", "trip", "é-accent", "Z"]
TAGS = ["a", "b", "c", "d"]


@pytest.fixture
def svc(tmp_path, encoder, embedder, storage):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=2, index="faiss", **storage), encoder, embedder)
    s.clock = Clock(T0)
    yield s
    s.close()


def random_metadata(rng: random.Random) -> dict:
    md = {}
    if rng.random() < 0.8:
        md["category"] = rng.choice(CATEGORIES)
    if rng.random() < 0.6:
        md["tags"] = rng.sample(TAGS, rng.randint(0, 3))
    if rng.random() < 0.7:
        md["priority"] = rng.choice([0, 1, 2, 2.5, 3, -1, 10])
    if rng.random() < 0.5:
        md["done"] = rng.random() < 0.5
    if rng.random() < 0.3:
        md["code"] = rng.choice(["1", "2", 1, True])  # the same spelling in three types
    return md


def random_filter(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth < 2 and r < 0.3:
        op = rng.choice(["and", "or", "AND", "OR"])
        return {op: [random_filter(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if depth < 2 and r < 0.4:
        return {"not": random_filter(rng, depth + 1)}
    field = rng.choice(["category", "tags", "priority", "done", "code", "missing", "created_at", "updated_at"])
    if field in ("created_at", "updated_at"):
        t = T0 + rng.randint(0, 40)
        return {field: {rng.choice(["gt", "gte", "lt", "lte", "eq", "ne"]): rng.choice([t, "2027-01-15T08:00:00Z"])}}
    values = {"category": CATEGORIES + ["none"], "tags": TAGS, "priority": [0, 1, 2, 2.5, 3, 10, 1.0],
              "done": [True, False], "code": ["1", 1, True, "2"], "missing": ["x", 1]}[field]
    op = rng.choice(["eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "bare"])
    if op in ("in", "nin"):
        return {field: {op: rng.sample(values, rng.randint(1, min(3, len(values))))}}
    value = rng.choice(values)
    if op in ("gt", "gte", "lt", "lte") and isinstance(value, bool):
        op = "eq"
    return {field: value} if op == "bare" else {field: {op: value}}


@pytest.mark.parametrize("plan", ["few", "broad"])
def test_filters_agree_with_the_reference_on_random_facts(svc, embedder, plan, monkeypatch):
    """"few": each filter's matches are scored directly; "broad": every search over-fetches first,
    then runs among the matches with faiss's IDSelectorBatch (the plans of large memories)."""
    if plan == "broad":
        import inferscale.retrieval.faiss_index as faiss_index

        monkeypatch.setattr(svc.reads, "FEW", 0)
        monkeypatch.setattr(svc.reads, "OVERFETCH", 2)
        monkeypatch.setattr(faiss_index, "BRUTE_AMONG", 0)
    rng = random.Random(7)
    facts, times = [], {}
    for i in range(48):
        svc.clock.t = T0 + i  # created one second apart
        f = Fact(f"f{i}", f"Fact {i}: {' '.join(rng.sample(WORDS, 3))}.", metadata=random_metadata(rng))
        svc.add("alice", facts=[f])
        facts.append(f)
    svc.clock.t = T0 + 30
    for f in facts[:8]:  # some facts changed later: their updated_at moves, created_at stays
        svc.update("alice", f.id, metadata={**f.metadata, "category": "work"})
    svc.add("bob", facts=[Fact("b0", "Fact 0: tea coffee work.", metadata={"category": "work"})])  # another user
    rows = {f.fact_id: f for f in svc.list("alice")}
    assert len(rows) == 48 and rows["f3"].created_at == T0 + 3 and rows["f3"].updated_at == T0 + 30
    tried = nonempty = 0
    for _ in range(120):
        spec = random_filter(rng)
        node = parse_filter(spec)
        want = [fid for fid, f in rows.items()
                if matches(node, f.metadata, {"created_at": f.created_at, "updated_at": f.updated_at,
                                              "expires_at": f.expires_at})]
        got = [f.fact_id for f in svc.list("alice", filters=spec)]
        assert got == want, spec
        page1 = svc.list_page("alice", limit=5, filters=spec)
        page2 = svc.list_page("alice", limit=5, filters=spec, cursor=page1.next_cursor) if page1.next_cursor else None
        assert [f.fact_id for f in page1.items + (page2.items if page2 else [])] == want[:10]
        query = " ".join(rng.sample(WORDS, 2))
        q = embedder.embed([query])[0]
        for k in (1, 4, 100):  # k larger than the matches: all of them
            hits = svc.search("alice", query, k=k, filters=spec)
            assert {h.fact_id for h in hits} <= set(want) and len(hits) == min(k, len(want)), spec
            best = sorted((-float(np.dot(embedder.embed([rows[f].text])[0], q)) for f in want))[:k]
            np.testing.assert_allclose(sorted(-h.score for h in hits), best, atol=1e-5)
        tried += 1
        nonempty += bool(want) and len(want) < 48
    assert nonempty > 40  # the random filters do select


@pytest.mark.parametrize("spec, why", [
    ({"priority": {"between": [1, 2]}}, "unknown operator"),
    ({"tags": ["a"]}, "lists go in 'in'"),
    ({"in": 3}, "goes inside a field"),
    ({"and": []}, "non-empty list"),
    ({"done": {"gt": True}}, "not booleans"),
    ({"created_at": {"gt": "yesterday"}}, "ISO 8601"),
    ({"priority": {"in": []}}, "non-empty list"),
])
def test_bad_filters_name_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match=why):
        parse_filter(spec)


@pytest.mark.parametrize("metadata, why", [
    ({"nested": {"a": 1}}, "must be a number"),
    ({"created_at": "x"}, "reserved"),
    ({"n": float("nan")}, "finite"),
    ({"n": 2**60}, "2\\*\\*53"),
    ({"l": ["a", 1]}, "strings only"),
    ({"s": "x" * 5000}, "the limit is 4096"),
    ({"bad key": 1}, "invalid metadata key"),
])
def test_bad_metadata_is_refused(metadata, why):
    with pytest.raises(ValueError, match=why):
        Fact("f1", "A fact.", metadata=metadata)


def test_an_expired_fact_leaves_every_read_at_its_second_and_the_sweep_forgets_it(svc, tmp_path, storage):
    svc.add("alice", facts=[Fact("f1", "Alice is in Lisbon this week.", expires_at=T0 + 10),
                            Fact("f2", "Alice plays the piano."), Fact("f3", "Alice has a dog.")])
    svc.clock.t = T0 + 9.999
    assert svc.get("alice", "f1").expires_at == T0 + 10
    assert svc.search("alice", "Lisbon", k=1)[0].fact_id == "f1"
    assert svc.fact_plan("alice", ["f1"]).facts[0][0] == "f1"
    svc.clock.t = T0 + 10  # the boundary second: expired
    with pytest.raises(UnknownFactError):
        svc.get("alice", "f1")
    with pytest.raises(UnknownFactError):
        svc.fact_plan("alice", ["f1", "f2"])
    with pytest.raises(UnknownFactError):
        svc.load_kv("alice", ["f1"])
    assert [f.fact_id for f in svc.list("alice")] == ["f2", "f3"]
    hits = svc.search("alice", "Lisbon", k=2)  # still k facts: the live ones
    assert len(hits) == 2 and "f1" not in {h.fact_id for h in hits}
    assert svc.list("alice", filters={"expires_at": {"gt": 0}}) == []
    assert svc.sweep_expired() == {"alice": ["f1"]}
    assert svc.sweep_expired() == {}
    assert [e["event"] for e in svc.history("alice", "f1")] == ["ADD", "DELETE"]
    assert all(e["old_text"] is None and e["new_text"] is None for e in svc.history("alice", "f1"))
    assert b"Lisbon" not in all_bytes(tmp_path / "mem")  # catalog pages, WAL, KV shards, index
    if storage:
        import psycopg
        import redis

        r = redis.Redis.from_url(storage["kv_store"])
        assert not any(b"Lisbon" in r.dump(k) for k in r.keys("*"))
        db = psycopg.connect(storage["catalog"], autocommit=True)
        for table in ("facts", "history", "fact_meta"):
            assert "Lisbon" not in str(db.execute(f"SELECT * FROM {table}").fetchall())
    else:
        db = sqlite3.connect(tmp_path / "mem" / "catalog.sqlite")
        assert db.execute("SELECT COUNT(*) FROM facts WHERE fact_id='f1'").fetchone()[0] == 0


def test_updates_change_metadata_and_expiry_without_reencoding(svc, encoder):
    svc.add("alice", facts=[Fact("f1", "Alice works at Acme.", metadata={"category": "work"})])
    encoder.calls.clear()
    svc.clock.t = T0 + 5
    f = svc.update("alice", "f1", metadata={"category": "home", "tags": ["x"]}, expires_at=T0 + 60)
    assert encoder.calls == [] and f.metadata == {"category": "home", "tags": ["x"]} and f.expires_at == T0 + 60
    assert svc.list("alice", filters={"category": "work"}) == []
    assert [x.fact_id for x in svc.list("alice", filters={"tags": "x"})] == ["f1"]
    event = svc.history("alice", "f1")[-1]  # the change is in the history, with what the fact became
    assert (event["event"], event["old_text"], event["metadata"], event["expires_at"]) == \
        ("UPDATE", None, {"category": "home", "tags": ["x"]}, T0 + 60)
    f = svc.update("alice", "f1", expires_at=None)
    assert f.expires_at is None and f.metadata["category"] == "home"
    svc.update("alice", "f1", text="Alice works at Initech.")
    assert encoder.calls == [["f1"]] and svc.get("alice", "f1").metadata == {"category": "home", "tags": ["x"]}


def test_adding_a_fact_whose_id_expired_replaces_it(svc):
    svc.add("alice", facts=[Fact("f1", "Alice is in Lisbon.", expires_at=T0 + 1)])
    svc.clock.t = T0 + 2
    svc.add("alice", facts=[Fact("f1", "Alice is home in Leeds.")])
    assert svc.get("alice", "f1").text == "Alice is home in Leeds."
