"""Extraction beside chats on the live server (tests/server/conftest.py): a chat's time to first
token while a 200-message add is being extracted, and a real Mem0 client (the open-source mem0ai
library, in the client environment of scripts/setup_client_tests.sh) running its own add and
search with `inferscale serve` as its LLM, then its memories imported with their ids."""

import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENTS = REPO / ".venv-clients"


@pytest.fixture(scope="module")
def served(live):
    url, app = live.start()
    extractor = app.state.inferscale.gateway.jobs.extractor
    extractor.max_facts, extractor.max_tokens, extractor.window = 1, 300, 50  # a random model writes the longest facts allowed
    return url, app


def ttft(url: str, user: str) -> float:
    """Seconds from sending a streamed chat to its first content chunk."""
    body = {"messages": [{"role": "user", "content": "What does Rae like to eat?"}], "max_tokens": 2, "stream": True,
            "user": user, "memory": {"k": 4}}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.perf_counter() - t0
    raise AssertionError("no content chunk")


def job_state(url, user, jid):
    return httpx.get(f"{url}/v1/memories/{user}/jobs/{jid}", timeout=30).json()


def test_chats_stay_responsive_during_a_200_message_add(served):
    """Extraction is admitted one engine request at a time beside the chats: while a 200-message
    add is extracted (4 windows, each an engine request of up to 300 tokens, then the decisions),
    a chat's median TTFT stays within 1 s plus 5x of its idle median (the job's outcome is the
    extraction tests' concern)."""
    url, _ = served
    facts = [{"id": f"r{i}", "text": f"Rae likes dish number {i}."} for i in range(8)]
    assert httpx.post(f"{url}/v1/memories/rae", json={"facts": facts}, timeout=60).status_code == 200
    idle = statistics.median(ttft(url, "rae") for _ in range(5))
    msgs = [{"id": f"b{i}", "role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i} about my week."}
            for i in range(200)]
    r = httpx.post(f"{url}/v1/memories/bea", json={"messages": msgs}, timeout=60)
    assert r.status_code == 202, r.text
    jid = r.json()["job"]["id"]
    deadline = time.time() + 60
    while job_state(url, "bea", jid)["state"] == "queued":
        assert time.time() < deadline
        time.sleep(0.05)
    busy = [ttft(url, "rae") for _ in range(5)]
    during = job_state(url, "bea", jid)
    assert during["state"] == "running", during  # every chat above ran while the job did
    assert statistics.median(busy) <= 1.0 + 5 * idle, (idle, busy)
    # the job goes on beside the next tests (this module is the last of the live server's files)


def test_mem0_runs_its_own_add_and_search_against_the_server(served, live, tmp_path):
    """mem0ai's `Memory.add` extracts through InferScale's chat endpoint (its JSON mode: vLLM's
    structured outputs), its search and get_all work over what it stored, and its memories are
    imported into InferScale with their ids (docs/api.md, "Keeping Mem0 as the extractor"). The
    tiny random model's extraction is random JSON, so what mem0 inferred is not asserted; the
    memory added without inference is. Mem0's extraction prompt (~24,000 tokens of the tiny
    model's tokenizer) is shortened to fit the tiny model's context (tests/clients/mem0_client.py)."""
    failed = CLIENTS / ".failed"
    if failed.exists():
        pytest.skip(f"mem0ai is not installed in {CLIENTS.name}: {failed.read_text().strip()}")
    if not (CLIENTS / "bin" / "python").exists():
        pytest.skip(f"no client environment ({CLIENTS.name}): run `make clients`")
    url, _ = served
    run = subprocess.run([str(CLIENTS / "bin" / "python"), str(REPO / "tests" / "clients" / "mem0_client.py"), url,
                          live.model_name, str(tmp_path), "--short-prompt"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert isinstance(out["inferred"]["results"], list)  # the LLM call went through and was parsed
    assert [r["memory"] for r in out["raw"]["results"]] == ["Maya plays the cello on Sundays."]
    assert "Maya plays the cello on Sundays." in [r["memory"] for r in out["search"]["results"]]
    mems = out["all"]["results"]
    body = {"facts": [{"id": m["id"], "text": m["memory"], "date": (m.get("created_at") or "")[:10] or None}
                      for m in mems]}
    r = httpx.post(f"{url}/v1/memories/maya-m0", json=body, timeout=60)
    assert r.status_code == 200, r.text
    listed = httpx.get(f"{url}/v1/memories/maya-m0", timeout=30).json()["data"]
    assert sorted(f["id"] for f in listed) == sorted(m["id"] for m in mems)
    again = httpx.post(f"{url}/v1/memories/maya-m0", json=body, timeout=60)
    assert again.status_code == 400 and "already has fact" in again.text  # the same ids again: refused
    info = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "What instrument do I play?"}], "max_tokens": 2, "user": "maya-m0",
        "memory": {"k": len(mems)}}).json()["inferscale"]
    assert len(info["facts"]) == len(mems)


def test_an_endpoint_named_in_the_config_extracts_instead_of_the_served_model(live):
    """`extraction_url` / `extraction_model`: the jobs ask that OpenAI-compatible endpoint (here a
    loopback stub), not the engine; the config refuses an endpoint without its model."""
    from stub_openai import openai_endpoint

    from inferscale.server.settings import ServerConfig

    class OneFact:
        def complete_json(self, messages, schema, max_tokens):
            if "facts" in schema["properties"]:
                return json.dumps({"facts": [{"text": "Ana plays the cello.", "message": 0}]})
            return json.dumps({"event": "ADD", "target": -1, "text": ""})

    with openai_endpoint(OneFact(), model="extractor-1") as (endpoint, asked):
        url, _ = live.start(extraction_url=endpoint, extraction_model="extractor-1")
        r = httpx.post(f"{url}/v1/memories/ana-x", timeout=60,
                       json={"messages": [{"id": "c1", "role": "user", "content": "I play the cello."}]})
        assert r.status_code == 202, r.text
        jid, deadline = r.json()["job"]["id"], time.time() + 60
        while (job := job_state(url, "ana-x", jid))["state"] in ("queued", "running"):
            assert time.time() < deadline, job
            time.sleep(0.1)
    assert job["state"] == "done" and job["outcome"]["added"] == ["m-c1-0"], job
    assert asked and all(a[1] == "extractor-1" and a[2] == "json_schema" for a in asked)
    facts = httpx.get(f"{url}/v1/memories/ana-x", timeout=30).json()["data"]
    assert [(f["text"], f["source_turn"]) for f in facts] == [("Ana plays the cello.", "c1")]
    for bad, field in (({"extraction_url": "ftp://x"}, "extraction_url"), ({"extraction_url": "http://x/v1"}, "model")):
        with pytest.raises(ValueError, match=field):
            ServerConfig(model=str(live.composer.config.model), memory_root="r", **bad)
