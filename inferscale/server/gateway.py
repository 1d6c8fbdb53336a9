"""The server's only way into the memory service and the composer.

The memory service is synchronous (SQLite, faiss, the torch encoder, the embedder), so every call
runs in a worker thread (`asyncio.to_thread`): the event loop never waits for encoding. Calls are
serialised by one lock, because the service shares one SQLite connection between threads and its
read snapshots and write transactions must not interleave on it; a chat request's retrieval
therefore waits while a write (which encodes KV) is in progress, but the engine keeps serving
requests already admitted.

Exceptions come out as `APIError`s: unknown user or fact -> 404, bad input -> 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from .errors import APIError, bad_request, from_memory_error, not_found


@dataclass
class Prepared:
    """One chat request, ready for the engine."""

    prompt: Any  # vllm TokensPrompt
    params: Any  # vllm SamplingParams
    mode: str  # inject | text | none
    facts: list[dict]  # [{id, text, score}] in prompt order
    prompt_tokens: int
    injected_tokens: int  # memory tokens planned for injection (0 unless mode == "inject")
    timings: dict[str, float] = field(default_factory=dict)


def public_fact(f) -> dict:
    d = asdict(f)
    d["id"] = d.pop("fact_id")
    if d.get("score") is None:
        d.pop("score", None)
    return d


def default_fact_id(text: str) -> str:
    return "f" + hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


class MemoryGateway:
    def __init__(self, composer) -> None:
        self.composer = composer
        self.memory = composer.memory
        self._lock = threading.Lock()

    # -- plumbing ------------------------------------------------------------------------------
    def _locked(self, fn: Callable, *args, **kwargs):
        with self._lock:
            return fn(*args, **kwargs)

    async def run(self, fn: Callable, *args, **kwargs):
        try:
            return await asyncio.to_thread(self._locked, fn, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            raise from_memory_error(e) from None

    # -- memory operations ---------------------------------------------------------------------
    async def users(self, tenant: str) -> list[str]:
        from .auth import Tenancy

        uids = await self.run(self.memory.catalog.users)
        return sorted(u for u in (Tenancy.public_user(tenant, uid) for uid in uids) if u is not None)

    async def add(self, uid: str, facts: Sequence[dict], turns: Sequence[dict]) -> dict:
        from inferscale.common.memory import Fact, Turn

        if not facts and not turns:
            raise bad_request("add needs at least one fact or turn", "facts")
        try:
            fs = [Fact(f.get("id") or default_fact_id(f["text"]), f["text"], f.get("source_turn"), f.get("date"))
                  for f in facts]
            ts = [Turn(t["id"], t["speaker"], t["text"], t["session"], t.get("date")) for t in turns]
        except ValueError as e:
            raise bad_request(str(e)) from None

        def do():
            added = self.memory.add(uid, facts=fs, turns=ts)
            return {"added": added, "version": self.memory.version(uid)}

        return await self.run(do)

    async def list(self, uid: str) -> dict:
        def do():
            return {"version": self.memory.version(uid), "facts": [public_fact(f) for f in self.memory.list(uid)]}

        return await self.run(do)

    async def get(self, uid: str, fact_id: str) -> dict:
        return public_fact(await self.run(self.memory.get, uid, fact_id))

    async def update(self, uid: str, fact_id: str, text: str) -> dict:
        return public_fact(await self.run(self.memory.update, uid, fact_id, text))

    async def delete(self, uid: str, fact_id: str) -> None:
        await self.run(self.memory.delete, uid, fact_id)

    async def delete_user(self, uid: str) -> None:
        await self.run(self.memory.delete_user, uid)

    async def history(self, uid: str, fact_id: str) -> list[dict]:
        return await self.run(self.memory.history, uid, fact_id)

    async def search(self, uid: str, query: str, k: int) -> list[dict]:
        return [public_fact(f) for f in await self.run(self.memory.search, uid, query, k)]

    async def change_turn(self, uid: str, turn_id: str, text: str | None) -> list[str]:
        def do():
            self.memory.version(uid)  # 404 for an unknown user
            row = self.memory.catalog.turn(uid, turn_id)
            if row is None or row.text is None:
                raise not_found(f"user has no turn {turn_id!r}", "turn_id")
            if text is None:
                return self.memory.delete_turn(uid, turn_id)
            return self.memory.update_turn(uid, turn_id, text)

        return await self.run(do)

    # -- chat ----------------------------------------------------------------------------------
    async def prepare_chat(self, uid: str | None, question: str, mode: str, k: int, fact_ids: list[str] | None,
                           max_tokens: int, sampling: dict) -> Prepared:
        return await self.run(self._prepare, uid, question, mode, k, fact_ids, max_tokens, sampling)

    def _prepare(self, uid, question, mode, k, fact_ids, max_tokens, sampling) -> Prepared:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        c = self.composer
        limit = c.config.max_model_len
        t0 = time.perf_counter()
        if uid is None or mode == "none" or (k == 0 and fact_ids is None):
            t1 = time.perf_counter()
            ids = c.builder.layout([], c.builder.question_ids(question)).token_ids  # ValueError: too long -> 400
            room = limit - len(ids)
            if room < 1:
                raise bad_request(f"the prompt fills the model's context of {limit} tokens", "messages")
            params = SamplingParams(max_tokens=min(max_tokens, room), **sampling)
            return Prepared(TokensPrompt(prompt_token_ids=ids), params, "none", [], len(ids), 0,
                            {"search": 0.0, "compose": time.perf_counter() - t1})
        if fact_ids is None:
            hits = self.memory.search(uid, question, k)
            facts = [{"id": h.fact_id, "text": h.text, "score": h.score} for h in hits]
        else:
            facts = [{"id": f.fact_id, "text": f.text} for f in (self.memory.get(uid, fid) for fid in fact_ids)]
        t1 = time.perf_counter()
        # the composer salts text mode apart from injected KV (see MemoryComposer.salt)
        prompt, params, layout, plan = c.build_request(uid, question, [f["id"] for f in facts], mode, max_tokens,
                                                       None, **sampling)
        room = limit - len(layout)
        if room < 1:
            raise bad_request(f"the prompt ({len(layout)} tokens with {len(facts)} facts) fills the model's context "
                              f"of {limit} tokens; retrieve fewer facts", "memory.k")
        params.max_tokens = min(max_tokens, room)
        t2 = time.perf_counter()
        return Prepared(prompt, params, mode, facts, len(layout), plan.end if mode == "inject" else 0,
                        {"search": t1 - t0, "compose": t2 - t1})


__all__ = ["MemoryGateway", "Prepared", "APIError"]
