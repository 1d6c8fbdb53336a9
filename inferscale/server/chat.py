"""`POST /v1/chat/completions`: the OpenAI chat API, answered with the user's memory.

The prompt is InferScale's layout, `[header][fact_1]...[fact_k][footer][question]`:

- `user` selects the memory (the tenant's user; no `user`: no memory). Unknown user: 404. The
  `X-User-ID` header may name it instead (what a user-affinity proxy routes by); both: they must agree.
- the question is the **last user message**. Earlier messages (system prompts, earlier turns,
  assistant replies) are not sent to the model: the memory stands in for the conversation's
  history. To keep something from them, add it to the memory (`POST /v1/memories/{user}`).
- `memory` (an extra body field; the openai client sends it with `extra_body`):
  `{"enabled": true, "k": 10, "mode": "inject" | "text", "fact_ids": [...], "policy": "last:2"}`.
  `policy` (mode inject; default the server's `default_policy`): `none`, `last:N` (vLLM prefills the
  last N facts too, attending to every injected one) or `all`. `auto` (the default `default_mode`)
  asks the model's calibration (`inferscale calibrate`) for k: inject with the cheapest policy that
  came within the tolerance of text, else text (also when the model is not calibrated); the answer
  says which (`mode`, `policy`) and why (`gate`). `inject`
  injects the retrieved facts' KV and prefills only footer + question; `text` prefills the same
  facts as prompt text (the baseline); `fact_ids` skips the search and uses exactly those facts.
- honoured: `max_tokens` / `max_completion_tokens` (capped by the context left), `temperature`
  (default 0: greedy), `top_p`, `stop` (up to 4), `seed`, `presence_penalty`,
  `frequency_penalty`, `stream`, `stream_options.include_usage`. `n` must be 1; tools, response
  formats and logprobs are refused (400); other OpenAI fields are ignored.
- the answer carries `"inferscale": {"user", "mode", "k", "facts": [{id, text, score}],
  "injected_tokens", "prompt_tokens", "cached_tokens", "timings"}` (streaming: in the first chunk,
  and complete in the last chunk).

Load behaviour: an admission slot is taken first (none free and the queue full: 429); the whole
request (queue, retrieval, generation) has `request_timeout_s` (then 504, or an error event if the
stream has started, and the engine request is aborted); a client that goes away cancels its
request (aborted in vLLM) whether it streams or not. Every other failure once the request was
handed to vLLM also aborts it: no path leaves an unfinished engine request behind.
The question is at most `max_query_chars` characters (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferscale.server.admission import Overloaded
from inferscale.server.auth import Tenancy, tenant_of
from inferscale.server.errors import (
    APIError,
    bad_request,
    error_body,
    is_client_error,
    not_found,
)
from inferscale.server.schemas import UNSUPPORTED, ChatCompletionRequest, MemoryOptions
from inferscale.serving.composer import served_policy
from inferscale.serving.prepare import Prepared, PrepareRequest

log = logging.getLogger("inferscale.server")
router = APIRouter()


class ClientGone(Exception):
    pass


# The header a user-affinity proxy hashes (vLLM's router `consistent_hash` reads it; the HAProxy and
# nginx configs in deploy/ hash it): it names the request's user when the body has none.
USER_HEADER = "X-User-ID"


# -- request options ---------------------------------------------------------------------------
class Options:
    def __init__(self, st, body: ChatCompletionRequest, tenant: str, header_user: str | None = None) -> None:
        cfg = st.config
        if body.model is not None and body.model != st.model_name:
            raise not_found(f"model {body.model!r} does not exist; this server serves {st.model_name!r}", "model")
        extra = body.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, False, [], {}):
                raise bad_request(f"{name} is not supported by this server", name)
        if body.n not in (None, 1):
            raise bad_request("n must be 1", "n")
        user_msgs = [m for m in body.messages if m.role == "user"]
        if not user_msgs:
            raise bad_request("messages must contain a user message (the question)", "messages")
        self.question = user_msgs[-1].text().strip()
        if not self.question:
            raise bad_request("the last user message has no text", "messages")
        if len(self.question) > cfg.max_query_chars:
            raise bad_request(f"the question (the last user message) has {len(self.question)} characters; the "
                              f"limit is {cfg.max_query_chars} (max_query_chars)", "messages")
        mem = body.memory or MemoryOptions()
        self.k = cfg.default_k if mem.k is None else mem.k
        if self.k > cfg.max_k:
            raise bad_request(f"memory.k must be <= {cfg.max_k}, got {self.k}", "memory.k")
        self.fact_ids = mem.fact_ids
        if self.fact_ids is not None:
            if len(self.fact_ids) > cfg.max_k:
                raise bad_request(f"memory.fact_ids holds more than {cfg.max_k} facts", "memory.fact_ids")
            self.k = len(self.fact_ids)
        if header_user is not None and body.user is not None and header_user != body.user:
            raise bad_request(f"the {USER_HEADER} header ({header_user!r}) and the body's user ({body.user!r}) differ",
                              "user")
        self.user = body.user if body.user is not None else header_user
        self.tenant = tenant
        self.uid = Tenancy.internal_user(tenant, self.user) if self.user is not None else None
        enabled = mem.enabled and self.uid is not None and (self.k > 0 or self.fact_ids is not None)
        self.mode = (mem.mode or cfg.default_mode) if enabled else "none"  # as requested: the gate runs in prepare
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

        self.sampling: dict[str, Any] = {"temperature": 0.0 if body.temperature is None else body.temperature,
                                         "output_kind": RequestOutputKind.DELTA}
        for name in ("top_p", "seed", "presence_penalty", "frequency_penalty"):
            if getattr(body, name) is not None:
                self.sampling[name] = getattr(body, name)
        if stop:
            self.sampling["stop"] = stop
        self.stream = body.stream
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def prepare_request(self) -> PrepareRequest:
        """What the gateway composes for this request (`serving.prepare`)."""
        return PrepareRequest(self.tenant, self.uid, self.question, self.mode, self.k, self.max_tokens,
                              self.fact_ids, self.policy, dict(self.sampling))


# -- racing a coroutine against the deadline and the client ------------------------------------
async def _wait_disconnect(receive: Callable) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _guard(receive: Callable, coro, deadline: float, on_orphan: Callable[[Any], None] | None = None):
    """Run `coro` until it finishes, the deadline passes (TimeoutError) or the client disconnects
    (ClientGone); in the last two cases `coro` is cancelled (vLLM aborts what it started)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=max(deadline - loop.time(), 0.0),
                                     return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except BaseException:  # noqa: BLE001 - cancelled (or failed) as intended
        pass
    else:
        if on_orphan is not None:
            on_orphan(result)
    if watcher in done:
        raise ClientGone()
    watcher.cancel()
    raise TimeoutError()


