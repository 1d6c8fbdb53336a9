"""The memory API over HTTP: metadata and filters (search, list, chat), expiry, quotas per tenant
(413 / 429 naming the limit, the others unaffected, usage in GET /v1/memories and /metrics),
export and import, and pages."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

KEY_A, KEY_B, KEY_Q = "key-api-tenant-a-1", "key-api-tenant-b-2", "key-api-tenant-q-3"
A, B, Q = ({"Authorization": f"Bearer {k}"} for k in (KEY_A, KEY_B, KEY_Q))
FACTS = [{"id": "w1", "text": "Zoe leads the payments team.", "metadata": {"category": "work", "priority": 3}},
         {"id": "w2", "text": "Zoe's manager is Priya.", "metadata": {"category": "work", "tags": ["people"]}},
         {"id": "h1", "text": "Zoe lives in Porto with her cat.", "metadata": {"category": "home"}},
         {"id": "h2", "text": "Zoe's cat is called Miso.", "metadata": {"category": "home", "tags": ["pet"]}},
         {"id": "t1", "text": "Zoe is in Berlin this week.", "expires_at": "2000-01-01T00:00:00Z"}]


@pytest.fixture(scope="module")
def api(live):
    url, app = live.start(api_keys={KEY_A: "api-a", KEY_B: "api-b", KEY_Q: "api-q"},
                          quotas={"api-q": {"max_facts": 3, "max_in_flight": 1}, "api-b": {"max_kv_bytes": 1}})
    r = httpx.post(f"{url}/v1/memories/zoe", json={"facts": FACTS}, headers=A, timeout=60)
    assert r.status_code == 200, r.text
    return url, app


def error_of(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_facts_carry_metadata_and_filters_choose_among_them(api):
    url, _ = api
    base = f"{url}/v1/memories/zoe"
    got = httpx.get(f"{base}/facts/w2", headers=A).json()
    assert got["metadata"] == {"category": "work", "tags": ["people"]} and got["created_at"].endswith("Z")
    hits = httpx.post(f"{base}/search", json={"query": "Zoe cat", "k": 10, "filters": {"category": "work"}},
                      headers=A).json()["data"]
    assert {h["id"] for h in hits} == {"w1", "w2"}  # k larger than the matches: all of them, none outside
    listed = httpx.get(base, params={"filters": '{"or": [{"tags": "pet"}, {"priority": {"gte": 3}}]}'},
                       headers=A).json()["data"]
    assert [f["id"] for f in listed] == ["w1", "h2"]
    error_of(httpx.post(f"{base}/search", json={"query": "x", "filters": {"category": {"like": "w%"}}}, headers=A),
             400)
    error_of(httpx.get(base, params={"filters": "{not json"}, headers=A), 400, "filters")
    r = httpx.post(f"{url}/v1/chat/completions", headers=A, timeout=60, json={
        "messages": [{"role": "user", "content": "Where does Zoe live?"}], "user": "zoe", "max_tokens": 4,
        "memory": {"k": 10, "mode": "inject", "filters": {"category": "home"}}})
    assert r.status_code == 200, r.text
    assert {f["id"] for f in r.json()["inferscale"]["facts"]} == {"h1", "h2"}
    upd = httpx.patch(f"{base}/facts/h1", json={"metadata": {"category": "work"}}, headers=A).json()
    assert upd["metadata"] == {"category": "work"} and upd["text"] == "Zoe lives in Porto with her cat."


def test_an_expired_fact_is_never_read_and_the_sweep_forgets_it(api, live):
    url, app = api
    base = f"{url}/v1/memories/zoe"
    ids = {f["id"] for f in httpx.get(base, headers=A).json()["data"]}
    assert "t1" not in ids and len(ids) == 4
    error_of(httpx.get(f"{base}/facts/t1", headers=A), 404)
    r = httpx.post(f"{url}/v1/chat/completions", headers=A, timeout=60, json={
        "messages": [{"role": "user", "content": "Where is Zoe this week?"}], "user": "zoe", "max_tokens": 4,
        "memory": {"k": 10, "mode": "inject"}})
    assert "t1" not in {f["id"] for f in r.json()["inferscale"]["facts"]}
    soon = time.time() + 1.0
    httpx.post(base, json={"facts": [{"id": "t2", "text": "Zoe is at a conference.", "expires_at": soon}]},
               headers=A).raise_for_status()
    assert httpx.get(f"{base}/facts/t2", headers=A).status_code == 200
    time.sleep(max(0.0, soon - time.time()) + 0.05)
    error_of(httpx.get(f"{base}/facts/t2", headers=A), 404)  # at once, before any sweep
    gw = app.state.inferscale.gateway
    swept = live.run(gw.write(gw.memory.sweep_expired))
    assert swept == {"api-a:zoe": ["t2"]}  # t1 went earlier: a write to a user forgets its expired facts first
    for fid in ("t1", "t2"):
        events = httpx.get(f"{base}/facts/{fid}/history", headers=A).json()["data"]
        assert [e["event"] for e in events] == ["ADD", "DELETE"] and events[0]["new_text"] is None


def test_quotas_refuse_with_the_limit_named_and_other_tenants_are_unaffected(api, live):
    url, _ = api
    base = f"{url}/v1/memories/quinn"
    ok = httpx.post(base, json={"facts": [{"text": f"Quinn fact {i}."} for i in range(3)]}, headers=Q)
    assert ok.status_code == 200, ok.text
    err = error_of(httpx.post(f"{url}/v1/memories/rae", json={"facts": [{"text": "Rae likes tea."}]}, headers=Q),
                   413, "max_facts")
    assert "max_facts is 3" in err["message"] and err["code"] == "quota_exceeded"
    err = error_of(httpx.post(f"{url}/v1/memories/bo", json={"facts": [{"text": "Bo likes tea."}]}, headers=B),
                   413, "max_kv_bytes")
    assert httpx.get(f"{url}/v1/memories", headers=B).json()["usage"]["facts"] == 0  # nothing of it stayed
    assert httpx.post(f"{url}/v1/memories/many", json={"facts": [{"text": f"A fact {i}."} for i in range(6)]},
                      headers=A).status_code == 200  # no quota: unaffected
    usage = httpx.get(f"{url}/v1/memories", headers=Q).json()["usage"]
    assert usage["facts"] == 3 and usage["kv_bytes"] > 0 and usage["limits"] == {"max_facts": 3, "max_in_flight": 1}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'inferscale_tenant_facts{tenant="api-q"} 3.0' in metrics
    assert f'inferscale_tenant_kv_bytes{{tenant="api-q"}} {float(usage["kv_bytes"])}' in metrics

    async def two_at_once():  # api-q may have one request in flight: a streamed chat holds it to its end
        async with httpx.AsyncClient(timeout=60) as h:
            async with h.stream("POST", f"{url}/v1/chat/completions", headers=Q, json={
                    "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                    "stream": True, "memory": {"enabled": False}}) as streaming:
                first = await streaming.aiter_lines().__anext__()
                second = await h.get(f"{url}/v1/memories", headers=Q)
                other = await h.get(f"{url}/v1/memories", headers=A)
                return streaming.status_code, first, second, other

    status, first, second, other = asyncio.run(two_at_once())
    assert status == 200 and first.startswith("data:")
    error_of(second, 429, "max_in_flight")
    assert second.headers["retry-after"] == "1" and other.status_code == 200
    assert httpx.get(f"{url}/v1/memories", headers=Q).status_code == 200  # the stream ended: free again


def test_export_then_import_answers_the_same(api):
    url, _ = api
    doc = httpx.get(f"{url}/v1/memories/zoe/export", headers=A).json()
    assert doc["format"] == "inferscale.memory" and {f["id"] for f in doc["facts"]} == {"w1", "w2", "h1", "h2"}
    bad = {**doc, "facts": doc["facts"] + [{"id": "x", "text": "X.", "source_turn": "nope"}]}
    error_of(httpx.post(f"{url}/v1/memories/zoe2/import", json=bad, headers=A), 400)
    error_of(httpx.get(f"{url}/v1/memories/zoe2", headers=A), 404)  # nothing was written
    r = httpx.post(f"{url}/v1/memories/zoe2/import", json=doc, headers=A, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(r.json()["imported"]["facts"]) == ["h1", "h2", "w1", "w2"]
    for q in ("Where does Zoe live?", "Who is Zoe's manager?"):
        hits = [httpx.post(f"{url}/v1/memories/{u}/search", json={"query": q, "k": 4}, headers=A).json()["data"]
                for u in ("zoe", "zoe2")]
        assert [(h["id"], round(h["score"], 5)) for h in hits[0]] == [(h["id"], round(h["score"], 5)) for h in hits[1]]
    error_of(httpx.post(f"{url}/v1/memories/zoe2/import", json=doc, headers=A), 400)  # its ids exist now


def test_lists_are_pages(api):
    url, _ = api
    for i in range(5):
        httpx.post(f"{url}/v1/memories/pager{i}", json={"facts": [{"text": f"Pager fact {i}."}]},
                   headers=A).raise_for_status()
    users, cursor = [], None
    while True:
        page = httpx.get(f"{url}/v1/memories", params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                         headers=A).json()
        users += [u["user"] for u in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert users == sorted(users) and {f"pager{i}" for i in range(5)} <= set(users)
    page = httpx.get(f"{url}/v1/memories/zoe", params={"limit": 3}, headers=A).json()
    rest = httpx.get(f"{url}/v1/memories/zoe", params={"limit": 3, "cursor": page["next_cursor"]}, headers=A).json()
    assert len(page["data"]) == 3 and len(rest["data"]) == 1 and rest["next_cursor"] is None
    error_of(httpx.get(f"{url}/v1/memories/zoe", params={"cursor": "garbage"}, headers=A), 400)
    error_of(httpx.get(f"{url}/v1/memories/zoe", params={"limit": 5000}, headers=A), 400)
