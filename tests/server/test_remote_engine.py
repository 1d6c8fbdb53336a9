"""`RemoteEngine` sends a composed prompt to a vLLM OpenAI server as that API takes it per request
(token ids, the memory plan as kv_transfer_params, the cache salt, the sampling settings), and reads
the stream back as RequestOutput-like deltas; checked against a stand-in server on loopback."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from inferscale.server.remote import RemoteEngine

PLAN = {"inferscale": {"user": "t:u", "version": 3, "segments": []}}


def _params(**kw):
    base = dict(max_tokens=4, temperature=0.0, top_p=1.0, stop=[], seed=None, presence_penalty=0.0,
                frequency_penalty=0.0, repetition_penalty=1.0, extra_args={"kv_transfer_params": PLAN})
    return SimpleNamespace(**{**base, **kw})


def test_the_request_carries_ids_plan_salt_and_sampling():
    eng = RemoteEngine("http://127.0.0.1:1/", "m")
    body = eng.body({"prompt_token_ids": [5, 6, 7], "cache_salt": "s1"}, _params(stop=["\n"], seed=7))
    assert body["prompt"] == [5, 6, 7] and body["cache_salt"] == "s1" and body["kv_transfer_params"] == PLAN
    assert body["max_tokens"] == 4 and body["stop"] == ["\n"] and body["seed"] == 7 and body["stream"] is True
    assert "seed" not in eng.body({"prompt_token_ids": [1]}, _params())  # unset settings are left to vLLM
    assert "kv_transfer_params" not in eng.body({"prompt_token_ids": [1]}, _params(extra_args=None))


def test_the_stream_comes_back_as_deltas_with_the_cached_tokens_last():
    seen = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen["body"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen["rid"] = self.headers["X-Request-Id"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"text": "Pix", "token_ids": [11], "finish_reason": None}]},
                      {"choices": [{"text": "el", "token_ids": [12], "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 6}}}]
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def run():
        eng = RemoteEngine(f"http://127.0.0.1:{server.server_port}", "m")
        outs = [o async for o in eng.generate({"prompt_token_ids": [1, 2], "cache_salt": "s"}, _params(), "r1")]
        await eng.aclose()
        return outs

    try:
        outs = asyncio.run(run())
    finally:
        server.shutdown()
    assert seen["rid"] == "r1" and seen["body"]["kv_transfer_params"] == PLAN
    assert ["".join(c.text for c in o.outputs) for o in outs] == ["Pix", "el", ""]
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].num_cached_tokens == 6
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].outputs[0].token_ids == [12]


def test_the_gateway_attaches_the_pods_model_or_says_why_not():
    """`attach_model` asks the pod's `/collective_rpc` for the worker extension's method: "" when
    every worker computes recompute plans; a pod without the development route (404), or without
    the extension, gives the reason the gateway logs."""
    answers = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, payload = answers["next"]
            answers["method"] = body.get("method")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(payload).encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def ask(status, payload):
        answers["next"] = (status, payload)
        eng = RemoteEngine(f"http://127.0.0.1:{server.server_port}", "m")
        try:
            return await eng.attach_model()
        finally:
            await eng.aclose()

    try:
        assert asyncio.run(ask(200, {"results": [""]})) == "" and answers["method"] == "inferscale_attach_model"
        assert "VLLM_SERVER_DEV_MODE=1" in asyncio.run(ask(404, {"detail": "Not Found"}))
        assert "--worker-extension-cls" in asyncio.run(ask(500, {"error": "no method inferscale_attach_model"}))
        assert asyncio.run(ask(200, {"results": ["several ranks"]})) == "several ranks"
    finally:
        server.shutdown()
