"""The server under hostile input (issue 14, the HTTP side), on the tiny engine of conftest.py:
bounded adds and bodies (413 before the body is read), field limits, `seed` outside the
sampler's range, no engine request left behind when the engine fails, lone surrogates and huge
integers as 400s, the API description behind the key, a loud open mode, and an engine that
neither outlives a SIGTERM'd server nor a SIGKILL'd one (a real `inferscale serve` subprocess)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

psutil = pytest.importorskip("psutil")  # a dependency of vllm

KEY = "key-hardening-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = dict(max_body_bytes=4096, max_add_items=3, max_query_chars=64, max_text_chars=80)


@pytest.fixture(scope="module")
def small(live):
    """An open-mode app with small limits."""
    url, app = live.start(request_timeout_s=60.0, **LIMITS)
    return url, app


@pytest.fixture(scope="module")
def keyed(live):
    url, app = live.start(api_keys={KEY: "team-h"}, request_timeout_s=60.0)
    return url, app


def chat(url, headers=None, **body):
    body.setdefault("messages", [{"role": "user", "content": "Where does Tom live?"}])
    body.setdefault("max_tokens", 2)
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    return err


def raw_post(url, path: str, headers: dict, body: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """POST `body` as JSON; send `body` as is, then read the response until the server closes."""
    u = urlsplit(url)
    head = f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):  # socket.timeout if the server waits for the rest
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload)


def unfinished_drops_to_zero(url, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while (n := httpx.get(f"{url}/health").json()["engine"]["unfinished"]) != 0:
        assert time.time() < deadline, f"{n} engine request(s) left unfinished"
        time.sleep(0.1)


# -- item 7: bodies are refused before they are read ----------------------------------------------
def test_a_body_over_the_limit_is_413_before_it_is_read(small):
    url, _ = small
    # Content-Length says 50 MB; only the first bytes are sent: answered at once, nothing waits for the rest
    t = time.perf_counter()
    status, body = raw_post(url, "/v1/chat/completions", {"Content-Length": "50000000"}, b'{"messages": [')
    assert status == 413 and time.perf_counter() - t < 5
    assert body["error"]["code"] == "request_too_large" and "4096" in body["error"]["message"]
    assert "max_body_bytes" in body["error"]["message"]
    # chunked (no Content-Length): counted as it arrives, refused once past the limit; the rest never comes
    piece = b'{"messages": [{"role": "user", "content": "' + b"x" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(5))
    status, body = raw_post(url, "/v1/memories/bulk/search", {"Transfer-Encoding": "chunked"}, chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # through an ordinary client, on every route
    for path in ("/v1/chat/completions", "/v1/memories/u", "/v1/memories/u/search"):
        err = error_of(httpx.post(f"{url}{path}", content=b"x" * 5000, headers={"content-type": "application/json"}),
                       413)
        assert err["type"] == "invalid_request_error"
    # under the limit: served as usual
    assert chat(url, messages=[{"role": "system", "content": "s" * 1000}, {"role": "user", "content": "hi"}]) \
        .status_code == 200


# -- item 5: an add is bounded ----------------------------------------------------------------------
def test_an_add_holds_at_most_max_add_items(small):
    url, _ = small
    body = {"facts": [{"text": f"Bulk fact number {i}."} for i in range(2)],
            "turns": [{"id": f"t{i}", "text": "hello"} for i in range(2)]}
    err = error_of(httpx.post(f"{url}/v1/memories/bulk", json=body, timeout=60), 413)
    assert "max_add_items" in err["message"] and "at most 3" in err["message"] and "has 4" in err["message"]
    assert err["code"] == "request_too_large"
    error_of(httpx.get(f"{url}/v1/memories/bulk"), 404)  # nothing was added
    ok = httpx.post(f"{url}/v1/memories/bulk", json={"facts": body["facts"], "turns": body["turns"][:1]}, timeout=60)
    assert ok.status_code == 200, ok.text


# -- item 7: field limits -----------------------------------------------------------------------------
def test_questions_queries_and_texts_are_limited(small):
    url, _ = small
    err = error_of(chat(url, messages=[{"role": "user", "content": "q" * 65}]), 400)
    assert err["param"] == "messages" and "max_query_chars" in err["message"] and "64" in err["message"]
    assert chat(url, messages=[{"role": "user", "content": "q" * 64}]).status_code == 200
    err = error_of(httpx.post(f"{url}/v1/memories/bulk/search", json={"query": "q" * 65}), 400)
    assert err["param"] == "query" and "max_query_chars" in err["message"]
    long = "t" * 81
    for body, param in (({"facts": [{"text": long}]}, "facts.0.text"),
                        ({"turns": [{"id": "a", "text": "ok"}, {"id": "b", "text": long}]}, "turns.1.text")):
        err = error_of(httpx.post(f"{url}/v1/memories/limits", json=body), 400)
        assert err["param"] == param and "max_text_chars" in err["message"] and "80" in err["message"]
    for path in ("/v1/memories/bulk/facts/f1", "/v1/memories/bulk/turns/t0"):
        assert error_of(httpx.patch(f"{url}{path}", json={"text": long}), 400)["param"] == "text"


# -- item 8: seed, and engine requests never leak ---------------------------------------------------
def test_seed_outside_the_samplers_range_is_400(small):
    url, _ = small
    for seed in (2**64, -(2**63) - 1, 10**30):
        assert error_of(chat(url, seed=seed, temperature=1.0), 400)["param"] == "seed"
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "seed": seed, "stream": True})
        assert error_of(r, 400)["param"] == "seed"  # refused before the stream starts
    for seed in (-(2**63), -2, 0, 2**63, 2**64 - 1):  # the whole range torch's generator takes
        r = chat(url, seed=seed, temperature=1.0)
        assert r.status_code == 200, (seed, r.text)
    unfinished_drops_to_zero(url)


def test_an_engine_failure_leaves_no_engine_request_behind(small, live, monkeypatch):
    """vLLM registers a request before handing it to the engine core; if that fails, the request
    stays in its tables (as a seed outside 64 bits did): the server must abort it."""
    url, _ = small

    async def refuse(request):
        raise OverflowError("simulated: the engine core could not take the request")

    monkeypatch.setattr(live.engine.engine_core, "add_request_async", refuse)
    err = error_of(chat(url), 500)
    assert err["code"] == "engine_error"
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert json.loads(lines[-1][6:])["error"]["code"] == "engine_error"
    monkeypatch.undo()
    unfinished_drops_to_zero(url)
    assert chat(url).status_code == 200


# -- item 9: lone surrogates and huge integers are 400s --------------------------------------------
CHAT = r'{"messages": [{"role": "user", "content": "hi"}], %s}'
SURROGATES = [
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \ud800 there"}]}', "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]}',
     "messages.0.content"),
    ("/v1/chat/completions", CHAT % r'"user": "al\ud800ice"', "user"),
    ("/v1/chat/completions", CHAT % r'"model": "m\ud800"', "model"),
    ("/v1/chat/completions", CHAT % r'"stop": ["ok", "\ud800"]', "stop"),
    ("/v1/chat/completions", CHAT % r'"user": "u", "memory": {"fact_ids": ["\ud800"]}', "memory.fact_ids.0"),
    ("/v1/memories/sur", r'{"facts": [{"text": "hi \ud800 there"}]}', "facts.0.text"),
    ("/v1/memories/sur", r'{"facts": [{"id": "f\ud800", "text": "ok"}]}', "facts.0.id"),
    ("/v1/memories/sur", r'{"facts": [{"text": "ok", "source_turn": "\ud800"}]}', "facts.0.source_turn"),
    ("/v1/memories/sur", r'{"facts": [{"text": "ok", "date": "\ud800"}]}', "facts.0.date"),
    ("/v1/memories/sur", r'{"turns": [{"id": "t", "text": "a \udfff b"}]}', "turns.0.text"),
    ("/v1/memories/sur", r'{"turns": [{"id": "t", "speaker": "\ud800", "text": "ok"}]}', "turns.0.speaker"),
    ("/v1/memories/sur", r'{"turns": [{"id": "t", "text": "ok", "date": "\ud800"}]}', "turns.0.date"),
    ("/v1/memories/sur", r'{"turns": [{"id": "t", "text": "ok", "session": 1180591620717411303424}]}',
     "turns.0.session"),
    ("/v1/memories/sur", r'{"facts": [{"text": "ok", "\ud800": 1}]}', "facts.0"),  # a key
    ("/v1/memories/sur/search", r'{"query": "where \ud800"}', "query"),
]


@pytest.mark.parametrize("path,raw,param", SURROGATES, ids=[p for _, _, p in SURROGATES])
def test_lone_surrogates_and_huge_integers_are_400(small, path, raw, param):
    url, _ = small
    r = httpx.post(f"{url}{path}", content=raw.encode(), headers={"content-type": "application/json"}, timeout=60)
    err = error_of(r, 400)
    assert err["param"] == param, err
    if "session" not in param:
        assert "unicode" in err["message"].lower()


def test_lone_surrogates_in_text_updates_are_400(small):
    url, _ = small
    for path in ("/v1/memories/sur/facts/f1", "/v1/memories/sur/turns/t1"):
        r = httpx.patch(f"{url}{path}", content=rb'{"text": "x \ud800"}', headers={"content-type": "application/json"})
        assert error_of(r, 400)["param"] == "text"


# -- minor: the API description, and open mode -------------------------------------------------------
def test_the_api_description_needs_a_key_when_keys_are_required(small, keyed):
    open_url, _ = small
    assert httpx.get(f"{open_url}/docs").status_code == 200
    assert "/v1/chat/completions" in httpx.get(f"{open_url}/openapi.json").json()["paths"]
    url, _ = keyed
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        error_of(httpx.get(f"{url}{path}"), 404)
    error_of(httpx.get(f"{url}/openapi.json"), 401)
    error_of(httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer wrong-key-1234"}), 401)
    r = httpx.get(f"{url}/openapi.json", headers=AUTH)
    assert r.status_code == 200 and "/v1/memories/{user}" in r.json()["paths"]


def test_open_mode_is_loud_at_start_up(live, caplog):
    from inferscale.server.app import create_app
    from inferscale.server.settings import ServerConfig

    base = dict(model=str(live.composer.config.model), memory_root=live.composer.config.memory_root)
    with caplog.at_level(logging.WARNING, logger="inferscale.server"):
        create_app(ServerConfig(host="0.0.0.0", port=8123, **base), live.composer, live.engine, live.stats)
    loud = [r for r in caplog.records if r.levelno == logging.WARNING and "open mode" in r.getMessage()]
    assert len(loud) == 1
    msg = loud[0].getMessage()
    assert "0.0.0.0:8123" in msg and "anyone" in msg and "every user's memory" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inferscale.server"):
        create_app(ServerConfig(api_keys={KEY: "team-h"}, **base), live.composer, live.engine, live.stats)
    assert not [r for r in caplog.records if "open mode" in r.getMessage()]


# -- item 11: the engine does not outlive `inferscale serve` -----------------------------------------

@pytest.fixture(scope="module")
def serve_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    d = tmp_path_factory.mktemp("serve-llama")
    make_tiny_model(d, "llama", num_layers=1)
    return d


def _launch(model: Path, tmp_path: Path, **env: str):
    """`inferscale serve` started in a subprocess (the env conftest.py sets, plus `env`): (proc, url, log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("inferscale")
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(exe), "serve", "--model", str(model), "--store", str(tmp_path / "store"),
                             "--port", str(port), "--max-model-len", "512"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    return proc, f"http://127.0.0.1:{port}", log


def _ready(proc, url: str, log: Path):
    """(proc, its children, log) once /health answers; the engine core is among the children."""
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"inferscale serve did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    kids = psutil.Process(proc.pid).children(recursive=True)
    names = [" ".join([k.name(), *k.cmdline()]) for k in kids]
    assert any("EngineCore" in n for n in names), names
    return proc, kids, log


@pytest.fixture(scope="module")
def servers(serve_model, tmp_path_factory):
    """The servers the shutdown tests stop, started together (each engine on a core of its own,
    where there are enough): "default" (worker inside the engine core), and two of vLLM's default
    layout, the worker in a process of its own under the engine core: "multiprocess" (killed) and
    "multiprocess-sigterm"."""
    cores = sorted(os.sched_getaffinity(0))
    pin = lambda i: {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])} if len(cores) >= 2 else {}  # noqa: E731
    mp = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    started = {"default": (tmp_path_factory.mktemp("serve-default"), pin(0)),
               "multiprocess": (tmp_path_factory.mktemp("serve-mp"), {**pin(1), **mp}),
               "multiprocess-sigterm": (tmp_path_factory.mktemp("serve-mp-term"), {**pin(2), **mp})}
    launched = {name: (_launch(serve_model, d, **env), d) for name, (d, env) in started.items()}
    yield launched
    for (proc, _, _), _ in launched.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module", autouse=True)