# -- the engine ----------------------------------------------------------------------------------
class Run:
    """One request in the engine: outputs until finished, with TTFT bookkeeping and the deadline."""

    def __init__(self, st, prep: Prepared, rid: str, t0: float, queue_s: float, deadline: float) -> None:
        self.st, self.prep, self.rid, self.t0, self.queue_s, self.deadline = st, prep, rid, t0, queue_s, deadline
        self.submitted = 0.0
        self.first = 0.0
        self.cached = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def outputs(self) -> AsyncIterator:
        self.submitted = time.perf_counter()
        gen = self.st.engine.generate(self.prep.prompt, self.prep.params, self.rid)
        try:
            while True:
                # Awaited in this task, not through asyncio.wait_for: on Python 3.11 wait_for
                # swallows a cancellation that lands as the output arrives, and the request would
                # then run to max_tokens after its client had gone. The timeout covers only the
                # wait for the engine, never the consumer's time at the `yield`.
                try:
                    async with asyncio.timeout_at(self.deadline):
                        out = await anext(gen)
                except StopAsyncIteration:
                    return
                self._account(out)
                yield out
                if out.finished:
                    return
        finally:
            await gen.aclose()

    def _account(self, out) -> None:
        c = out.outputs[0] if out.outputs else None
        if c is not None:
            self.completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
        if not self.first and c is not None and c.token_ids:
            self.first = time.perf_counter()
            self.cached = int(out.num_cached_tokens or 0)
            m, p = self.st.metrics, self.prep
            m.observe_first_token(p.mode, {"queue": self.queue_s, "search": p.timings["search"],
                                           "compose": p.timings["compose"], "engine": self.first - self.submitted,
                                           "total": self.first - self.t0})
        if out.finished:
            if out.num_cached_tokens is not None:  # a remote vLLM reports it with its final usage
                self.cached = int(out.num_cached_tokens)
            self.st.metrics.observe_prompt(self.prep.injected_tokens, self.prep.prompt_tokens, self.cached)
            self.st.metrics.generated_tokens.inc(self.completion_tokens)
            self.st.metrics.answers.labels(self.prep.mode, self.prep.policy or "-").inc()

    def info(self, opts: Options, final: bool) -> dict:
        p = self.prep
        d = {"user": opts.user, "mode": p.mode, "policy": p.policy, "gate": p.why,
             "k": opts.k if p.mode != "none" else 0, "facts": p.facts,
             "injected_tokens": p.injected_tokens, "prompt_tokens": p.prompt_tokens}
        if final:
            now = time.perf_counter()
            d["cached_tokens"] = self.cached
            d["timings"] = {"queue_s": self.queue_s, "search_s": p.timings["search"],
                            "compose_s": p.timings["compose"],
                            "engine_ttft_s": (self.first - self.submitted) if self.first else None,
                            "ttft_s": (self.first - self.t0) if self.first else None, "total_s": now - self.t0}
        return d

    def usage(self) -> dict:
        return {"prompt_tokens": self.prep.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prep.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.st.engine.abort(self.rid)


def _engine_error(e: BaseException) -> APIError:
    if is_client_error(e) or isinstance(e, ValueError):
        return bad_request(str(e))
    name = type(e).__name__
    if name == "EngineDeadError":
        return APIError(503, "the engine has stopped", code="engine_dead")
    log.error("engine request failed: %r", e)
    return APIError(500, f"the engine failed: {name}", code="engine_error")


# -- streaming -----------------------------------------------------------------------------------
class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and abort the engine request) as soon as the client goes,
    and always call `on_close` (which releases the admission slot)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[bool], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        gone = False
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, pending = await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
            gone = watch in done and stream not in done
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(BaseException):
                    await t
            if stream in done and stream.exception() is not None and not isinstance(stream.exception(), OSError):
                raise stream.exception()
        finally:
            stream.cancel()
            watch.cancel()
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()  # a generator cancelled at a yield is closed now, not at GC
            self._on_close(gone)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(st, run: Run, opts: Options) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": run.rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    yield _sse(chunk({"role": "assistant", "content": ""}, inferscale=run.info(opts, final=False)))
    try:
        async for out in run.outputs():
            text = out.outputs[0].text if out.outputs else ""
            if text:
                yield _sse(chunk({"content": text}))
    except TimeoutError:
        st.metrics.rejected.labels("timeout").inc()
        await run.abort()
        yield _sse(error_body(504, f"request timed out after {st.config.request_timeout_s:g} s", code="timeout"))
        return
    except Exception as e:  # noqa: BLE001 - reported in the stream
        await run.abort()  # vLLM leaves a request it failed to submit in its tables
        err = _engine_error(e)
        yield _sse(err.body())
        return
    yield _sse(chunk({}, run.finish_reason or "stop", inferscale=run.info(opts, final=True)))
    if opts.include_usage:
        yield _sse({"id": run.rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                    "choices": [], "usage": run.usage()})
    yield "data: [DONE]\n\n"


