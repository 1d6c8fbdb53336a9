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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable, Sequence

from inferscale.common.facts import Fact, Turn
from inferscale.common.metadata import TIME_FIELDS, iso, to_epoch
from inferscale.server.auth import Tenancy
from inferscale.server.errors import APIError, bad_request, from_memory_error, not_found
from inferscale.server.tenant_quotas import TenantQuotas, sweep_forever
from inferscale.serving.composer import ContextFull
from inferscale.serving.prepare import prepare
from inferscale.serving.request import MemoryRequest, Prepared


def public_fact(f) -> dict:
    """A `MemoryFact` as the API shows it: times as ISO 8601."""
    d = asdict(f)
    d["id"] = d.pop("fact_id")
    if d.get("score") is None:
        d.pop("score", None)
    for name in TIME_FIELDS:
        d[name] = iso(d[name])
    return d


def fact_of_request(f: dict) -> Fact:
    """A `FactIn` body as a `Fact` (ValueError naming what is wrong)."""
    expires = f.get("expires_at")
    return Fact(f.get("id") or default_fact_id(f["text"]), f["text"], f.get("source_turn"), f.get("date"),
                f.get("metadata") or {}, None if expires is None else to_epoch(expires, "expires_at"))


def turn_of_request(t: dict) -> Turn:
    """A `TurnIn` body as a `Turn` (ValueError naming what is wrong)."""
    return Turn(t["id"], t["speaker"], t["text"], t["session"], t.get("date"))


def default_fact_id(text: str) -> str:
    return "f" + hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:16]


