"""The whole scale-out on loopback, as `scripts/local_cluster.py` brings it up: PostgreSQL, Redis,
two `inferscale serve` replicas and vLLM's router hashing users on `X-User-ID`. A fact written
through one replica is answered through the proxy; an update through the other is what the next
answer uses; a replica killed while writes stream into it loses no acknowledged write, and the
proxy moves its users to the survivor."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from engine_scripts import engine_env  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not shutil.which("vllm-router", path=os.path.dirname(sys.executable)):
        pytest.skip("vllm-router is not installed")
    d = tmp_path_factory.mktemp("cluster")
    make_tiny_model(d / "model", "llama", head_dim=32, max_position_embeddings=2048)
    # each replica's worker inside its engine core (the layout tests/server/test_hardening_http.py also
    # checks vLLM's default against): one process less to start per replica
    env = engine_env()
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "local_cluster.py"), "--replicas", "2",
                             "--port", "0", "--model", str(d / "model"), "--dir", str(d / "run"),
                             "--serve-arg=--max-model-len=2048"], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    info = None
    for line in proc.stdout:
        if line.startswith("CLUSTER "):
            info = json.loads(line[len("CLUSTER "):])
            break
    if info is None:
        proc.kill()
        pytest.fail("the cluster did not come up")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep its pipe drained
    yield info
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _chat(url, user, question, k=2):
    r = httpx.post(f"{url}/v1/chat/completions", headers={"X-User-ID": user}, timeout=120,
                   json={"max_tokens": 2, "messages": [{"role": "user", "content": question}],
                         "memory": {"k": k, "mode": "inject"}})
    assert r.status_code == 200, r.text
    return r.json()["inferscale"]


def test_cluster_serves_every_write_through_the_proxy_and_survives_a_dead_replica(cluster):
    proxy, (r0, r1) = cluster["proxy"], cluster["replicas"]
    assert httpx.post(f"{r0}/v1/memories/alice", timeout=120, json={"facts": [
        {"id": "cat", "text": "Alice has a grey cat named Pixel."},
        {"id": "city", "text": "Alice lives in Lisbon."}]}).status_code == 200
    info = _chat(proxy, "alice", "What is my cat called?")
    assert {f["id"] for f in info["facts"]} == {"cat", "city"} and info["injected_tokens"] > 0

    assert httpx.patch(f"{r1}/v1/memories/alice/facts/cat", timeout=120,
                       json={"text": "Alice has a black cat named Soot."}).status_code == 200
    info = _chat(proxy, "alice", "What is my cat called?")
    assert {f["id"]: f["text"] for f in info["facts"]}["cat"] == "Alice has a black cat named Soot."

    acked, stop = [], threading.Event()

    def writer():  # streams adds into replica 0 until it dies
        i = 0
        while not stop.is_set():
            try:
                r = httpx.post(f"{r0}/v1/memories/bob", timeout=30, json={"facts": [{"id": f"b{i}", "text": f"fact {i}"}]})
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                acked.append(f"b{i}")
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 3:
        t.join(0.2)
    os.kill(cluster["pids"]["replica-0"], signal.SIGKILL)
    stop.set()
    t.join(60)
    time.sleep(3)  # the router checks health every second and drops a replica at its first failure
    listed = httpx.get(f"{r1}/v1/memories/bob", timeout=60).json()["data"]
    assert set(acked) <= {f["id"] for f in listed}  # no acknowledged write lost
    for user in ("alice", "bob", *[f"u{i}" for i in range(6)]):  # every user is served by the survivor
        if user.startswith("u"):
            assert httpx.post(f"{r1}/v1/memories/{user}", timeout=60,
                              json={"facts": [{"id": "f", "text": f"{user} likes tea."}]}).status_code == 200
        assert _chat(proxy, user, "What do I like?", k=1)["facts"]