# -- the route -------------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str = Depends(tenant_of)):
    st = request.app.state.inferscale
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    deadline = loop.time() + st.config.request_timeout_s
    opts = Options(st, body, tenant, request.headers.get(USER_HEADER))
    rid = f"chatcmpl-{uuid.uuid4().hex}"

    async def admit_and_prepare():
        tq = time.perf_counter()
        slot = await st.admission.acquire()
        queue_s = time.perf_counter() - tq
        try:
            prep = await st.gateway.prepare_chat(opts.prepare_request())
        except BaseException:
            slot.release()
            raise
        return slot, prep, queue_s

    try:
        slot, prep, queue_s = await _guard(request.receive, admit_and_prepare(), deadline,
                                           on_orphan=lambda r: r[0].release())
    except Overloaded as e:
        st.metrics.rejected.labels("overload").inc()
        raise APIError(429, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
    except TimeoutError:
        st.metrics.rejected.labels("timeout").inc()
        raise APIError(504, f"request timed out after {st.config.request_timeout_s:g} s (waiting for a slot "
                            "or retrieving memory)", code="timeout") from None
    except ClientGone:
        st.metrics.rejected.labels("disconnect").inc()
        return Response(status_code=499)

    run = Run(st, prep, rid, t0, queue_s, deadline)
    if opts.stream:
        def on_close(gone: bool) -> None:
            slot.release()
            if gone:
                st.metrics.rejected.labels("disconnect").inc()

        return SSEResponse(_stream(st, run, opts), on_close)

    async def collect() -> str:
        parts = []
        async for out in run.outputs():
            if out.outputs:
                parts.append(out.outputs[0].text)
        return "".join(parts)

    try:
        text = await _guard(request.receive, collect(), deadline)
    except TimeoutError:
        st.metrics.rejected.labels("timeout").inc()
        await run.abort()
        raise APIError(504, f"request timed out after {st.config.request_timeout_s:g} s", code="timeout") from None
    except ClientGone:
        st.metrics.rejected.labels("disconnect").inc()
        await run.abort()
        return Response(status_code=499)
    except APIError:
        await run.abort()
        raise
    except Exception as e:  # noqa: BLE001
        await run.abort()  # vLLM leaves a request it failed to submit in its tables
        raise _engine_error(e) from None
    finally:
        slot.release()
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": st.model_name,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": run.finish_reason or "stop"}],
        "usage": run.usage(),
        "inferscale": run.info(opts, final=True),
    })
