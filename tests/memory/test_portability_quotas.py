"""Export and import (into a fresh root, for another model), pages, and quotas checked at commit,
on SQLite and on PostgreSQL + Redis."""

from __future__ import annotations

import copy
import json

import pytest

from doubles import Clock, HashEmbedder, WindowEncoder, all_bytes, encoded_after
from inferscale.common.facts import Fact, Turn
from inferscale.memory.quotas import Quota, QuotaExceeded
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

T0 = 1_800_000_000.0
QUESTIONS = ["where does Maya live", "what pet does Maya have", "which instrument", "Maya's job"]


def service(root, storage, encoder=None) -> MemoryService:
    s = MemoryService(MemoryConfig(root=str(root), w=2, index="faiss", **storage), encoder or WindowEncoder(),
                      HashEmbedder())
    s.clock = Clock(T0)
    return s


@pytest.fixture
def source(tmp_path, storage):
    s = service(tmp_path / "a", storage)
    turns = [Turn(f"t{i}", "Maya" if i % 2 else "Sam", text, 1, "2026-05-01")
             for i, text in enumerate(["Hi Maya!", "I moved to Leeds.", "Nice. Pets?", "A dog named Rex.",
                                       "Music?", "I play the piano at the library where I work."])]
    s.add("maya", turns=turns)
    s.add("maya", facts=[Fact("home", "Maya lives in Leeds.", "t1", "2026-05-01", {"category": "home"}),
                         Fact("pet", "Maya has a dog named Rex.", "t3", metadata={"tags": ["pet", "dog"]}),
                         Fact("piano", "Maya plays the piano.", "t5", metadata={"priority": 2}),
                         Fact("job", "Maya works at the library.", "t5", expires_at=T0 + 1000),
                         Fact("trip", "Maya is in Lisbon this week.", "t5", expires_at=T0 + 5)])
    s.clock.t = T0 + 1
    s.update("maya", "home", text="Maya lives in York.")
    s.delete_turn("maya", "t0")
    yield s
    s.close()


def test_export_then_import_into_a_fresh_root_and_another_model_answers_the_same(source, tmp_path, storage, request):
    doc = json.loads(json.dumps(source.export_memory("maya")))  # what travels is JSON
    assert doc["format"] == "inferscale.memory" and doc["version"] == 1
    assert [t["text"] for t in doc["turns"]][:1] == [None]  # the deleted turn keeps its place, not its text
    home = next(f for f in doc["facts"] if f["id"] == "home")
    assert [e["event"] for e in home["history"]] == ["ADD", "UPDATE", "REENCODE"]
    assert home["metadata"] == {"category": "home"}
    if storage:  # another deployment: a database and a Redis database of its own
        from services import new_database

        storage = {"catalog": new_database(request.getfixturevalue("postgres_admin")),
                   "kv_store": storage["kv_store"].rsplit("/", 1)[0] + "/1"}
    target = service(tmp_path / "b", storage, WindowEncoder("another-model"))
    target.clock.t = source.clock.t = T0 + 6  # by now "trip" has expired: it is not written
    out = target.import_memory("maya", doc)
    assert out.expired == ["trip"] and sorted(out.facts) == ["home", "job", "pet", "piano"]
    src, dst = {f.fact_id: f for f in source.list("maya")}, {f.fact_id: f for f in target.list("maya")}
    assert sorted(src) == sorted(dst)
    for fid, f in src.items():
        g = dst[fid]
        assert (g.text, g.source_turn, g.date, g.metadata, g.expires_at, g.created_at, g.updated_at) == \
               (f.text, f.source_turn, f.date, f.metadata, f.expires_at, f.created_at, f.updated_at)
    for q in QUESTIONS:
        ranked = [sorted((round(h.score, 5), h.fact_id) for h in svc.search("maya", q, k=4)) for svc in (source, target)]
        assert ranked[0] == ranked[1]  # the same facts at the same scores
    assert encoded_after(target, "maya") == {k: v for k, v in encoded_after(source, "maya").items() if k != "trip"}
    assert sorted(sum(target.encoder.calls, [])) == ["home", "job", "pet", "piano"]  # by the target's model
    assert [e["event"] for e in target.history("maya", "home")] == ["ADD", "UPDATE", "REENCODE", "IMPORT"]
    target.close()


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(format="mem0"), "format must be"),
    (lambda d: d["facts"][1].update(source_turn="t99"), "facts.1: source turn 't99'"),
    (lambda d: d["facts"][2].update(metadata={"a": {"b": 1}}), "metadata.a must be a number"),
    (lambda d: d["facts"][3].update(expires_at="soon"), "facts.3.expires_at must be an ISO 8601"),
    (lambda d: d["facts"].append(dict(d["facts"][0])), "appears twice"),
    (lambda d: d["facts"][0]["history"].append({"event": "MERGE"}), "event must be one of"),
    (lambda d: d["turns"][2].update(colour="red"), "turns.2: unknown field"),
])
def test_import_validates_everything_before_writing_anything(source, tmp_path, storage, change, why):
    doc = source.export_memory("maya")
    bad = copy.deepcopy(doc)
    change(bad)
    with pytest.raises(ValueError, match=why):
        source.import_memory("maya-copy", bad)
    assert "maya-copy" not in source.users()
    with pytest.raises(ValueError, match="already holds"):  # the user's own ids: refused, nothing written
        source.import_memory("maya", doc)
    assert source.version("maya") == source.export_memory("maya")["memory_version"]


