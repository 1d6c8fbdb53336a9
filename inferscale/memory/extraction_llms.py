"""The LLMs an `Extractor` can ask (`inferscale.memory.extraction.JsonLLM`): the served model
through the same vLLM engine (no second model in memory), or any OpenAI-compatible endpoint.
Both decode greedily under the JSON schema (vLLM's structured outputs; `response_format` with a
`json_schema` on the endpoint)."""

from __future__ import annotations

import os

MIN_ROOM = 64  # tokens a prompt must leave to answer in; the answer gets at most what is left


def prompt_room(composer, messages: list[dict]) -> int:
    """Tokens the model's context leaves to answer `messages` in (the chat template's rendering)."""
    return composer.config.max_model_len - len(composer.builder.plain_ids(messages))


def extraction_request(composer, messages: list[dict], schema: dict, max_tokens: int):
    """(TokensPrompt, SamplingParams) of one JSON question to the served model: the chat rendered
    without memory, the answer held to `schema`, in at most `max_tokens` (at most what fits)."""
    ids, _ = composer.plain_chat(messages, room=min(max_tokens, MIN_ROOM))
    return composer.plain_request(ids, "extraction", max_tokens, structured_outputs={"json": schema})


class EngineJsonLLM:
    """The model a `MemoryLLM` serves, asked through its own engine: the chat is rendered with the
    model's template (no memory), and vLLM's structured outputs keep the answer to the schema."""

    def __init__(self, llm) -> None:
        self.llm = llm  # a MemoryLLM

    def room(self, messages: list[dict]) -> int:
        return prompt_room(self.llm.composer, messages)

    def complete_json(self, messages: list[dict], schema: dict, max_tokens: int) -> str:
        return self.complete_json_many([(messages, schema)], max_tokens)[0]

    def complete_json_many(self, calls: list[tuple[list[dict], dict]], max_tokens: int) -> list[str]:
        """The answers of `calls` ((messages, schema) pairs), decoded as one vLLM batch."""
        prompts, params = zip(*(extraction_request(self.llm.composer, m, s, max_tokens) for m, s in calls))
        outs = self.llm.llm.generate(list(prompts), list(params), use_tqdm=False)
        return [o.outputs[0].text for o in outs]


class OpenAIJsonLLM:
    """Any OpenAI-compatible chat endpoint (`base_url` is its /v1 root) that honours
    `response_format: {"type": "json_schema"}` (vLLM's and InferScale's servers do). The API key is
    read from the environment variable `api_key_env`, never from a file."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 300.0):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        self.api_key = os.environ.get(api_key_env)

    def complete_json(self, messages: list[dict], schema: dict, max_tokens: int) -> str:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
        r = httpx.post(f"{self.base_url}/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]


class AsyncEngineJsonLLM:
    """The served model through a server's async engine (vLLM's `AsyncLLM`, or the remote engine
    of the stock `vllm serve` shape: anything with `generate(prompt, params, request_id)`), asked
    from a worker thread: each call is one engine request on the server's event loop, which it
    waits for. `loop` may be set after construction (when the server's loop is known)."""

    def __init__(self, composer, engine, loop=None, timeout_s: float = 600.0) -> None:
        self.composer, self.engine, self.loop, self.timeout_s = composer, engine, loop, timeout_s

    def room(self, messages: list[dict]) -> int:
        return prompt_room(self.composer, messages)

    def complete_json(self, messages: list[dict], schema: dict, max_tokens: int) -> str:
        import asyncio
        import uuid

        if self.loop is None:
            raise RuntimeError("the server's event loop is not known yet")
        prompt, params = extraction_request(self.composer, messages, schema, max_tokens)

        async def run() -> str:
            final = None
            async for out in self.engine.generate(prompt, params, f"extract-{uuid.uuid4().hex}"):
                final = out
            return final.outputs[0].text

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(self.timeout_s)
