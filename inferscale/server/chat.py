"""`POST /v1/chat/completions`: the OpenAI chat API, answered with the user's memory.

The prompt is InferScale's chat layout, `[header][fact_1]...[fact_k][the conversation]`:

- `user` selects the memory (the tenant's user; no `user`: no memory). Unknown user: 404. The
  `X-User-ID` header may name it instead (what a user-affinity proxy routes by); both: they must agree.
- **every message reaches the model**, rendered with the model's chat template after the memory:
  the memory opens the first system turn, the request's system (and developer) prompts follow it
  in that turn, then the earlier user and assistant turns and tool results (as text) and the new
  message. The memory is searched with the new message (the last one, the user's or a tool's).
  The memory stays a prefix of the prompt, so its KV is injected; everything after it is
  prefilled, so the prefill grows with the chat's length (as without memory). Without memory
  (`memory.enabled: false`, no user, k = 0) the messages are rendered by the chat template alone,
  as vLLM's own chat endpoint renders them.
- when the messages and the memory leave no room to answer in the model's context, the oldest
  turns go first (system prompts stay), then the last facts (the least relevant); the answer says
  what went (`inferscale.dropped`: `{"turns": n, "facts": m}`). A new message that alone leaves no
  room: 400.
- `memory` (an extra body field; the openai client sends it with `extra_body`):
  `{"enabled": true, "k": 10, "mode": "inject" | "text", "fact_ids": [...], "policy": "last:2"}`.
  `policy` (mode inject; default the server's `default_policy`): `none`, `last:N` (vLLM prefills the
  last N facts too, attending to every injected one) or `all`. `auto` (the default `default_mode`)
  asks the model's calibration (`inferscale calibrate`) for k: inject with the cheapest policy that
  came within the tolerance of text, else text (also when the model is not calibrated); the answer
  says which (`mode`, `policy`) and why (`gate`). `inject`
  injects the retrieved facts' KV and prefills only the conversation; `text` prefills the same
  facts as prompt text (the baseline); `fact_ids` skips the search and uses exactly those facts.
- honoured: `max_tokens` / `max_completion_tokens` (capped by the context left), `temperature`
  (default 0: greedy), `top_p`, `stop` (up to 4), `seed`, `presence_penalty`,
  `frequency_penalty`, `stream`, `stream_options.include_usage`, `n` (up to 16 choices, sampled:
  without a temperature, n > 1 takes OpenAI's default of 1),
  `logprobs` / `top_logprobs` (up to 20), `response_format` (`json_object`, `json_schema`: vLLM's
  structured outputs, so the answer is valid JSON of the schema), all with memory injected as
  usual. Tools and the other fields that would change the answer are refused (400 naming the
  field); the rest of OpenAI's fields are ignored.
- the answer carries `"inferscale": {"user", "mode", "k", "facts": [{id, text, score}],
  "injected_tokens", "prompt_tokens", "cached_tokens", "timings"}` (streaming: in the first chunk,
  and complete in the last chunk).

Load behaviour: an admission slot is taken first (none free and the queue full: 429); the whole
request (queue, retrieval, generation) has `request_timeout_s` (then 504, or an error event if the
stream has started, and the engine request is aborted); a client that goes away cancels its
request (aborted in vLLM) whether it streams or not. Every other failure once the request was
handed to vLLM also aborts it: no path leaves an unfinished engine request behind.
The new message is at most `max_query_chars` characters (400).
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
from starlette.background import BackgroundTask

from inferscale.memory.jobs import job_id
from inferscale.server.admission import Overloaded
from inferscale.server.auth import tenant_of
from inferscale.server.chat_options import USER_HEADER, Options
from inferscale.server.choices import Choices
from inferscale.server.errors import (
    APIError,
    bad_request,
    error_body,
    is_client_error,
)
from inferscale.server.schemas import ChatCompletionRequest
from inferscale.serving.request import Prepared

log = logging.getLogger("inferscale.server")
router = APIRouter()


class ClientGone(Exception):
    pass


# -- remembering the exchange (memory.remember) ------------------------------------------------
def _exchange(opts: Options, rid: str, answer: str) -> list[dict]:
    """The new message and the answer, as messages to remember (ids from the request id)."""
    date = time.strftime("%-d %B %Y", time.gmtime())
    return [{"id": f"{rid}-q", "role": "user", "content": opts.question, "date": date},
            {"id": f"{rid}-a", "role": "assistant", "content": answer, "date": date}]


async def _remember(st, opts: Options, rid: str, answer: str) -> None:
    """After the answer is sent: store the exchange and queue the extraction of its facts."""
    try:
        await st.gateway.remember(opts.uid, _exchange(opts, rid, answer))
    except Exception as e:  # noqa: BLE001 - the answer went out; say why nothing was remembered
        log.warning("request %s: the exchange was not remembered: %s", rid, e)


_REMEMBERING: set = set()  # the streamed answers' remember tasks, held until they finish


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

    def __init__(self, st, prep: Prepared, rid: str, t0: float, queue_s: float, deadline: float,
                 top_logprobs: int | None = None) -> None:
        self.st, self.prep, self.rid, self.t0, self.queue_s, self.deadline = st, prep, rid, t0, queue_s, deadline
        self.submitted = 0.0
        self.first = 0.0
        self.cached = 0
        self.choices = Choices(getattr(prep.params, "n", 1), top_logprobs)

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
                deltas = self._account(out)
                yield deltas
                if out.finished:
                    return
        finally:
            await gen.aclose()

    def _account(self, out) -> list[tuple[int, str, list[dict] | None]]:
        """Bookkeeping of one engine output; what each choice gained (`Choices.add`)."""
        deltas = self.choices.add(out.outputs or ())
        if not self.first and any(c.token_ids for c in out.outputs or ()):
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
            self.st.metrics.generated_tokens.inc(self.choices.completion_tokens)
            self.st.metrics.answers.labels(self.prep.mode, self.prep.policy or "-").inc()
        return deltas

    def info(self, opts: Options, final: bool) -> dict:
        p = self.prep
        d = {"user": opts.user, "mode": p.mode, "policy": p.policy, "gate": p.why if opts.mode == "auto" else None,
             "k": 0 if p.mode == "none" else "all" if p.chain is not None else opts.k, "facts": p.facts,
             "injected_tokens": p.injected_tokens, "prompt_tokens": p.prompt_tokens}
        if p.chain is not None:  # the whole memory's chain facts, and how many came from stored links
            d["chain"] = dict(p.chain)
        if p.repeated:  # the most relevant facts, repeated as text after the whole memory
            d["repeated"] = list(p.repeated)
        if any(p.dropped.values()):  # left out so that the prompt fits the model's context
            d["dropped"] = dict(p.dropped)
        if opts.remember:  # the job that will store and extract the exchange once the answer is sent
            d["remember"] = {"job": job_id(opts.uid, [f"{self.rid}-q", f"{self.rid}-a"])}
        if final:
            now = time.perf_counter()
            d["cached_tokens"] = self.cached
            d["timings"] = {"queue_s": self.queue_s, "search_s": p.timings["search"],
                            "compose_s": p.timings["compose"],
                            "engine_ttft_s": (self.first - self.submitted) if self.first else None,
                            "ttft_s": (self.first - self.t0) if self.first else None, "total_s": now - self.t0}
        return d

    def usage(self) -> dict:
        n = self.choices.completion_tokens
        return {"prompt_tokens": self.prep.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prep.prompt_tokens + n,
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

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": run.rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "system_fingerprint": None, "choices": choices, **extra}

    c = run.choices
    yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None} for i in range(c.n)], inferscale=run.info(opts, final=False)))
    try:
        async for deltas in run.outputs():
            for i, text, content in deltas:
                if text or content:
                    yield _sse(chunk([{"index": i, "delta": {"content": text}, "logprobs": c.logprobs_of(content),
                                       "finish_reason": None}]))
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
    yield _sse(chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason(i)}
                      for i in range(c.n)], inferscale=run.info(opts, final=True)))
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

    run = Run(st, prep, rid, t0, queue_s, deadline, opts.top_logprobs)
    if opts.stream:
        def on_close(gone: bool) -> None:
            slot.release()
            if gone:
                st.metrics.rejected.labels("disconnect").inc()
            elif opts.remember:
                task = loop.create_task(_remember(st, opts, rid, run.choices.message_choices()[0]["message"]["content"]))
                _REMEMBERING.add(task)
                task.add_done_callback(_REMEMBERING.discard)

        return SSEResponse(_stream(st, run, opts), on_close)

    async def collect() -> None:
        async for _ in run.outputs():
            pass

    try:
        await _guard(request.receive, collect(), deadline)
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
    choices = run.choices.message_choices()
    after = BackgroundTask(_remember, st, opts, rid, choices[0]["message"]["content"]) if opts.remember else None
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": st.model_name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": run.usage(),
        "inferscale": run.info(opts, final=True),
    }, background=after)
