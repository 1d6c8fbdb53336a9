"""Property-based tests of the memory API (hypothesis) over generated request bodies and
parameters: filters, metadata, times, cursors, import documents and message lists, against the
real HTTP app over test doubles (tests/memory_api.py), SQLite catalog. Three invariants:

* no request is ever answered with a 500;
* a refused request (4xx) changes nothing: the user's export is byte-identical before and after
  (the service's clock is frozen, so the export's own time does not move);
* after an accepted write, the user's list, search, export and every fact's history answer 200.
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doubles import Clock
from inferscale.common.pages import encode_cursor
from memory_api import MemoryAPI

T0 = 1_800_000_000.0
SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
USERS = st.sampled_from(["ann", "bob", "bad user", "x" * 129])


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    a = MemoryAPI(tmp_path_factory.mktemp("props"), max_add_items=20, max_text_chars=200,
                  quotas={"default": {"max_facts": 60}})
    a.memory.clock = Clock(T0)
    c = a.client
    for user in ("ann", "bob"):  # memories to patch, page through and import into
        c.post(f"/v1/memories/{user}", json={
            "turns": [{"id": f"{user}-t{i}", "text": f"turn {i}"} for i in range(3)],
            "facts": [{"id": f"{user}-f{i}", "text": f"{user} fact {i}", "source_turn": f"{user}-t{i}",
                       "metadata": {"category": "work" if i % 2 else "home", "n": i, "tags": ["a"]}}
                      for i in range(3)]}).raise_for_status()
    yield a
    a.close()


# -- strategies: mostly well-formed requests, with one wild part now and then ---------------------------
def mostly(good, bad):
    """`good` three times in four, `bad` otherwise."""
    return st.one_of(good, good, good, bad)


WORDS = st.text(string.ascii_letters + " ", min_size=1, max_size=20).filter(str.strip)
good_ids = st.text(string.ascii_letters + string.digits + "_.:-", min_size=1, max_size=10).filter(
    lambda i: i[0].isalnum())
ids = mostly(good_ids, st.sampled_from(["", "bad id", "x\n", "\ud800", "a" * 129, "ann-f0", "ann-t0", "bob-f1"]))
texts = mostly(WORDS, st.one_of(st.text(max_size=30), st.sampled_from(["", "   ", "\ud800", "x" * 201, "\x00"])))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=12))
good_times = st.one_of(st.floats(min_value=T0 - 1e6, max_value=T0 + 1e9),
                       st.sampled_from(["2026-12-06T12:00:00Z", "9999-12-31T23:59:59Z", "2030-01-01T00:00:00"]))
times = mostly(good_times, st.one_of(
    st.booleans(), st.integers(-2**64, 2**64), st.floats(min_value=-1e20, max_value=1e20, allow_nan=False),
    st.sampled_from([1e13, 2**53, -1, "10000-01-01", "0001-01-01", "not a time", "2030-02-30"])))
good_metadata = st.dictionaries(st.sampled_from(["category", "n", "tags", "done"]),
                                st.one_of(WORDS, st.integers(-100, 100), st.booleans(),
                                          st.lists(WORDS, max_size=3)), max_size=3)
metadata = mostly(st.one_of(st.none(), good_metadata), st.dictionaries(
    st.one_of(st.sampled_from(["category", "n", "tags", "and", "created_at"]), st.text(max_size=8)),
    st.one_of(scalars, st.lists(st.text(max_size=6), max_size=70), st.lists(scalars, max_size=3),
              st.dictionaries(st.text(max_size=3), scalars, max_size=2)), max_size=6))
FIELDS = st.sampled_from(["category", "tags", "n", "missing", "created_at", "updated_at", "expires_at", "bad key!",
                          "not", "in"])
OPS = st.sampled_from(["eq", "ne", "in", "nin", "gt", "gte", "lt", "lte", "like", "NOT"])
values = st.one_of(scalars, times, st.lists(st.one_of(scalars, times), max_size=5),
                   st.integers(0, 300).map(lambda n: list(range(n))), st.just([]), st.just({}))
conditions = st.one_of(st.builds(lambda f, v: {f: v}, FIELDS, values),
                       st.builds(lambda f, ops: {f: ops}, FIELDS, st.dictionaries(OPS, values, max_size=3)))
filters = st.one_of(st.none(), st.just({}), st.recursive(
    conditions, lambda inner: st.one_of(
        st.builds(lambda k, parts: {k: parts}, st.sampled_from(["and", "or", "AND", "Or"]),
                  st.lists(inner, max_size=4)),
        st.builds(lambda part: {"not": part}, inner),
        st.builds(lambda n, part: _nots(n, part), st.integers(0, 40), inner)), max_leaves=30),
    st.integers(1, 30).map(lambda n: _nots(n * 10, {"n": 1})), scalars, st.lists(scalars, max_size=2))
cursors = st.one_of(st.none(), st.text(max_size=20), st.builds(
    encode_cursor, st.sampled_from(["facts", "history", "users", "other"]),
    st.one_of(st.integers(-2**70, 2**70), st.text(max_size=6), st.just(True))))
facts = st.fixed_dictionaries({"text": texts}, optional={
    "id": ids, "metadata": metadata, "expires_at": times, "date": texts})
messages = st.lists(st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "assistant"]), st.sampled_from(["system", "developer", "tool", "robot"])),
     "content": texts}, optional={"id": ids, "date": texts, "name": texts}), max_size=3)
events = st.fixed_dictionaries({"event": mostly(st.sampled_from(["ADD", "UPDATE", "IMPORT"]), st.just("BOOM"))},
                               optional={"old_text": st.one_of(st.none(), texts), "new_text": st.one_of(st.none(), texts),
                                         "at": times, "expires_at": times, "metadata": metadata})
import_facts = st.fixed_dictionaries({"id": ids, "text": texts}, optional={
    "metadata": metadata, "expires_at": times, "created_at": times, "updated_at": times,
    "history": st.lists(events, max_size=3)})
import_turns = st.fixed_dictionaries({"id": ids, "text": st.one_of(st.none(), texts)},
                                     optional={"speaker": texts, "session": mostly(st.integers(0, 5),
                                                                                  st.integers(-1, 2**40))})
documents = st.fixed_dictionaries({
    "format": mostly(st.just("inferscale.memory"), st.just("other")), "version": mostly(st.just(1), st.just(True)),
    "turns": st.lists(import_turns, max_size=4), "facts": st.lists(import_facts, max_size=4)})


def _nots(n: int, part: dict) -> dict:
    for _ in range(n):
        part = {"not": part}
    return part


# -- the invariants --------------------------------------------------------------------------------
def send(c, method: str, url: str, body, **kw):
    """A JSON request as a client may spell it: `\\ud800` escapes included (ASCII JSON)."""
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return c.request(method, url, content=json.dumps(body), headers=headers, **kw)


def export_of(c, user: str) -> tuple[int, bytes]:
    r = c.get(f"/v1/memories/{user}/export")
    assert r.status_code < 500, r.text
    return r.status_code, r.content


def reads_answer(c, user: str) -> None:
    assert c.get(f"/v1/memories/{user}").status_code == 200
    assert c.post(f"/v1/memories/{user}/search", json={"query": "fact"}).status_code == 200
    r = c.get(f"/v1/memories/{user}/export")
    assert r.status_code == 200, r.text
    for f in r.json()["facts"]:
        assert c.get(f"/v1/memories/{user}/facts/{f['id']}/history").status_code == 200


def write(c, user: str, send) -> None:
    before = export_of(c, user)
    r = send()
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert export_of(c, user) == before, r.text  # a refused write changed nothing
    else:
        reads_answer(c, user)


def read(r) -> None:
    assert r.status_code < 500, r.text


# -- the properties --------------------------------------------------------------------------------
@SETTINGS
@given(user=USERS, body=st.fixed_dictionaries({}, optional={
    "facts": st.lists(facts, max_size=4), "messages": messages,
    "turns": st.lists(st.fixed_dictionaries({"id": ids, "text": texts}), max_size=2)}))
def test_adds(api, user, body):
    write(api.client, user, lambda: send(api.client, "POST", f"/v1/memories/{user}", body))


@SETTINGS
@given(user=USERS, fact=st.sampled_from(["f0", "f1", "f2", "gone", "bad id"]),
       body=st.fixed_dictionaries({}, optional={"text": st.one_of(st.none(), texts), "metadata": metadata,
                                                "expires_at": times}))
def test_patches(api, user, fact, body):
    write(api.client, user, lambda: send(api.client, "PATCH", f"/v1/memories/{user}/facts/{user}-{fact}", body))


@SETTINGS
@given(user=USERS, doc=documents)
def test_imports(api, user, doc):
    write(api.client, user, lambda: send(api.client, "POST", f"/v1/memories/{user}/import", doc))


@SETTINGS
@given(user=USERS, spec=filters, k=st.integers(-1, 1200), query=texts)
def test_searches_and_lists_with_filters(api, user, spec, k, query):
    c = api.client
    read(send(c, "POST", f"/v1/memories/{user}/search", {"query": query, "k": k, "filters": spec}))
    read(c.get(f"/v1/memories/{user}", params={"filters": json.dumps(spec)}))


@SETTINGS
@given(user=USERS, cursor=cursors, limit=st.integers(-1, 1001))
def test_pages_with_any_cursor(api, user, cursor, limit):
    c = api.client
    params = {"limit": limit} if cursor is None else {"limit": limit, "cursor": cursor}
    read(c.get(f"/v1/memories/{user}", params=params))
    read(c.get("/v1/memories", params=params))
    read(c.get(f"/v1/memories/{user}/facts/{user}-f0/history", params=params))


@SETTINGS
@given(spec=filters)
def test_chat_filters_are_never_a_500(api, spec):
    from inferscale.server.chat_options import USER_HEADER

    r = send(api.client, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "user": "ann", "memory": {"filters": spec}},
        headers={USER_HEADER: "bob"})
    assert r.status_code == 400, r.text  # the filter, or else the two users, refused: no engine is needed
    assert r.json()["error"]["param"] in ("memory.filters", "user")