class MemoryGateway:
    def __init__(self, composer, read_threads: int = 8, write_threads: int = 4,
                 quotas: TenantQuotas | None = None) -> None:
        self.composer = composer
        self.memory = composer.memory
        self._chain = getattr(composer, "chain", None)  # a composer serving no engine keeps no chain
        self.quotas = quotas or TenantQuotas({})
        self._sweeper: asyncio.Task | None = None
        self._reads = ThreadPoolExecutor(read_threads, thread_name_prefix="inferscale-read")
        self._writes = ThreadPoolExecutor(write_threads, thread_name_prefix="inferscale-write")
        self.jobs = self._extraction_llm = None
        self._extraction_started = False

    def attach_extraction(self, engine, url: str = "", model: str = "", api_key_env: str = "OPENAI_API_KEY") -> None:
        """Facts extracted from added messages in the background (`inferscale.memory.jobs`): by the
        served model through `engine` (the server's own), or by the OpenAI-compatible endpoint at
        `url` (its /v1 root) serving `model`; started with the server's event loop."""
        from inferscale.memory.extraction import Extractor
        from inferscale.memory.extraction_llms import AsyncEngineJsonLLM, OpenAIJsonLLM
        from inferscale.memory.jobs import ExtractionJobs

        if url:
            self._extraction_llm = OpenAIJsonLLM(url, model, api_key_env)
        else:
            self._extraction_llm = AsyncEngineJsonLLM(self.composer, engine)
        self.jobs = ExtractionJobs(self.memory, Extractor(self.memory, self._extraction_llm,
                                                         quota_of=self.quotas.memory_quota), start=False)

    def start_extraction(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the jobs on `loop` (idempotent): what a stop left unfinished is resumed."""
        if self.jobs is not None and not self._extraction_started:
            self._extraction_started = True
            if hasattr(self._extraction_llm, "loop"):  # the served model: its requests run on the server's loop
                self._extraction_llm.loop = loop
            self.jobs.resume()
            self.jobs.start()

    def start_sweeper(self, interval_s: float) -> None:
        """Forget expired facts every `interval_s` seconds on this loop (0: never; idempotent)."""
        if interval_s > 0 and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(sweep_forever(self, interval_s))

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.jobs is not None:
            self.jobs.close()
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
        if self._chain is not None:
            self._chain.close()  # an extension in flight finishes: it writes only whole links

    def chain_stats(self) -> dict[str, int]:
        """The memory chain's counters (`memory.chain.MemoryChain.stats`; none for a memory-only composer)."""
        return dict(self._chain.stats) if self._chain is not None else {}

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
    async def users(self, tenant: str, limit: int = 100, cursor: str | None = None) -> dict:
        """A page of the tenant's users, and what the tenant holds against its quotas."""
        prefix = Tenancy.scope(tenant)

        def do():
            page = self.memory.users_page(prefix, limit, cursor)
            facts, kv_bytes = self.memory.usage(prefix)
            return page, {"facts": facts, "kv_bytes": kv_bytes}

        page, usage = await self.run(do)
        usage["in_flight"] = self.quotas.in_flight[tenant]
        return {"users": [Tenancy.public_user(tenant, u) for u in page.items], "next_cursor": page.next_cursor,
                "usage": {**usage, "limits": self.quotas.of(tenant)}}

    async def add(self, uid: str, facts: Sequence[dict], turns: Sequence[dict]) -> dict:
        if not facts and not turns:
            raise bad_request("add needs at least one fact or turn", "facts")
        fs, ts = [], []
        for where, items, make, out in (("facts", facts, fact_of_request, fs), ("turns", turns, turn_of_request, ts)):
            for i, item in enumerate(items):
                try:
                    out.append(make(item))
                except ValueError as e:
                    raise bad_request(f"{where}.{i}: {e}", f"{where}.{i}") from None
        quota = self.quotas.memory_quota(uid)

        def do():  # atomic: a refusal anywhere (a quota, a failure in a later batch) writes nothing
            added = self.memory.add(uid, facts=fs, turns=ts, quota=quota, atomic=True)
            return {"added": added, "version": self.memory.version(uid)}

        return await self.write(do)

    async def export(self, uid: str) -> dict:
        return await self.run(self.memory.export_memory, uid)

    async def import_(self, uid: str, doc: dict) -> dict:
        quota = self.quotas.memory_quota(uid)
        return (await self.write(self.memory.import_memory, uid, doc, quota)).to_dict()

    def check_messages(self, messages: Sequence[dict]) -> None:
        """Whether an add's messages can be remembered, before anything of the add is written:
        501 where this server extracts no facts, 400 naming what is wrong with them."""
        if self.jobs is None:
            raise APIError(501, "this server extracts no facts from messages", code="not_implemented")
        try:
            self.jobs.check(messages)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    async def remember(self, uid: str, messages: Sequence[dict]) -> dict:
        """Store `messages` as turns and queue the extraction of their facts: the job."""
        if self.jobs is None:
            raise APIError(501, "this server extracts no facts from messages", code="not_implemented")
        self.start_extraction(asyncio.get_running_loop())
        return await self.write(self.jobs.submit, uid, list(messages))

    async def job(self, uid: str, job_id: str) -> dict:
        if self.jobs is None:
            raise not_found(f"no job {job_id!r}", "job_id")
        self.start_extraction(asyncio.get_running_loop())

        def do():
            try:
                return self.jobs.get(uid, job_id)
            except KeyError:
                return None

        job = await self.run(do)
        if job is None:
            raise not_found(f"no job {job_id!r} for this user", "job_id")
        return job

    async def list(self, uid: str, limit: int = 100, cursor: str | None = None, filters=None) -> dict:
        def do():
            page = self.memory.list_page(uid, limit, cursor, filters)
            return {"version": self.memory.version(uid), "facts": [public_fact(f) for f in page.items],
                    "next_cursor": page.next_cursor}

        return await self.run(do)

    async def get(self, uid: str, fact_id: str) -> dict:
        return public_fact(await self.run(self.memory.get, uid, fact_id))

    async def update(self, uid: str, fact_id: str, changes: dict) -> dict:
        """`changes`: the fields a PATCH sent (text, metadata, expires_at; expires_at None: never)."""
        try:
            fields = {k: v for k, v in changes.items() if k in ("metadata", "expires_at")}
            if fields.get("expires_at") is not None:
                fields["expires_at"] = to_epoch(fields["expires_at"], "expires_at")
            if "metadata" in fields and fields["metadata"] is None:
                fields["metadata"] = {}
        except ValueError as e:
            raise bad_request(str(e), "expires_at") from None
        if changes.get("text") is None and not fields:
            raise bad_request("send the fact's new text, metadata or expires_at", "text")
        quota = self.quotas.memory_quota(uid)
        return public_fact(await self.write(lambda: self.memory.update(uid, fact_id, changes.get("text"), quota=quota,
                                                                       **fields)))

    async def delete(self, uid: str, fact_id: str, keep_history: bool = False) -> None:
        await self.write(self.memory.delete, uid, fact_id, keep_history)

    async def delete_user(self, uid: str) -> None:
        await self.write(self.memory.delete_user, uid)

    async def history(self, uid: str, fact_id: str, limit: int = 100, cursor: str | None = None) -> dict:
        page = await self.run(self.memory.history_page, uid, fact_id, limit, cursor)
        return {"events": [{**e, "ts": iso(e["ts"]), "expires_at": iso(e["expires_at"])} for e in page.items],
                "next_cursor": page.next_cursor}

    async def search(self, uid: str, query: str, k: int, filters=None) -> list[dict]:
        return [public_fact(f) for f in await self.run(lambda: self.memory.search(uid, query, k, filters=filters))]

    async def change_turn(self, uid: str, turn_id: str, text: str | None) -> list[str]:
        def do():
            if not self.memory.has_turn(uid, turn_id):  # (UnknownUserError: 404 for an unknown user)
                raise not_found(f"user has no turn {turn_id!r}", "turn_id")
            if text is None:
                return self.memory.delete_turn(uid, turn_id)
            return self.memory.update_turn(uid, turn_id, text)

        return await self.write(do)

    # -- chat ----------------------------------------------------------------------------------
    async def prepare_chat(self, r: MemoryRequest) -> Prepared:
        """The request composed once (`serving.prepare`), on a read thread; 400 when nothing fits."""
        def do():
            try:
                return prepare(self.composer, r)
            except ContextFull as e:
                raise bad_request(str(e), e.field) from None

        return await self.run(do)


__all__ = ["MemoryGateway", "Prepared", "APIError"]
