"""A loopback OpenAI-style chat endpoint that answers JSON requests with a JsonLLM (the extraction
tests' deterministic stub), for the code that asks an endpoint (`OpenAIJsonLLM`)."""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def openai_endpoint(llm, model: str = "stub-model"):
    """Yields (base URL of its /v1 root, the requests asked: (path, model, response_format type, temperature))."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /v1/models
            self._send({"object": "list", "data": [{"id": model}]})

        def do_POST(self):  # /v1/chat/completions
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append((self.path, req["model"], req["response_format"]["type"], req["temperature"]))
            text = llm.complete_json(req["messages"], req["response_format"]["json_schema"]["schema"], req["max_tokens"])
            self._send({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", asked
    finally:
        server.shutdown()