def _launch_early(servers):
    """The two `inferscale serve` processes start with the module, so they boot while the
    in-process tests above run (only the shutdown tests at the end use them)."""


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_gone(kids, log: Path, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    try:
        while (left := [p for p in kids if _alive(p)]) and time.time() < deadline:
            time.sleep(0.2)
        assert not left, (f"left running: {[(p.pid, p.name()) for p in left]}\n{log.read_text()[-2000:]}")
    finally:
        for p in kids:  # whatever this test started and is still there
            if _alive(p):
                p.kill()


def test_die_with_parent_exits_when_the_parent_is_already_gone():
    from inferscale.vllm.lifetime import die_with_parent

    assert die_with_parent(os.getpid()) is False  # never in the server's own process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    code = "import os, sys; from inferscale.vllm.lifetime import die_with_parent as d; print(d(int(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", code, str(gone.pid)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    out = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(sys.platform.startswith("linux"))


@pytest.mark.parametrize("layout", ["default", "multiprocess-sigterm"])
def test_sigterm_shuts_the_engine_and_the_memory_down(servers, layout):
    launched, store_dir = servers[layout]
    proc, kids, log = _ready(*launched)
    try:
        assert list((store_dir / "store").rglob("*.sqlite-wal"))  # the catalog is open
        assert "open mode" in log.read_text()  # the start-up warning reached the console
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _assert_all_gone(kids, log)
    # SQLite removes the WAL when the last connection closes: the memory was closed, i.e. the
    # shutdown path ran (uvicorn re-raises SIGTERM, so code after uvicorn.run never does)
    assert not list((store_dir / "store").rglob("*.sqlite-wal")), log.read_text()[-2000:]
    # the engine core and its workers left on their own, in time, and unlinked their shared memory
    text = log.read_text()
    assert "force killing" not in text and "leaked shared_memory" not in text, text[-3000:]


def test_the_engine_dies_with_a_killed_server(servers):
    proc, kids, log = _ready(*servers["multiprocess"][0])
    assert len(kids) >= 2
    proc.kill()
    proc.wait(timeout=30)
    _assert_all_gone(kids, log)