def test_pages_cover_the_list_once_in_order(source):
    for i in range(7):
        source.add(f"user{i}", facts=[Fact(f"f{i}", f"Fact {i}.")])
    seen, cursor = [], None
    while True:
        page = source.users_page("user", limit=3, cursor=cursor)
        seen += page.items
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [f"user{i}" for i in range(7)]
    source.add("maya", facts=[Fact(f"x{i}", f"Extra fact {i}.") for i in range(6)])
    ids, cursor = [], None
    while True:
        page = source.list_page("maya", limit=4, cursor=cursor)
        ids += [f.fact_id for f in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert ids == [f.fact_id for f in source.list("maya")]
    with pytest.raises(ValueError, match="not a cursor of this list"):
        source.list_page("maya", cursor=source.users_page("user", limit=1).next_cursor)
    with pytest.raises(ValueError, match="limit"):
        source.list_page("maya", limit=0)
    events = source.history_page("maya", "home", limit=1)
    assert len(events.items) == 1 and source.history_page("maya", "home", 1, events.next_cursor).items[0]["event"] \
        == "UPDATE"


def test_quotas_are_checked_at_commit_and_leave_nothing_behind(tmp_path, storage):
    s = service(tmp_path / "q", storage)
    q = Quota("team-a:", max_facts=3)
    s.add("team-a:ann", facts=[Fact("f1", "Ann likes tea."), Fact("f2", "Ann has a cat.")], quota=q)
    s.add("team-a:bob", facts=[Fact("f1", "Bob likes jazz.")], quota=q)
    with pytest.raises(QuotaExceeded, match="max_facts is 3: 3 in use, and this write adds 1"):
        s.add("team-a:bob", facts=[Fact("f2", "Bob rides a bike.")], quota=q)
    s.add("team-b:cat", facts=[Fact(f"f{i}", f"Cat fact {i}.") for i in range(5)], quota=Quota("team-b:", 10))
    facts, kv_bytes = s.usage("team-a:")
    assert facts == 3 and kv_bytes > 0
    per_fact = kv_bytes // 3
    tight = Quota("team-c:", max_kv_bytes=per_fact // 2)
    with pytest.raises(QuotaExceeded, match="max_kv_bytes"):  # known only once encoded: refused at commit
        s.add("team-c:dan", facts=[Fact("f1", "Dan likes tea.")], quota=tight)
    assert s.usage("team-c:") == (0, 0) and "team-c:dan" not in s.users()
    if storage:  # the KV encoded before the refusal is gone too
        import redis

        r = redis.Redis.from_url(storage["kv_store"])
        assert not any(b"Dan likes" in r.dump(k) for k in r.keys("*"))
    else:
        assert b"Dan likes" not in all_bytes(tmp_path / "q")
    with pytest.raises(QuotaExceeded, match="max_kv_bytes"):  # an update that grows the KV past the limit
        s.update("team-a:ann", "f1", "Ann likes tea " + "and biscuits " * 20 + ".", quota=Quota("team-a:", None,
                                                                                                 kv_bytes + 1))
    assert s.get("team-a:ann", "f1").text == "Ann likes tea."
    s.close()


def test_a_catalog_from_before_metadata_is_migrated_and_its_kv_bytes_counted(tmp_path):
    import sqlite3

    s = service(tmp_path / "old", {})
    s.add("ann", facts=[Fact("f1", "Ann likes tea."), Fact("f2", "Ann has a cat.")])
    counted = s.usage("ann")
    added_at = [e["ts"] for e in s.history("ann", "f1")][0]
    s.close()
    db = sqlite3.connect(tmp_path / "old" / "catalog.sqlite", isolation_level=None)  # back to schema 2's facts
    db.executescript("""
        DROP TABLE fact_meta; DROP INDEX facts_expiry; DROP INDEX facts_created; DROP INDEX facts_updated;
        CREATE TABLE facts2 (id INTEGER PRIMARY KEY AUTOINCREMENT,
            user_id TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE, fact_id TEXT NOT NULL,
            text TEXT NOT NULL, source_turn TEXT, date TEXT, kv_key TEXT NOT NULL, embedding BLOB NOT NULL,
            version INTEGER NOT NULL, UNIQUE (user_id, fact_id));
        INSERT INTO facts2 SELECT id, user_id, fact_id, text, source_turn, date, kv_key, embedding, version FROM facts;
        DROP TABLE facts; ALTER TABLE facts2 RENAME TO facts;
        UPDATE meta SET value='2' WHERE key='schema_version';""")
    db.close()
    s = service(tmp_path / "old", {})
    f1 = s.get("ann", "f1")
    assert f1.metadata == {} and f1.expires_at is None and f1.created_at == f1.updated_at == added_at
    assert s.usage("ann") == counted  # the KV bytes of facts written before they were counted: read once
    s.update("ann", "f2", metadata={"pet": "cat"})
    assert [f.fact_id for f in s.list("ann", filters={"pet": "cat"})] == ["f2"]
    s.close()
