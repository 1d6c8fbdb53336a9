"""What a chat request asks for, validated before any work: `Options` (the messages, the user and
tenant, the memory options, the sampling parameters, n, logprobs and response_format), each
invalid value a 400 naming its field. See `inferscale.server.chat` for the route's contract."""

from __future__ import annotations

from typing import Any

from inferscale.common.modes import WHOLE_MEMORY
from inferscale.server.auth import Tenancy
from inferscale.server.errors import bad_request, not_found
from inferscale.server.schemas import UNSUPPORTED, ChatCompletionRequest, MemoryOptions
from inferscale.common.storage.filters import parse_filter
from inferscale.serving.request import MemoryRequest, served_policy

# The header a user-affinity proxy hashes (vLLM's router `consistent_hash` reads it; the HAProxy and
# nginx configs in deploy/ hash it): it names the request's user when the body has none.
USER_HEADER = "X-User-ID"

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20  # as OpenAI's


def _logprobs(extra: dict) -> int | None:
    """`logprobs` / `top_logprobs` as vLLM's `logprobs` count (None: none asked for)."""
    want, top = extra.get("logprobs"), extra.get("top_logprobs")
    if want not in (None, True, False):
        raise bad_request("logprobs must be true or false", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_request(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


def _structured_outputs(fmt: Any) -> dict | None:
    """`response_format` as vLLM's structured outputs (`StructuredOutputsParams` fields)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                              "response_format")
        return {"json": schema}
    raise bad_request("response_format.type must be text, json_object or json_schema", "response_format")


class Options:
    def __init__(self, st, body: ChatCompletionRequest, tenant: str, header_user: str | None = None) -> None:
        cfg = st.config
        if body.model is not None and body.model != st.model_name:
            raise not_found(f"model {body.model!r} does not exist; this server serves {st.model_name!r}", "model")
        extra = body.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, False, [], {}):
                raise bad_request(f"{name} is not supported by this server", name)
        self.n = body.n or 1
        if self.n > MAX_N:
            raise bad_request(f"n must be at most {MAX_N}, got {self.n}", "n")
        self.top_logprobs = _logprobs(extra)
        structured = _structured_outputs(extra.get("response_format"))
        last = body.messages[-1]
        if last.role not in ("user", "tool"):
            raise bad_request("the last message must be the user's (or a tool result)", "messages")
        self.question = last.text().strip()
        if not self.question:
            raise bad_request("the last message has no text", "messages")
        if len(self.question) > cfg.max_query_chars:
            raise bad_request(f"the new message has {len(self.question)} characters; the limit is "
                              f"{cfg.max_query_chars} (max_query_chars)", "messages")
        # every message reaches the model (rendered with its chat template after the memory): system
        # and developer prompts, earlier turns, assistant replies, tool results as text
        self.messages = [{"role": "tool" if m.role == "function" else m.role, "content": m.text()}
                         for m in body.messages]
        mem = body.memory or MemoryOptions()
        self.k = cfg.default_k if mem.k is None else mem.k
        if self.k != WHOLE_MEMORY and self.k > cfg.max_k:
            raise bad_request(f"memory.k must be <= {cfg.max_k}, got {self.k}", "memory.k")
        self.fact_ids = mem.fact_ids
        try:
            self.filters = parse_filter(mem.filters, "memory.filters")
        except ValueError as e:
            raise bad_request(str(e), "memory.filters") from None
        if self.filters is not None and self.fact_ids is not None:
            raise bad_request("memory.filters chooses among retrieved facts; memory.fact_ids names them: use one",
                              "memory.filters")
        if self.fact_ids is not None:
            if len(self.fact_ids) > cfg.max_k:
                raise bad_request(f"memory.fact_ids holds more than {cfg.max_k} facts", "memory.fact_ids")
            self.k = len(self.fact_ids)
        self.repeat = mem.repeat
        if self.repeat and (self.k != WHOLE_MEMORY or self.fact_ids is not None) and mem.mode != "chain":
            raise bad_request("memory.repeat applies to the whole memory (k \"all\")", "memory.repeat")
        if header_user is not None and body.user is not None and header_user != body.user:
            raise bad_request(f"the {USER_HEADER} header ({header_user!r}) and the body's user ({body.user!r}) differ",
                              "user")
        self.user = body.user if body.user is not None else header_user
        self.tenant = tenant
        self.uid = Tenancy.internal_user(tenant, self.user) if self.user is not None else None
        self.remember = (cfg.remember if mem.remember is None else mem.remember) and self.uid is not None
        if mem.remember and self.uid is None:
            raise bad_request("memory.remember needs a user (the `user` field)", "memory.remember")
        asked = mem.mode or cfg.default_mode
        if asked == "chain" and self.fact_ids is not None:
            raise bad_request("mode chain serves the whole memory; memory.fact_ids names facts: use one",
                              "memory.fact_ids")
        enabled = mem.enabled and self.uid is not None and (self.k == WHOLE_MEMORY or self.k > 0 or asked == "chain"
                                                            or self.fact_ids is not None)
        self.mode = asked if enabled else "none"  # as requested: the gate runs in prepare
        self.policy = cfg.default_policy if self.mode == "inject" and mem.policy is None else mem.policy
        try:  # inject takes a policy vLLM can serve; auto chooses its own; the others none
            served_policy(self.mode, self.policy)
        except ValueError as e:
            raise bad_request(str(e), "memory.policy") from None
        self.max_tokens = body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise bad_request("stop must be a non-empty string or a list of up to 4 non-empty strings", "stop")
        from vllm.sampling_params import RequestOutputKind

        # greedy unless asked otherwise; n > 1 samples (OpenAI's default temperature, 1), as n greedy
        # answers would be one answer n times
        temperature = body.temperature if body.temperature is not None else (1.0 if self.n > 1 else 0.0)
        if self.n > 1 and temperature == 0:
            raise bad_request("n > 1 needs a temperature above 0 (greedy decoding gives one answer)", "n")
        self.sampling: dict[str, Any] = {"temperature": temperature,
                                         "output_kind": RequestOutputKind.DELTA}
        for name in ("top_p", "seed", "presence_penalty", "frequency_penalty"):
            if getattr(body, name) is not None:
                self.sampling[name] = getattr(body, name)
        if stop:
            self.sampling["stop"] = stop
        if self.n > 1:
            self.sampling["n"] = self.n
        if self.top_logprobs is not None:
            self.sampling["logprobs"] = self.top_logprobs
        if structured is not None:  # vLLM's structured outputs: the answer is valid JSON (of the schema)
            self.sampling["structured_outputs"] = structured
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def prepare_request(self) -> MemoryRequest:
        """What the gateway composes for this request (`serving.prepare`)."""
        return MemoryRequest(self.uid, self.question, self.k, self.mode, self.fact_ids, max_tokens=self.max_tokens,
                             policy=self.policy, messages=self.messages, sampling=dict(self.sampling),
                             filters=self.filters, tenant=self.tenant,
                             repeat=self.repeat if self.mode != "none" else None)
