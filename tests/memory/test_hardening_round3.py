"""Defects found by attacking the memory API (issue 51), numbered as the issue numbers them, on
SQLite and on PostgreSQL + Redis where the catalog is involved: filters that reached database
limits (1-6), cursors past 64 bits (7-9), times that locked users out of their memory (10-15),
refused writes that wrote (16-18), an unbounded import (19), and 500s that named internals and
dropped the connection. The service is tested directly and through the HTTP app
(tests/memory_api.py: the real app over test doubles)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

from doubles import Clock, WindowEncoder
from inferscale.common.facts import Fact, Turn
from inferscale.common.bounds import MAX_FILTER_DEPTH, MAX_FILTER_NODES, MAX_IN_VALUES, TIME_MAX
from inferscale.common.pages import encode_cursor
from inferscale.common.storage.filters import matches, parse_filter
from inferscale.memory.quotas import Quota, QuotaExceeded
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig, UnknownUserError
from memory_api import MemoryAPI

T0 = 1_800_000_000.0
BIG = 300_000


@pytest.fixture
def svc(tmp_path, encoder, embedder, storage):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=2, index="faiss", ingest_batch=2, **storage),
                      encoder, embedder)
    s.clock = Clock(T0)
    yield s
    s.close()


@pytest.fixture
def api(tmp_path, storage):
    a = MemoryAPI(tmp_path, storage, max_add_items=8, quotas={})
    yield a
    a.close()


def facts_of_many(n: int = 12) -> list[Fact]:
    return [Fact(f"f{i}", f"fact {i} about {['tea', 'work', 'trip'][i % 3]}",
                 metadata={"category": ["work", "home", "trip"][i % 3], "n": i, "tags": [f"t{i % 4}"]})
            for i in range(n)]


def not_chain(n: int, inner: dict) -> dict:
    for _ in range(n):
        inner = {"not": inner}
    return inner


def deepest_filter(depth: int = MAX_FILTER_DEPTH) -> dict:
    """A spine of alternating and / or / not, `depth` deep, with a condition at every level."""
    spec: dict = {"category": {"in": ["work", "trip"]}}
    for level in range(depth):
        kind = ("and", "or", "not")[level % 3]
        cond = [{"n": {"gte": level % 5}}, {"tags": f"t{level % 4}"}, {"created_at": {"lte": T0 + 10}}][level % 3]
        spec = {"not": spec} if kind == "not" else {kind: [cond, spec]}
    return spec


def reference(svc, user: str, spec: dict) -> list[str]:
    node = parse_filter(spec)
    times = lambda f: {"created_at": f.created_at, "updated_at": f.updated_at, "expires_at": f.expires_at}  # noqa: E731
    return [f.fact_id for f in svc.list(user) if matches(node, f.metadata, times(f))]


# -- 1-6: filters are bounded where parsed and never reach a database limit ------------------------
def test_1_a_chain_of_not_deeper_than_the_limit_is_refused_by_name(svc):
    svc.add("u", facts=facts_of_many())
    for run in (lambda f: svc.search("u", "tea", k=3, filters=f), lambda f: svc.list("u", filters=f)):
        with pytest.raises(ValueError, match=f"nests at most {MAX_FILTER_DEPTH}"):
            run(not_chain(100, {"category": "work"}))


@pytest.mark.parametrize("plan", ["few", "broad"])
def test_1_the_deepest_and_largest_filters_allowed_run_on_the_catalog(svc, plan, monkeypatch):
    if plan == "broad":  # the over-fetch path: the filter as a per-row lookup
        monkeypatch.setattr(svc.reads, "FEW", 0)
        monkeypatch.setattr(svc.reads, "OVERFETCH", 2)
    svc.add("u", facts=facts_of_many())
    every = [f"v{i}" for i in range(MAX_IN_VALUES - 1)]
    widest = {"or": [{"category": {"in": ["work"] + every}}, {"tags": {"nin": ["t1"] + every}},
                     {"category": {"nin": ["home"] + every}}, {"tags": {"in": ["t3"] + every}}]
              + [{"n": i} for i in range(MAX_FILTER_NODES - 9)]}  # every node the limit allows
    chains = [not_chain(MAX_FILTER_DEPTH, {"category": "work"}), not_chain(MAX_FILTER_DEPTH - 1, {"category": "work"})]
    for spec in [deepest_filter(), widest, *chains]:
        want = reference(svc, "u", spec)
        assert [f.fact_id for f in svc.list("u", filters=spec)] == want
        got = svc.search("u", "fact about tea work trip", k=20, filters=spec)
        assert sorted(h.fact_id for h in got) == sorted(want)


def test_1_nested_logic_is_flattened():
    assert parse_filter(not_chain(2, {"a": 1})) == parse_filter({"a": 1})
    nested = parse_filter({"and": [{"a": 1}, {"and": [{"b": 2}, {"and": [{"c": 3}]}]}]})
    assert len(nested.parts) == 3 and not any(hasattr(p, "parts") for p in nested.parts)


@pytest.mark.parametrize("op", ["in", "nin"])
def test_4_5_a_list_longer_than_the_limit_is_refused(svc, op):
    svc.add("u", facts=facts_of_many(3))
    spec = {"category": {op: [f"v{i}" for i in range(BIG)]}}
    with pytest.raises(ValueError, match=f"{BIG} values; the limit is {MAX_IN_VALUES}"):
        svc.search("u", "tea", k=3, filters=spec)
    with pytest.raises(ValueError, match="at most 1024 values"):
        parse_filter({"or": [{f"k{i}": {op: ["x"] * MAX_IN_VALUES}} for i in range(5)]})


def test_2_3_4_5_over_http_deep_or_long_filters_are_400s(api):
    c = api.client
    assert c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}]}).status_code == 200
    for text in ("[" * 1500, '{"not":' * 1100 + '{"a": 1}' + "}" * 1100, json.dumps(not_chain(100, {"a": 1}))):
        r = c.get("/v1/memories/u", params={"filters": text})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filters", r.text
    for op in ("in", "nin"):
        r = c.post("/v1/memories/u/search", json={"query": "tea", "filters": {"category": {op: list(range(BIG))}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filters", r.text
    deep = '{"not":' * 1100 + '{"a": 1}' + "}" * 1100
    r = c.post("/v1/memories/u/search", content='{"query": "tea", "filters": ' + deep + "}",
               headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert c.get("/v1/memories/u").status_code == 200  # the user's memory answers as before


def test_6_chat_filters_with_a_long_list_are_a_400(api):
    r = api.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Where does Tom live?"}], "user": "u",
        "memory": {"filters": {"category": {"in": list(range(BIG))}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "memory.filters", r.text
    assert "the limit is 256" in r.json()["error"]["message"]


# -- 7-9: cursors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("position", [2**70, -(2**70), -1, 2**63])
def test_7_8_9_a_cursor_past_64_bits_is_refused(svc, position):
    svc.add("u", facts=facts_of_many(3))
    with pytest.raises(ValueError, match="not a cursor of this list"):
        svc.list_page("u", limit=1, cursor=encode_cursor("facts", position))
    with pytest.raises(ValueError, match="not a cursor of this list"):
        svc.history_page("u", "f0", limit=1, cursor=encode_cursor("history", position))
    with pytest.raises(ValueError, match="not a cursor of this list"):
        svc.users_page("", limit=1, cursor=encode_cursor("users", "a\x00b"))
    assert len(svc.list_page("u", limit=1, cursor=encode_cursor("facts", 2**63 - 1)).items) == 0


def test_7_8_9_over_http_cursors_are_400s(api):
    c = api.client
    c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}]}).raise_for_status()
    for position in (2**70, -(2**70)):
        assert c.get("/v1/memories/u", params={"cursor": encode_cursor("facts", position)}).status_code == 400
        assert c.get("/v1/memories/u/facts/f/history",
                     params={"cursor": encode_cursor("history", position)}).status_code == 400
    assert c.get("/v1/memories", params={"cursor": encode_cursor("users", "\ud800")}).status_code == 400


# -- 10-15: times ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [True, False, 1e13, 2**53, -1, "10000-01-01T00:00:00Z", "1969-12-31T23:59:59Z"])
def test_10_11_12_a_time_outside_the_range_is_refused_on_add_and_writes_nothing(api, value):
    c = api.client
    r = c.post("/v1/memories/u", json={"facts": [{"id": "ok", "text": "Tom drinks tea."},
                                                 {"id": "bad", "text": "Tom is away.", "expires_at": value}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "facts.1.expires_at", r.text
    assert c.get("/v1/memories/u").status_code == 404
    with pytest.raises(ValueError):
        Fact("bad", "Tom is away.", expires_at=value)


def test_10_13_a_patch_with_a_bad_time_is_refused_and_changes_nothing(api):
    c = api.client
    c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea.", "expires_at": 2e9}]}) \
        .raise_for_status()
    before = c.get("/v1/memories/u/export").json()
    for value in (True, 1e13, 2**53):
        r = c.patch("/v1/memories/u/facts/f", json={"expires_at": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_at", r.text
    after = c.get("/v1/memories/u/export").json()
    assert {**after, "exported_at": None} == {**before, "exported_at": None}
    assert c.get("/v1/memories/u").status_code == 200


def plant_bad_times(memory, user: str, fact_id: str) -> None:
    """Times an older version let through, written straight into the catalog."""
    cat = memory.catalog
    with cat.transaction() as db:
        cat.execute(db, "UPDATE facts SET expires_at=?, created_at=?, updated_at=? WHERE user_id=? AND fact_id=?",
                    (1e13, -5e12, float(2**53), user, fact_id))
        cat.execute(db, "UPDATE history SET ts=?, fields=? WHERE user_id=? AND fact_id=?",
                    (1e13, json.dumps({"expires_at": 1e13}), user, fact_id))


def test_11_14_stored_bad_times_never_break_a_read(svc):
    svc.add("u", facts=facts_of_many(3))
    plant_bad_times(svc, "u", "f1")
    listed = {f.fact_id: f for f in svc.list("u")}
    assert listed["f1"].expires_at == TIME_MAX and listed["f1"].created_at == 0.0
    assert {h.fact_id for h in svc.search("u", "fact", k=5)} == {"f0", "f1", "f2"}
    doc = svc.export_memory("u")
    f1 = next(f for f in doc["facts"] if f["id"] == "f1")
    assert f1["expires_at"] == "9999-12-31T23:59:59Z" and f1["created_at"] == "1970-01-01T00:00:00Z"
    assert f1["history"][0]["at"] == "9999-12-31T23:59:59Z"
    assert svc.history("u", "f1")[0]["expires_at"] == TIME_MAX
    svc.update("u", "f1", expires_at=T0 + 100)  # a write over it works too
    svc.update("u", "f1", "fact 1 about work, again")
    assert svc.get("u", "f1").expires_at == T0 + 100


def test_11_14_15_over_http_stored_bad_times_never_break_a_read(api):
    c = api.client
    c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."},
                                             {"id": "g", "text": "Tom rides a bike."}]}).raise_for_status()
    uid = api.memory.users()[0]
    plant_bad_times(api.memory, uid, "f")
    for r in (c.get("/v1/memories/u"), c.post("/v1/memories/u/search", json={"query": "tea"}),
              c.get("/v1/memories/u/export"), c.get("/v1/memories/u/facts/f/history"), c.get("/v1/memories/u/facts/f")):
        assert r.status_code == 200, r.text
    assert c.get("/v1/memories/u/facts/f").json()["expires_at"] == "9999-12-31T23:59:59Z"
    c.patch("/v1/memories/u/facts/f", json={"expires_at": "2030-01-01T00:00:00Z"}).raise_for_status()
    assert c.get("/v1/memories/u/export").status_code == 200
    assert c.get("/v1/memories/u/facts/f/history").status_code == 200
    # an exported document whose times are clamped imports again
    doc = c.get("/v1/memories/u/export").json()
    assert c.post("/v1/memories/copy/import", json=doc).status_code == 200, doc


@pytest.mark.parametrize("where", ["created_at", "updated_at", "expires_at", "history.0.at",
                                   "history.0.expires_at"])
@pytest.mark.parametrize("value", [1e13, True, -1])
def test_15_an_import_with_a_time_outside_the_range_is_refused(api, where, value):
    fact = {"id": "f", "text": "Tom drinks tea.", "history": [{"event": "ADD", "new_text": "Tom drinks tea."}]}
    if where.startswith("history"):
        fact["history"][0][where.split(".")[-1]] = value
    else:
        fact[where] = value
    doc = {"format": "inferscale.memory", "version": 1, "turns": [], "facts": [fact]}
    r = api.client.post("/v1/memories/u/import", json=doc)
    assert r.status_code == 400 and f"facts.0.{where}" in r.json()["error"]["message"], r.text
    assert api.client.get("/v1/memories/u").status_code == 404


def test_filter_time_bounds_are_checked_against_the_range(svc):
    svc.add("u", facts=facts_of_many(2))
    for bound in (1e13, True, "0001-01-01T00:00:00Z"):
        with pytest.raises(ValueError, match="created_at"):
            svc.list("u", filters={"created_at": {"gt": bound}})
    assert len(svc.list("u", filters={"created_at": {"gt": 0}})) == 2


# -- 16-18: a refused write writes nothing -----------------------------------------------------------
def document(n_facts: int = 5) -> dict:
    return {"format": "inferscale.memory", "version": 1,
            "turns": [{"id": "t0", "speaker": "Tom", "text": "I moved to Leeds."},
                      {"id": "t1", "speaker": "Tom", "text": None},
                      {"id": "t2", "speaker": "Ann", "text": "Nice!"}],
            "facts": [{"id": f"i{i}", "text": f"Imported fact {i}.", "source_turn": "t2",
                       "history": [{"event": "ADD", "new_text": f"Imported fact {i}.", "at": T0 - 10}]}
                      for i in range(n_facts)]}


@pytest.mark.parametrize("existing", [False, True])
def test_16_an_import_refused_by_the_kv_bytes_quota_writes_nothing(svc, existing):
    if existing:
        svc.add("u", facts=[Fact("mine", "Tom drinks tea.")], turns=[Turn("a", "Tom", "hi")])
        before = svc.export_memory("u")
    with pytest.raises(QuotaExceeded, match="max_kv_bytes"):
        svc.import_memory("u", document(), quota=Quota("", max_kv_bytes=2000))  # a batch fits, not all
    if existing:
        assert svc.export_memory("u") == before
    else:
        with pytest.raises(UnknownUserError):
            svc.list("u")
    assert svc.usage("") == ((1, svc.usage("")[1]) if existing else (0, 0))


class FailOnCall(WindowEncoder):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def encode_windowed(self, facts, windows, w):
        if len(self.calls) + 1 == self.n:
            raise RuntimeError("encoder failed")
        return super().encode_windowed(facts, windows, w)


def test_16_an_import_that_fails_in_a_later_batch_writes_nothing_and_keeps_no_kv(tmp_path, embedder, storage):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=2, ingest_batch=2, **storage), FailOnCall(3),
                      embedder)
    with pytest.raises(RuntimeError, match="encoder failed"):
        s.import_memory("u", document())
    with pytest.raises(UnknownUserError):
        s.list("u")
    assert s.store("u", reader=True).fact_ids() == [] if s.kv.shared else not list(s.root.glob("users/*/*.kv*"))


def test_16_an_import_keeps_deleted_turns_out_of_the_windows(svc):
    out = svc.import_memory("u", document(2))
    assert out.facts == ["i0", "i1"]
    turns = svc.catalog.turns("u", include_deleted=True)
    assert [(t.turn_id, t.text) for t in turns] == [("t0", "I moved to Leeds."), ("t1", None), ("t2", "Nice!")]
    from doubles import encoded_after

    assert encoded_after(svc, "u") == {"i0": ["t0"], "i1": ["t0"]}  # t1's place is kept, without text
    assert [e["event"] for e in svc.history("u", "i0")] == ["ADD", "IMPORT"]


def test_16_over_http_an_import_over_the_quota_is_413_and_leaves_no_user(tmp_path, storage):
    api = MemoryAPI(tmp_path, storage, quotas={"default": {"max_kv_bytes": 200}})
    try:
        r = api.client.post("/v1/memories/u/import", json=document())
        assert r.status_code == 413 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert api.client.get("/v1/memories/u").status_code == 404
        assert api.client.get("/v1/memories/u/export").status_code == 404
    finally:
        api.close()


def test_16_over_http_an_add_over_the_quota_in_a_later_batch_writes_nothing(tmp_path, storage):
    api = MemoryAPI(tmp_path, {**storage, "ingest_batch": 2}, quotas={"default": {"max_kv_bytes": 1200}})
    try:
        c = api.client
        body = {"facts": [{"id": f"f{i}", "text": f"Added fact {i}."} for i in range(5)]}
        r = c.post("/v1/memories/u", json=body)  # the first batch of two fits, the whole add does not
        assert r.status_code == 413 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert c.get("/v1/memories/u").status_code == 404
        assert c.post("/v1/memories/u", json={"facts": body["facts"][:1]}).status_code == 200
    finally:
        api.close()


@pytest.mark.parametrize("messages, why", [
    ([{"id": "bad id!", "role": "user", "content": "I moved to Leeds."}], "invalid turn id"),
    ([{"role": "system", "content": "You are helpful."}], "holds no user"),
])
def test_17_18_an_add_whose_messages_are_refused_writes_no_fact(api, messages, why):
    c = api.client
    r = c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}], "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert why in r.json()["error"]["message"]
    assert c.get("/v1/memories/u").status_code == 404
    c.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}]}).raise_for_status()
    before = c.get("/v1/memories/u/export").json()
    assert c.post("/v1/memories/u", json={"facts": [{"id": "g", "text": "Tom rides."}],
                                          "messages": messages}).status_code == 400
    assert [f["id"] for f in c.get("/v1/memories/u/export").json()["facts"]] == [f["id"] for f in before["facts"]]


# -- 19: import follows add's limits ----------------------------------------------------------------
def test_19_an_import_holds_at_most_max_add_items(api):
    c = api.client
    r = c.post("/v1/memories/u/import", json=document(6))  # 3 turns + 6 facts > 8
    assert r.status_code == 413 and "max_add_items" in r.json()["error"]["message"], r.text
    assert c.get("/v1/memories/u").status_code == 404
    assert c.post("/v1/memories/u/import", json=document(5)).status_code == 200


def test_19_an_import_holds_texts_within_max_text_chars(tmp_path):
    api = MemoryAPI(tmp_path, max_text_chars=40)
    try:
        doc = document(1)
        doc["facts"][0]["history"][0]["old_text"] = "x" * 41
        r = api.client.post("/v1/memories/u/import", json=doc)
        assert r.status_code == 400 and r.json()["error"]["param"] == "facts.0.history.0.old_text", r.text
    finally:
        api.close()


# -- errors: a 500 names no internals and keeps the connection ---------------------------------------------
def test_a_500_names_no_internals_and_carries_a_request_id(api, monkeypatch, caplog):
    def boom(*a, **k):
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    monkeypatch.setattr(api.memory, "list_page", boom)
    with caplog.at_level(logging.ERROR, logger="inferscale.server"):
        r = api.client.get("/v1/memories/u")
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "internal_error"
    assert "Overflow" not in r.text and "SQLite" not in r.text
    rid = r.headers["x-request-id"]
    assert rid in err["message"] and rid in caplog.text and "OverflowError" in caplog.text


def break_history_times(monkeypatch) -> None:
    """An error outside the memory service's calls: the gateway writes a history's times."""
    from inferscale.server import gateway

    def iso(epoch):
        raise OverflowError("timestamp out of range for platform time_t")

    monkeypatch.setattr(gateway, "iso", iso)


def test_an_error_outside_the_memory_service_is_a_json_500_too(api, monkeypatch):
    api.client.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}]}).raise_for_status()
    break_history_times(monkeypatch)
    r = api.client.get("/v1/memories/u/facts/f/history")  # TestClient raises if an exception left the app
    assert r.status_code == 500 and "Overflow" not in r.text and r.headers["x-request-id"] in r.text


def test_after_an_error_the_connection_is_served_again(tmp_path, monkeypatch):
    import uvicorn

    api = MemoryAPI(tmp_path)
    api.client.post("/v1/memories/u", json={"facts": [{"id": "f", "text": "Tom drinks tea."}]}).raise_for_status()
    break_history_times(monkeypatch)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(api.app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started:
            assert time.time() < deadline
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            statuses = []
            for path in ("/v1/memories/u/facts/f/history", "/v1/memories/u?filters=%5B%5B",
                         "/v1/memories/nobody", "/v1/memories"):
                try:
                    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                    statuses.append(read_response(s))
                except OSError:
                    statuses.append("closed")
        assert statuses == [500, 400, 404, 200]  # one connection throughout
    finally:
        server.should_exit = True
        thread.join(10)
        api.close()


def read_response(s: socket.socket) -> int | str:
    """The status of the next response on `s`, or "closed" when the server closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return "closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            return "closed"
        body += chunk
    assert b"connection: close" not in head.lower()
    return int(head.split()[1])
