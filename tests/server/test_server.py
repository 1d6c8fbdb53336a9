"""The server end to end on loopback (tiny random Llama, vLLM AsyncLLM, InferScale's connector):
chat with memory (injected facts reported), streaming, the openai client, memory CRUD while
serving, tenant isolation, OpenAI-style 400/401/404s, overload (429), timeout (504), client
disconnects (aborted in vLLM), and no connector state, engine requests or KV blocks left behind."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from inferscale.evaluation.datasets import load_demo
from inferscale.server.vllm_engine import probe_engine

openai = pytest.importorskip("openai")

KEY_A, KEY_B = "key-tenant-a-0001", "key-tenant-b-0002"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
Q = "Where does Tom live now?"


@pytest.fixture(scope="module")
def main(live):
    url, app = live.start(api_keys={KEY_A: "team-a", KEY_B: "team-b"}, max_concurrent=4, max_queued=16,
                          request_timeout_s=60.0, engine_probe=True)
    conv = load_demo().conversation
    body = {"turns": [{"id": t.id, "speaker": t.speaker, "text": t.text, "session": t.session} for t in conv.turns],
            "facts": [{"id": f.id, "text": f.text, "source_turn": f.source_turn} for f in conv.facts[:12]]}
    r = httpx.post(f"{url}/v1/memories/maya", json=body, headers=A, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["added"]) == 12
    return url, app


def chat(url, headers=A, timeout=60, **body):
    body.setdefault("messages", [{"role": "user", "content": Q}])
    body.setdefault("max_tokens", 6)
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def client(url, key=KEY_A):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


# -- chat ------------------------------------------------------------------------------------------
def test_chat_reports_the_injected_facts(main, live):
    url, _ = main
    r = chat(url, user="maya", model=live.model_name, memory={"k": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == live.model_name
    assert isinstance(out["choices"][0]["message"]["content"], str)
    info = out["inferscale"]
    assert info["mode"] == "inject" and info["user"] == "maya" and len(info["facts"]) == 4
    assert all(f["id"] and f["text"] for f in info["facts"])
    assert 0 < info["injected_tokens"] < info["prompt_tokens"] == out["usage"]["prompt_tokens"]
    # vLLM did not compute the injected tokens (prefix cache hits may add to them)
    assert info["cached_tokens"] >= info["injected_tokens"]
    assert out["usage"]["completion_tokens"] >= 1
    assert info["timings"]["ttft_s"] >= info["timings"]["engine_ttft_s"] > 0

    text = chat(url, user="maya", memory={"k": 4, "mode": "text"}).json()["inferscale"]
    assert text["mode"] == "text" and text["injected_tokens"] == 0
    assert [f["id"] for f in text["facts"]] == [f["id"] for f in info["facts"]]
    # text is laid out history-first (chat_layout auto), injection memory-first: the same facts and
    # message, each layout with its own preamble
    assert text["prompt_tokens"] != info["prompt_tokens"] and text["cached_tokens"] < text["prompt_tokens"]

    plain = chat(url, user="maya", memory={"enabled": False}).json()["inferscale"]
    assert plain["mode"] == "none" and plain["facts"] == [] and plain["prompt_tokens"] < info["prompt_tokens"]
    nouser = chat(url).json()["inferscale"]
    assert nouser["mode"] == "none" and nouser["user"] is None

    m = httpx.get(f"{url}/metrics").text
    assert 'inferscale_ttft_seconds_count{mode="inject",phase="engine"}' in m
    assert 'inferscale_ttft_seconds_count{mode="inject",phase="search"}' in m
    injected = [ln for ln in m.splitlines() if ln.startswith('inferscale_prompt_tokens_total{kind="injected"}')]
    assert injected and float(injected[0].split()[-1]) >= info["injected_tokens"]
    assert "inferscale_tier_hit_rate" in m and "inferscale_engine_kv_cache_usage" in m

    def value(name):
        return float(next(ln for ln in m.splitlines() if ln.startswith(name)).split()[-1])

    # the connector's own counters, carried from the engine's worker by vLLM's connector stats
    assert value("inferscale_connector_injected_tokens_total") >= info["injected_tokens"] > 0
    assert value('inferscale_tier_hits_total{tier="host"}') + value('inferscale_tier_misses_total{tier="host"}') > 0
    assert value("inferscale_tier_store_reads_total") >= 1 and value('inferscale_tier_bytes{tier="host"}') > 0
    assert "inferscale_requests_in_flight" in m


def test_the_whole_chat_reaches_the_model_with_memory_injected(main, live):
    """The system prompt and the earlier turns are served after the injected memory (not dropped),
    text mode lays out the same messages, and a chat too long for the context loses its oldest
    turns (said in the answer), not the request."""
    url, _ = main
    msgs = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "My sister is Ana."},
            {"role": "assistant", "content": "Nice to know!"}, {"role": "user", "content": Q}]
    one = chat(url, user="maya", memory={"k": 3}, messages=msgs[-1:]).json()["inferscale"]
    full = chat(url, user="maya", memory={"k": 3}, messages=msgs).json()["inferscale"]
    assert full["mode"] == "inject" and full["injected_tokens"] == one["injected_tokens"] > 0
    assert [f["id"] for f in full["facts"]] == [f["id"] for f in one["facts"]]  # searched with the new message
    assert full["prompt_tokens"] > one["prompt_tokens"] and "dropped" not in full
    text = chat(url, user="maya", memory={"k": 3, "mode": "text"}, messages=msgs).json()["inferscale"]
    assert text["injected_tokens"] == 0 and [f["id"] for f in text["facts"]] == [f["id"] for f in full["facts"]]
    assert text["prompt_tokens"] > chat(url, user="maya", memory={"k": 3, "mode": "text"},
                                        messages=msgs[-1:]).json()["inferscale"]["prompt_tokens"]
    long = [{"role": "user", "content": "blah " * 400}, {"role": "assistant", "content": "ok"}] * 6 + msgs[-1:]
    r = chat(url, user="maya", memory={"k": 3}, messages=long)
    assert r.status_code == 200, r.text
    info = r.json()["inferscale"]
    assert info["dropped"]["turns"] > 0 and info["prompt_tokens"] < 2048 and info["injected_tokens"] > 0
    error_of(chat(url, user="maya", messages=[{"role": "user", "content": "blah " * 2100}]), 400)


def test_a_text_chat_finds_its_conversation_in_the_prefix_cache_turn_after_turn(main, live):
    """Served as text, a chat's system prompt and earlier turns come before the memory (chat_layout
    auto), so each turn finds more of its prompt in vLLM's prefix cache: the conversation the
    previous turn left there."""
    url, _ = main
    msgs = [{"role": "system", "content": "Answer in one short sentence, please. " * 6}]
    cached = []
    for q in (Q, "What is the cat called?", "When did Maya start her job?"):
        msgs.append({"role": "user", "content": q})
        r = chat(url, user="maya", memory={"k": 3, "mode": "text"}, messages=msgs)
        assert r.status_code == 200, r.text
        cached.append(r.json()["inferscale"]["cached_tokens"])
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[-1]
        msgs.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "Ok."})
    assert cached[2] > cached[1] >= 64, cached


def test_k_all_serves_the_whole_memory_in_the_order_it_was_added(main, live):
    url, _ = main
    order = [f.id for f in load_demo().conversation.facts[:12]]
    r = chat(url, user="maya", memory={"k": "all", "mode": "auto"})
    assert r.status_code == 200, r.text
    info = r.json()["inferscale"]  # auto serves the whole memory from the chain
    assert info["mode"] == "chain" and info["k"] == "all" and [f["id"] for f in info["facts"]] == order
    assert {f["source"] for f in info["facts"]} == {"chain"} and info["chain"]["facts"] == 12
    deadline = time.monotonic() + 120
    while info["chain"]["stored"] < 12:  # the links the first request lacked are encoded in the background
        assert time.monotonic() < deadline, info["chain"]
        time.sleep(0.2)
        info = chat(url, user="maya", memory={"mode": "chain"}).json()["inferscale"]
        assert info["k"] == "all"  # mode chain serves the whole memory whatever the default k
    text = chat(url, user="maya", memory={"k": "all", "mode": "text"}).json()
    chained = chat(url, user="maya", memory={"mode": "chain"}).json()
    assert chained["choices"][0]["message"]["content"] == text["choices"][0]["message"]["content"]
    assert chained["inferscale"]["injected_tokens"] > text["inferscale"]["injected_tokens"] == 0
    m = httpx.get(f"{url}/metrics").text
    hits = [ln for ln in m.splitlines() if ln.startswith("inferscale_chain_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 2 and "inferscale_chain_links_encoded_total" in m
    injected = chat(url, user="maya", memory={"k": "all", "mode": "inject"}).json()["inferscale"]
    assert [f["id"] for f in injected["facts"]] == order and injected["injected_tokens"] > 0
    for bad in ("every", -1, 2.5):
        error_of(chat(url, user="maya", memory={"k": bad}), 400)
    assert error_of(chat(url, user="maya", memory={"mode": "chain", "fact_ids": order[:2]}), 400)["param"] == \
        "memory.fact_ids"
    repeated = chat(url, user="maya", memory={"mode": "chain", "repeat": 2}).json()["inferscale"]
    as_text = chat(url, user="maya", memory={"k": "all", "mode": "text", "repeat": 2}).json()["inferscale"]
    assert len(repeated["repeated"]) == 2 and set(repeated["repeated"]) <= set(order)
    assert repeated["repeated"] == as_text["repeated"] and repeated["prompt_tokens"] == as_text["prompt_tokens"] > \
        chained["inferscale"]["prompt_tokens"]
    assert error_of(chat(url, user="maya", memory={"k": 3, "repeat": 2}), 400)["param"] == "memory.repeat"


def test_json_logprobs_and_several_choices_with_memory_injected(main, live):
    """response_format (vLLM's structured outputs), logprobs / top_logprobs and n > 1, in both
    modes and streaming, through the official openai client."""
    url, _ = main
    c = client(url)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lisbon", "Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    for mode in ("inject", "text"):
        kw = dict(model=live.model_name, user="maya", max_tokens=20, messages=[{"role": "user", "content": Q}],
                  extra_body={"memory": {"k": 3, "mode": mode}})
        r = c.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
            "name": "where", "schema": schema}}, **kw)
        assert json.loads(r.choices[0].message.content)["city"] in ("Lisbon", "Paris", "Oslo")
        info = r.model_extra["inferscale"]
        assert info["mode"] == mode and (info["injected_tokens"] > 0) == (mode == "inject")
        r = c.chat.completions.create(logprobs=True, top_logprobs=2, n=2, temperature=1.0, seed=3,
                                      **{**kw, "max_tokens": 4})
        assert [ch.index for ch in r.choices] == [0, 1]
        for ch in r.choices:
            entries = ch.logprobs.content
            assert 1 <= len(entries) <= 4 and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
        assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)
        chunks = list(c.chat.completions.create(logprobs=True, n=2, stream=True, **{**kw, "max_tokens": 4}))
        by_index: dict = {}
        for ch in chunks:
            for choice in ch.choices:
                by_index.setdefault(choice.index, []).extend(choice.logprobs.content if choice.logprobs else [])
        assert sorted(by_index) == [0, 1] and all(1 <= len(v) <= 4 for v in by_index.values())
        obj = c.chat.completions.create(response_format={"type": "json_object"}, **kw).choices[0]
        if obj.finish_reason == "stop":  # a tiny random model may run to max_tokens inside the object
            json.loads(obj.message.content)


def test_a_recovery_policy_per_request(main):
    url, _ = main
    plain = chat(url, user="maya", memory={"k": 4}).json()["inferscale"]
    last = chat(url, user="maya", memory={"k": 4, "policy": "last:2"}).json()["inferscale"]
    assert plain["policy"] == "none" and last["policy"] == "last:2" and last["facts"] == plain["facts"]
    assert 0 < last["injected_tokens"] < plain["injected_tokens"]  # vLLM prefilled the last two facts
    heads = chat(url, user="maya", memory={"k": 4, "policy": "heads:2"}).json()["inferscale"]  # computed by the
    assert heads["policy"] == "heads:2" and heads["facts"] == plain["facts"]  # connector with vLLM's model
    assert heads["injected_tokens"] == plain["injected_tokens"] - 2 * len(plain["facts"])
    top = chat(url, user="maya", memory={"k": 4, "policy": "top:2"}).json()["inferscale"]  # the 2 most relevant
    ids = [f["id"] for f in plain["facts"]]  # moved next to the question, the most relevant last, and prefilled
    assert top["policy"] == "top:2" and [f["id"] for f in top["facts"]] == ids[2:] + ids[1::-1]
    assert 0 < top["injected_tokens"] < plain["injected_tokens"]
    near = chat(url, user="maya", memory={"k": 4, "policy": "near:2"}).json()["inferscale"]  # the order alone
    assert [f["id"] for f in near["facts"]] == ids[2:] + ids[1::-1]
    assert near["injected_tokens"] == plain["injected_tokens"]
    whole = chat(url, user="maya", memory={"k": "all", "mode": "inject", "policy": "top:2"})
    assert "order it was added" in error_of(whole, 400)["message"]
    deadline = time.monotonic() + 10  # the workers' counters arrive with vLLM's next stats
    while "inferscale_connector_recomputed_tokens_total 0.0" in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "no recomputed tokens counted"
        time.sleep(0.2)
    assert "inferscale_connector_plain_recompute_plans_total 0.0" in httpx.get(f"{url}/metrics").text
    assert "only the JAX engine" in error_of(chat(url, user="maya", memory={"policy": "keys:80"}), 400)["message"]
    assert error_of(chat(url, user="maya", memory={"mode": "text", "policy": "last:1"}), 400)["param"] == \
        "memory.policy"
    assert chat(url, user="maya", memory={"mode": "text"}).json()["inferscale"]["policy"] is None
    assert 'inferscale_answers_total{mode="inject",policy="last:2"}' in httpx.get(f"{url}/metrics").text


def test_the_user_header_a_proxy_routes_by_names_the_user(main):
    url, _ = main
    by_body = chat(url, user="maya", memory={"k": 4}).json()["inferscale"]
    by_header = chat(url, headers={**A, "X-User-ID": "maya"}, memory={"k": 4}).json()["inferscale"]
    assert by_header["user"] == "maya" and by_header["facts"] == by_body["facts"]
    assert chat(url, headers={**A, "X-User-ID": "maya"}, user="maya").status_code == 200
    assert error_of(chat(url, headers={**A, "X-User-ID": "tom"}, user="maya"), 400)["param"] == "user"


def test_auto_mode_serves_what_the_gate_says_and_text_uncalibrated(live, monkeypatch, caplog):
    from inferscale.gate.calibration import Calibration, Measured

    with caplog.at_level("WARNING", logger="inferscale.server"):
        url, _ = live.start(default_mode="auto")  # open mode, the default mode
    assert any("not calibrated" in r.getMessage() for r in caplog.records)
    facts = [{"id": f"g{i}", "text": f"Gate fact number {i} about the garden."} for i in range(6)]
    assert httpx.post(f"{url}/v1/memories/gate", json={"facts": facts}).status_code == 200
    info = chat(url, user="gate", memory={"k": 4}).json()["inferscale"]
    assert (info["mode"], info["policy"], info["injected_tokens"]) == ("text", None, 0)
    assert "not calibrated" in info["gate"]
    right, lost = {"recall": [[1.0, 1.0]] * 3}, {"recall": [[1.0, 0.0]] * 3}  # per question: text's, the policy's
    cal = Calibration.from_measurements(live.composer.encoder.fingerprint,
                                        [Measured(4, "last:2", 0.5, 0.5, 0.5, 3, scores=right),
                                         Measured(4, "none", 0.1, 0.5, 0, 3, scores=lost)], tolerance=0.05)
    monkeypatch.setattr(live.composer, "calibration", cal)
    info = chat(url, user="gate", memory={"k": 4}).json()["inferscale"]
    assert (info["mode"], info["policy"]) == ("inject", "last:2") and info["injected_tokens"] > 0
    assert "calibrated at k=4" in info["gate"]
    info = chat(url, user="gate", memory={"k": 6}).json()["inferscale"]
    assert (info["mode"], info["policy"]) == ("text", None) and "beyond the calibrated k" in info["gate"]
    error_of(chat(url, user="gate", memory={"mode": "auto", "policy": "none"}), 400)
    assert chat(url, user="gate", memory={"mode": "inject"}).json()["inferscale"]["gate"] is None
    m = httpx.get(f"{url}/metrics").text
    assert 'inferscale_answers_total{mode="inject",policy="last:2"}' in m
    assert 'inferscale_answers_total{mode="text",policy="-"}' in m


def test_openai_client_plain_and_streaming(main, live):
    url, _ = main
    c = client(url)
    kw = dict(model=live.model_name, messages=[{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": Q}],
              user="maya", max_tokens=8, extra_body={"memory": {"k": 3}})
    resp = c.chat.completions.create(**kw)
    info = resp.model_extra["inferscale"]
    assert len(info["facts"]) == 3 and info["injected_tokens"] > 0
    assert resp.usage.prompt_tokens == info["prompt_tokens"]

    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert [f["id"] for f in first.model_extra["inferscale"]["facts"]] == [f["id"] for f in info["facts"]]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == resp.choices[0].message.content  # greedy: the same answer either way
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["inferscale"]["timings"]["ttft_s"] > 0
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1

    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=A, timeout=60,
                      json={"messages": [{"role": "user", "content": Q}], "user": "maya", "max_tokens": 4,
                            "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert json.loads(lines[0][6:])["inferscale"]["mode"] == "inject"

    assert [m.id for m in c.models.list().data] == [live.model_name]


# -- memories ----------------------------------------------------------------------------------
def test_memory_crud_while_serving(main):
    url, _ = main
    base = f"{url}/v1/memories/ann"
    turns = [{"id": f"t{i}", "speaker": "Ann", "text": f"Ann talks about her garden, day {i}."} for i in range(4)]
    facts = [{"id": "home", "text": "Ann lives in Leeds.", "source_turn": "t3"},
             {"id": "job", "text": "Ann works at a library.", "source_turn": "t2"}]

    async def concurrently():
        async with httpx.AsyncClient(headers=A, timeout=60) as h:
            stream_req = h.post(f"{url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": Q}], "user": "maya", "max_tokens": 24, "stream": True})
            add_req = h.post(base, json={"turns": turns, "facts": facts})
            return await asyncio.gather(stream_req, add_req)

    streamed, added = asyncio.run(concurrently())  # an add (which encodes KV) while a chat streams
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert added.status_code == 200, added.text
    assert added.json()["added"] == ["home", "job"]

    listed = httpx.get(base, headers=A).json()
    assert {f["id"] for f in listed["data"]} == {"home", "job"} and listed["version"] >= 1
    assert httpx.get(f"{base}/facts/home", headers=A).json()["text"] == "Ann lives in Leeds."
    hits = httpx.post(f"{base}/search", json={"query": "where does Ann live", "k": 1}, headers=A).json()["data"]
    assert hits[0]["id"] == "home" and "score" in hits[0]

    upd = httpx.patch(f"{base}/facts/home", json={"text": "Ann moved to York."}, headers=A)
    assert upd.status_code == 200 and upd.json()["text"] == "Ann moved to York."
    out = chat(url, user="ann", memory={"fact_ids": ["home"]}).json()["inferscale"]
    assert out["facts"] == [{"id": "home", "text": "Ann moved to York."}] and out["injected_tokens"] > 0
    events = [e["event"] for e in httpx.get(f"{base}/facts/home/history", headers=A).json()["data"]]
    assert events == ["ADD", "UPDATE"]

    assert httpx.patch(f"{base}/turns/t2", json={"text": "Ann talks about books."}, headers=A).json()["reencoded"] \
        == ["home"]  # t2 is in home's window (w=3), job's source turn is t2 itself
    assert httpx.delete(f"{base}/turns/t1", headers=A).status_code == 200
    error_of(httpx.patch(f"{base}/turns/nope", json={"text": "x"}, headers=A), 404)

    assert httpx.delete(f"{base}/facts/job", headers=A).json()["deleted"] is True
    error_of(httpx.get(f"{base}/facts/job", headers=A), 404)
    error_of(chat(url, user="ann", memory={"fact_ids": ["job"]}), 404)
    events = [e["event"] for e in httpx.get(f"{base}/facts/job/history", headers=A).json()["data"]]
    assert events == ["ADD", "REENCODE", "DELETE"]  # t1 was in job's window

    users = [u["user"] for u in httpx.get(f"{url}/v1/memories", headers=A).json()["data"]]
    assert users == ["ann", "maya"]
    assert httpx.delete(base, headers=A).json()["deleted"] is True
    error_of(httpx.get(base, headers=A), 404)
    error_of(chat(url, user="ann"), 404)


def test_tenants_are_isolated(main, live):
    url, _ = main
    assert httpx.get(f"{url}/v1/memories/maya", headers=A).status_code == 200
    error_of(httpx.get(f"{url}/v1/memories/maya", headers=B), 404)  # team-b has no user "maya"
    error_of(httpx.get(f"{url}/v1/memories/maya/facts/{load_demo().conversation.facts[0].id}", headers=B), 404)
    error_of(chat(url, headers=B, user="maya"), 404)
    error_of(httpx.delete(f"{url}/v1/memories/maya", headers=B), 404)
    assert httpx.get(f"{url}/v1/memories", headers=B).json()["data"] == []
    # team-b's own "maya" is another memory
    r = httpx.post(f"{url}/v1/memories/maya", json={"facts": [{"id": "b1", "text": "Maya of team b sails."}]},
                   headers=B)
    assert r.status_code == 200
    assert [f["id"] for f in httpx.get(f"{url}/v1/memories/maya", headers=B).json()["data"]] == ["b1"]
    assert "b1" not in {f["id"] for f in httpx.get(f"{url}/v1/memories/maya", headers=A).json()["data"]}
    assert chat(url, headers=B, user="maya", memory={"k": 5}).json()["inferscale"]["facts"][0]["id"] == "b1"
    # keys
    error_of(httpx.get(f"{url}/v1/memories"), 401)
    error_of(httpx.get(f"{url}/v1/memories", headers={"Authorization": "Bearer nope-nope-nope"}), 401)
    error_of(chat(url, headers={"Authorization": "Basic abc"}), 401)
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong-key-123").chat.completions.create(model=live.model_name, messages=[
            {"role": "user", "content": Q}])
    assert httpx.get(f"{url}/health").status_code == 200  # open endpoints
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_bad_input_is_an_openai_style_400(main, live):
    url, _ = main
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": [', headers={**A, "content-type":
                                                                                      "application/json"})
    assert "JSON" in error_of(r, 400)["message"]
    assert "messages" in error_of(httpx.post(f"{url}/v1/chat/completions", json={}, headers=A), 400)["message"]
    assert error_of(chat(url, temperature=5), 400)["param"] == "temperature"
    assert "memory.k" in error_of(chat(url, user="maya", memory={"k": -1}), 400)["message"]
    assert "memory.k" in error_of(chat(url, user="maya", memory={"k": 1000}), 400)["message"]
    error_of(chat(url, user="maya", memory={"bogus": 1}), 400)
    assert error_of(chat(url, n=17), 400)["param"] == "n"
    assert error_of(chat(url, top_logprobs=3), 400)["param"] == "top_logprobs"  # without logprobs: true
    assert error_of(chat(url, response_format={"type": "yaml"}), 400)["param"] == "response_format"
    error_of(chat(url, tools=[{"type": "function", "function": {"name": "f"}}]), 400)
    error_of(chat(url, max_tokens=0), 400)
    assert "user" in error_of(chat(url, user="not a valid id!"), 400)["message"]
    error_of(chat(url, messages=[{"role": "assistant", "content": "hi"}]), 400)
    error_of(chat(url, messages=[{"role": "wizard", "content": "hi"}]), 400)
    error_of(chat(url, stop=["a", "b", "c", "d", "e"]), 400)
    error_of(chat(url, model="gpt-4o"), 404)
    error_of(chat(url, user="nobody"), 404)
    error_of(httpx.post(f"{url}/v1/memories/maya", json={"facts": [{"text": "  "}]}, headers=A), 400)
    error_of(httpx.post(f"{url}/v1/memories/maya", json={}, headers=A), 400)
    error_of(httpx.post(f"{url}/v1/memories/maya/search", json={"query": "x", "k": 0}, headers=A), 400)
    error_of(httpx.get(f"{url}/v1/nothing-here", headers=A), 404)
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": Q}],
                                            top_p=0)
    assert "top_p" in str(e.value)


# -- load behaviour ------------------------------------------------------------------------------
def _long(**kw):
    return {"messages": [{"role": "user", "content": Q}], "max_tokens": 1500, **kw}


def _metric(url, name):
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


@pytest.fixture(scope="module")
def runs_long(main):
    """The tiny random model rarely stops by itself; check that this question runs to max_tokens."""
    url, _ = main
    if chat(url, max_tokens=30).json()["choices"][0]["finish_reason"] != "length":
        pytest.skip("the tiny model stops early on this prompt")


def test_overload_is_429(live, main, runs_long):
    url, _ = live.start(max_concurrent=1, max_queued=1, request_timeout_s=60.0)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as h:
            return await asyncio.gather(*[h.post(f"{url}/v1/chat/completions", json=_long(max_tokens=30))
                                          for _ in range(6)])

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 200, 429, 429, 429, 429], codes  # one running, one queued, the rest refused
    err = error_of(next(r for r in rs if r.status_code == 429), 429)
    assert "overloaded" in err["message"] and err["type"] == "rate_limit_error"
    assert next(r for r in rs if r.status_code == 429).headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        async def with_client():
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            kw = dict(model=live.model_name, messages=[{"role": "user", "content": Q}], max_tokens=8)
            await asyncio.gather(*[c.chat.completions.create(**kw) for _ in range(4)])
        asyncio.run(with_client())
    _wait_idle(live, url)
    assert _metric(url, 'inferscale_rejected_total{reason="overload"}') >= 5


def test_timeout_is_504_and_aborts(live, main, runs_long):
    url, _ = live.start(request_timeout_s=1.0)
    t = time.perf_counter()
    r = chat(url, max_tokens=1200)
    assert time.perf_counter() - t < 10
    assert "timed out" in error_of(r, 504)["message"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_long(stream=True), timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert json.loads(lines[-1][6:])["error"]["type"] == "timeout_error"
    with pytest.raises(openai.APIStatusError) as e:
        client(url, "x").chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": Q}],
                                                 max_tokens=1200)
    assert e.value.status_code == 504
    _wait_idle(live, url)
    assert _metric(url, 'inferscale_rejected_total{reason="timeout"}') == 3


def test_client_disconnect_aborts_the_engine_request(live, main, runs_long):
    url, app = main
    # streaming: read the first chunk, then hang up
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_long(stream=True), headers=A,
                      timeout=60) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines)[6:])["choices"][0]["delta"]["role"] == "assistant"
        while not next(lines).startswith("data: "):  # a first token: the request is in the engine
            pass
        busy = live.run(probe_engine(live.engine))
        assert busy["scheduler_requests"] == 1  # the probe sees live requests
    _wait_idle(live, url)
    # not streaming: give up after a moment
    with pytest.raises(httpx.ReadTimeout):
        chat(url, max_tokens=1200, timeout=0.5)
    _wait_idle(live, url)
    assert _metric(url, 'inferscale_rejected_total{reason="disconnect"}') == 2


def _wait_idle(live, url, timeout=10.0):
    """Every engine request finished: vLLM's frontend, the scheduler, the connector."""
    deadline = time.time() + timeout
    while True:
        state = live.run(probe_engine(live.engine))
        unfinished = live.engine.get_num_unfinished_requests()
        if state and state["pending_requests"] == 0 and state["scheduler_requests"] == 0 and unfinished == 0:
            return state
        if time.time() > deadline:
            raise AssertionError(f"engine not idle: unfinished={unfinished} state={state}")
        time.sleep(0.1)


# -- hardening (issue 14) -----------------------------------------------------------------------------
def test_a_deleted_user_s_kv_never_comes_back(main, live):
    url, _ = main
    question = [{"role": "user", "content": "What is the secret code word?"}]

    def remember(user, text):
        r = httpx.post(f"{url}/v1/memories/{user}", json={"facts": [{"id": "code", "text": text}]}, headers=A)
        assert r.status_code == 200, r.text

    def ask(user):  # seeded sampling: the whole next-token distribution shows in the text, not only its argmax
        r = chat(url, user=user, memory={"fact_ids": ["code"]}, max_tokens=16, messages=question,
                 temperature=1.0, seed=1234)
        assert r.status_code == 200, r.text
        assert r.json()["inferscale"]["injected_tokens"] > 0
        return r.json()["choices"][0]["message"]["content"]

    old = "The secret code word is GOLDEN ELEPHANT."
    n = len(live.composer.builder.fact_ids(old, None))
    new = next(t for t in ("Zq" + " zx" * i + "!" * j for i in range(60) for j in range(3))
               if len(live.composer.builder.fact_ids(t, None)) == n)  # other text, the same token count
    remember("stale2", old)
    golden = ask("stale2")  # its KV is now in the connector's host cache, under the user's key
    assert httpx.delete(f"{url}/v1/memories/stale2", headers=A).status_code == 200
    remember("stale2", new)  # the same user id, fact id, version and token count, new text
    remember("fresh2", new)  # a user that never held the old fact
    reference = ask("fresh2")
    if reference == golden:
        pytest.skip(f"the tiny model answers both memories alike: {golden!r}")
    assert ask("stale2") == reference


def test_prompts_without_memory_share_no_cache_across_tenants(main, live):
    url, _ = main
    secret = [{"role": "user", "content": " ".join(f"tenant-b-private-word-{i}" for i in range(40))}]
    b = live.composer.builder
    template = len(b.header_ids) + len(b.footer_ids)  # what every prompt of one scope starts with

    def cached(headers, **body):
        r = chat(url, headers=headers, messages=secret, max_tokens=1, **body)
        assert r.status_code == 200, r.text
        assert r.json()["inferscale"]["mode"] == "none"
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(B)
    assert cached(B) > template  # the prefix cache reaches into the question inside a tenant
    assert cached(A) <= template  # but tenant A cannot probe tenant B's question
    assert cached(A, user="maya", memory={"enabled": False}) <= template
    assert cached(A, user="maya", memory={"k": 0}) > template  # the same tenant's user: shared
    assert cached(A, user="ann", memory={"k": 0}) <= template  # another user of the tenant: not


def test_a_slow_add_blocks_no_other_tenant_and_no_chat(main, live, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    url, _ = main
    enc = live.composer.memory.encoder
    entered, release = threading.Event(), threading.Event()
    real = enc.encode_windowed

    def slow(facts, windows, w):
        if any("SLOW" in f.text for f in facts):
            entered.set()
            release.wait(60)
        return real(facts, windows, w)

    monkeypatch.setattr(enc, "encode_windowed", slow)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/v1/memories/slowpoke", headers=A, timeout=90,
                              json={"facts": [{"id": "s", "text": "A SLOW fact to encode."}]})
        assert entered.wait(30)
        try:
            t = time.perf_counter()
            assert httpx.get(f"{url}/v1/memories/maya", headers=A, timeout=10).status_code == 200
            assert chat(url, user="maya", memory={"k": 3}, timeout=10).status_code == 200  # chat with memory
            assert chat(url, headers=B, timeout=10).status_code == 200  # and without
            r = httpx.post(f"{url}/v1/memories/quick", headers=B, timeout=20,
                           json={"facts": [{"id": "q", "text": "Tenant b adds a fact meanwhile."}]})
            assert r.status_code == 200, r.text  # another tenant's write
            assert time.perf_counter() - t < 20
            assert not pending.done()
        finally:
            release.set()
        assert pending.result().status_code == 200


def test_messages_are_remembered_by_the_served_model_in_the_background(main):
    """An add with messages answers 202 with a job at once; the messages are turns already; the
    served model extracts facts through the engine (JSON-constrained) and the job reports done
    with what it added; the same messages return the same job; another tenant cannot see it."""
    url, app = main
    extractor = app.state.inferscale.gateway.jobs.extractor
    extractor.max_facts, extractor.max_tokens = 1, 400  # a random model writes the longest facts allowed: room for one
    msgs = [{"id": "x1", "role": "user", "content": "I started learning the cello.", "date": "3 May 2025"},
            {"id": "x2", "role": "assistant", "content": "Lovely!"}]
    r = httpx.post(f"{url}/v1/memories/ana", json={"messages": msgs}, headers=A, timeout=60)
    assert r.status_code == 202, r.text
    job = r.json()["job"]
    assert job["state"] in ("queued", "running", "done") and job["messages"] == 2
    deadline = time.time() + 120
    while job["state"] in ("queued", "running"):
        assert time.time() < deadline, job
        time.sleep(0.5)
        job = httpx.get(f"{url}/v1/memories/ana/jobs/{job['id']}", headers=A, timeout=30).json()
    assert job["state"] == "done", job
    facts = httpx.get(f"{url}/v1/memories/ana", headers=A, timeout=30).json()["data"]
    assert sorted(f["id"] for f in facts) == sorted(job["outcome"]["added"])
    assert all(f["source_turn"] in ("x1", "x2") for f in facts)
    again = httpx.post(f"{url}/v1/memories/ana", json={"messages": msgs}, headers=A, timeout=60)
    assert again.status_code == 202 and again.json()["job"]["id"] == job["id"]
    assert again.json()["job"]["outcome"] == job["outcome"]
    error_of(httpx.get(f"{url}/v1/memories/ana/jobs/{job['id']}", headers=B, timeout=30), 404)
    error_of(httpx.get(f"{url}/v1/memories/ana/jobs/job-none", headers=A, timeout=30), 404)
    error_of(httpx.post(f"{url}/v1/memories/ana", json={"messages": [{"role": "robot", "content": "x"}]},
                        headers=A, timeout=30), 400)
    # remember while chatting: the exchange is stored after the answer and its facts extracted
    r = chat(url, user="ana", memory={"k": 2, "remember": True})
    assert r.status_code == 200, r.text
    job_id = r.json()["inferscale"]["remember"]["job"]
    deadline = time.time() + 120
    while (j := httpx.get(f"{url}/v1/memories/ana/jobs/{job_id}", headers=A, timeout=30)).status_code == 404 \
            or j.json()["state"] in ("queued", "running"):
        assert time.time() < deadline, j.text
        time.sleep(0.5)
    assert j.json()["state"] == "done" and j.json()["messages"] == 2
    error_of(chat(url, memory={"remember": True}), 400)  # nobody to remember it for

def test_nothing_leaks_after_the_run(live, main):
    url, app = main
    assert chat(url, user="maya", memory={"k": 8}).status_code == 200  # one more step refreshes the stats
    state = _wait_idle(live, url)
    assert state["kv_cache_usage"] == 0.0  # every KV block is back in the free pool
    assert state["injected_tokens"] > 0 and state["failed_loads"] == 0
    assert state["host_tier"]["hits"] > 0  # the connector's host LRU served repeated facts
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert health["admission"]["in_flight"] == 0 and health["admission"]["queued"] == 0
    assert health["engine"]["running"] == 0 and health["engine"]["waiting"] == 0
    assert health["engine"]["unfinished"] == 0 and health["engine"]["kv_cache_usage"] == 0.0
    assert health["connector"]["pending_requests"] == 0
