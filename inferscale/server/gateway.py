"""The server's only way into the memory service and the composer.

The memory service is synchronous (SQLite, faiss, the torch encoder, the embedder), so every call
runs in a worker thread: the event loop never waits for encoding. Reads (chat retrieval and
composition, search, list, get) and writes (which encode KV) run on **separate thread pools**, so
however many writes are in progress a chat or a read finds a thread. The service itself serialises
writes per user and lets reads proceed during writes (one SQLite connection per thread), so tenant
B never waits for tenant A's add.

Every prompt is salted for vLLM's prefix cache: memory prompts by the composer (per user,
incarnation and version), prompts without memory per tenant and user, so no request can observe
(through `cached_tokens` or timing) what another tenant's prompts contained.

Exceptions come out as `APIError`s: unknown user or fact -> 404, bad input -> 400.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from inferscale.server.errors import APIError, bad_request, from_memory_error, not_found


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
    policy: str | None = None  # the recovery policy that served it (mode "inject")


def public_fact(f) -> dict:
    d = asdict(f)
    d["id"] = d.pop("fact_id")
    if d.get("score") is None:
        d.pop("score", None)
    return d


def default_fact_id(text: str) -> str:
    return "f" + hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


class MemoryGateway:
    def __init__(self, composer, read_threads: int = 8, write_threads: int = 4) -> None:
        self.composer = composer
        self.memory = composer.memory
        self._reads = ThreadPoolExecutor(read_threads, thread_name_prefix="inferscale-read")
        self._writes = ThreadPoolExecutor(write_threads, thread_name_prefix="inferscale-write")

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)

    # -- plumbing ------------------------------------------------------------------------------
    async def _on(self, pool: ThreadPoolExecutor, fn: Callable, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            raise from_memory_error(e) from None

    async def run(self, fn: Callable, *args):
        """A read (never waits for a write's thread)."""
        return await self._on(self._reads, fn, *args)

    async def write(self, fn: Callable, *args):
        """A write (encodes KV; serialised per user by the memory service)."""
        return await self._on(self._writes, fn, *args)

    # -- memory operations ---------------------------------------------------------------------
    async def users(self, tenant: str) -> list[str]:
        from inferscale.server.auth import Tenancy

        uids = await self.run(self.memory.catalog.users)
        return sorted(u for u in (Tenancy.public_user(tenant, uid) for uid in uids) if u is not None)

    async def add(self, uid: str, facts: Sequence[dict], turns: Sequence[dict]) -> dict:
        from inferscale.common.facts import Fact, Turn

        if not facts and not turns:
            raise bad_request("add needs at least one fact or turn", "facts")
        try:
            fs = [Fact(f.get("id") or default_fact_id(f["text"]), f["text"], f.get("source_turn"), f.get("date"))
                  for f in facts]
            ts = [Turn(t["id"], t["speaker"], t["text"], t["session"], t.get("date")) for t in turns]
        except ValueError as e:
            raise bad_request(str(e)) from None

        def do():
            from inferscale.memory.service import AddInterrupted

            try:
                added = self.memory.add(uid, facts=fs, turns=ts)
            except AddInterrupted as e:  # the batches before the failure stay committed: say which
                raise APIError(500, f"{e}; committed: {', '.join(e.added)}", code="add_interrupted") from None
            return {"added": added, "version": self.memory.version(uid)}

        return await self.write(do)

    async def list(self, uid: str) -> dict:
        def do():
            return {"version": self.memory.version(uid), "facts": [public_fact(f) for f in self.memory.list(uid)]}

        return await self.run(do)

    async def get(self, uid: str, fact_id: str) -> dict:
        return public_fact(await self.run(self.memory.get, uid, fact_id))

    async def update(self, uid: str, fact_id: str, text: str) -> dict:
        return public_fact(await self.write(self.memory.update, uid, fact_id, text))

    async def delete(self, uid: str, fact_id: str, keep_history: bool = False) -> None:
        await self.write(self.memory.delete, uid, fact_id, keep_history)

    async def delete_user(self, uid: str) -> None:
        await self.write(self.memory.delete_user, uid)

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

        return await self.write(do)

    # -- chat ----------------------------------------------------------------------------------
    async def prepare_chat(self, tenant: str, uid: str | None, question: str, mode: str, k: int,
                           fact_ids: list[str] | None, max_tokens: int, sampling: dict,
                           policy: str | None = None) -> Prepared:
        return await self.run(self._prepare, tenant, uid, question, mode, k, fact_ids, max_tokens, sampling, policy)

    def _prepare(self, tenant, uid, question, mode, k, fact_ids, max_tokens, sampling, policy=None) -> Prepared:
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
            salt = c.scope_salt(uid if uid is not None else f"{tenant}:")  # uid is "<tenant>:<user>"
            return Prepared(TokensPrompt(prompt_token_ids=ids, cache_salt=salt), params, "none", [], len(ids), 0,
                            {"search": 0.0, "compose": time.perf_counter() - t1})
        if fact_ids is None:
            hits = self.memory.search(uid, question, k)
            facts = [{"id": h.fact_id, "text": h.text, "score": h.score} for h in hits]
        else:
            facts = [{"id": f.fact_id, "text": f.text} for f in (self.memory.get(uid, fid) for fid in fact_ids)]
        t1 = time.perf_counter()
        # the composer salts text mode apart from injected KV (see MemoryComposer.salt)
        policy = policy if mode == "inject" else None
        prompt, params, layout, plan = c.build_request(uid, question, [f["id"] for f in facts], mode, max_tokens,
                                                       None, policy=policy, **sampling)
        room = limit - len(layout)
        if room < 1:
            raise bad_request(f"the prompt ({len(layout)} tokens with {len(facts)} facts) fills the model's context "
                              f"of {limit} tokens; retrieve fewer facts", "memory.k")
        params.max_tokens = min(max_tokens, room)
        t2 = time.perf_counter()
        return Prepared(prompt, params, mode, facts, len(layout), plan.end if mode == "inject" else 0,
                        {"search": t1 - t0, "compose": t2 - t1}, policy)


__all__ = ["MemoryGateway", "Prepared", "APIError"]
