"""A stock `vllm serve` as the server's engine: `inferscale serve --engine-url URL` is then a
gateway (memory API, retrieval, composition) in front of vLLM pods that keep running as they are,
loaded with the InferScale connector through `--kv-transfer-config`:

    vllm serve MODEL --enable-prompt-tokens-details --kv-transfer-config '{"kv_connector":
        "InferScaleConnector", "kv_connector_module_path": "inferscale.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"memory_root": "/srv/mem", "kv_store": "redis://kv:6379/0"}}'
    inferscale serve --engine-url http://vllm:8000 --catalog postgresql://... --kv-store redis://kv:6379/0

`RemoteEngine` has the part of `AsyncLLM`'s interface the chat route uses (`generate`, `abort`,
`errored`, `get_num_unfinished_requests`), so the chat code path is one for both shapes: the
gateway composes the same `TokensPrompt` and `SamplingParams`, and this sends them to vLLM's
OpenAI completions endpoint as what that endpoint accepts per request: the prompt as token ids,
the memory plan as `kv_transfer_params`, the prefix-cache salt as `cache_salt`. The streamed
chunks come back as `RemoteOutput`s shaped like vLLM's `RequestOutput` deltas. Closing the stream
(a client gone, a timeout) makes vLLM abort the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from inferscale.server.choices import from_completions

_SAMPLING = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class RemoteCompletion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    index: int = 0
    openai_logprobs: list[dict] | None = None  # OpenAI chat entries (`choices.from_completions`)


@dataclass
class RemoteOutput:
    """One streamed chunk, as the chat route reads a vLLM `RequestOutput` (delta kind)."""

    outputs: list[RemoteCompletion]
    finished: bool
    num_cached_tokens: int | None = None


class RemoteEngineError(RuntimeError):
    """The vLLM server refused or failed a request."""


class RemoteEngine:
    def __init__(self, url: str, model: str, timeout_s: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.model = model  # the name the vLLM server serves the model under
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._open: dict[str, Any] = {}  # request id -> its response stream
        self.errored = False

    async def attach_model(self) -> str:
        """Ask the pod to hand its model to the connector (`inferscale.vllm.model_access`): ""
        when plans that recompute inside the memory are computed there, else why not."""
        from inferscale.vllm.model_access import ATTACH, EXTENSION, attach_reasons

        r = await self._client.post(f"{self.url}/collective_rpc", json={"method": ATTACH})
        if r.status_code == 404:
            return (f"the vLLM server at {self.url} does not serve /collective_rpc (start it with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} to compute heads:N plans)")
        if r.status_code != 200:
            return (f"the vLLM server at {self.url} could not attach its model ({r.status_code}: "
                    f"{r.text[:200]}); is it started with --worker-extension-cls {EXTENSION}?")
        return attach_reasons(r.json().get("results"))

    def body(self, prompt, params) -> dict:
        """The completions request for one composed prompt (`TokensPrompt`, `SamplingParams`)."""
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt["prompt_token_ids"]),
                                "max_tokens": params.max_tokens, "stream": True, "return_token_ids": True,
                                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        for name in _SAMPLING:
            value = getattr(params, name, None)
            if value not in (None, [], ()):
                body[name] = value
        if getattr(params, "n", 1) > 1:
            body["n"] = params.n
        if getattr(params, "logprobs", None) is not None:
            body["logprobs"] = max(params.logprobs, 1)  # the completions endpoint counts the sampled token in
        so = getattr(params, "structured_outputs", None)
        if so is not None:
            body["structured_outputs"] = {k: v for k, v in vars(so).items() if not k.startswith("_") and v not in
                                          (None, False)}
        if prompt.get("cache_salt"):
            body["cache_salt"] = prompt["cache_salt"]
        kv = (params.extra_args or {}).get("kv_transfer_params")
        if kv is not None:
            body["kv_transfer_params"] = kv
        return body

    async def generate(self, prompt, params, request_id: str) -> AsyncIterator[RemoteOutput]:
        import httpx

        top = getattr(params, "logprobs", None)
        try:
            async with self._client.stream("POST", f"{self.url}/v1/completions", json=self.body(prompt, params),
                                           headers={"X-Request-Id": request_id}) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")[:500]
                    raise RemoteEngineError(f"vLLM at {self.url} answered {r.status_code}: {detail}")
                self._open[request_id] = r
                cached = None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:  # the final usage chunk
                        cached = int(details["cached_tokens"])
                    for c in chunk.get("choices") or ():
                        lps = from_completions(c.get("logprobs"), top) if top is not None else None
                        yield RemoteOutput([RemoteCompletion(c.get("text") or "", list(c.get("token_ids") or ()),
                                                             c.get("finish_reason"), int(c.get("index") or 0), lps)],
                                           False)
                # finished once the usage (with the prompt tokens vLLM had cached or loaded) is in
                yield RemoteOutput([], True, cached)
        except httpx.HTTPError as e:
            raise RemoteEngineError(f"vLLM at {self.url}: {e}") from e
        finally:
            self._open.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        r = self._open.pop(request_id, None)
        if r is not None:
            await r.aclose()  # vLLM aborts a request whose client went away

    def get_num_unfinished_requests(self) -> int:
        return len(self._open)

    async def aclose(self) -> None:
        await self._client.aclose()

    def shutdown(self, timeout: float | None = None) -> None:
        """Nothing to stop here: the vLLM server has a life of its own."""
