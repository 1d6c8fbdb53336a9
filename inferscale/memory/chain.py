"""`MemoryChain`: each user's whole memory as one jointly encoded chain of links, kept beside the
per-fact KV in the user's own store (`common.prompt.chain_links` says what a link and its key are).

    chain = MemoryChain(memory, encoder, header_ids, budget=3072)
    m = chain.stored(user, keys)       # links a request may inject: the longest stored prefix
    chain.schedule(user)               # encode what is missing, in the background
    chain.extend(user)                 # ... or now: {"encoded": n, "dropped": m}

A request never waits for the chain: what is not stored is prefilled as text in that request,
and `schedule` encodes it afterwards, in one pass from the first missing link (an append: the new
fact; an update or a delete of fact j: j and every fact after it), under the user's writer lock.
Where the encoder extends KV (`TorchFactEncoder.encode_after`), only those facts run, after the
stored links before them; otherwise the pass runs over the header and every fact before them too.
Links that no longer lie on the user's chain are dropped then. Links are written with one atomic
`put`, and only ever named by the exact tokens they hold, so an interrupted extension loses nothing
committed and never leaves a wrong link: the next one starts from what is stored.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from inferscale.common.prompt.chain_links import (
    chain_keys,
    extension_item,
    is_chain_key,
    split_links,
    stored_prefix,
    within_budget,
)
from inferscale.common.storage.format import FactKV, UnknownFactError
from inferscale.memory.service_types import FactPlan

log = logging.getLogger("inferscale.memory")

COUNTERS = ("plans", "hits", "link_tokens", "prefilled_tokens", "extensions", "links_encoded", "links_dropped",
            "errors")


class MemoryChain:
    """Every user's chain, in the memory service's stores. `encoder`: anything with `encode_ids`
    (both encoders); `header_ids`: the prompt header the chain follows; `budget`: the most fact
    tokens a chain holds."""

    def __init__(self, memory, encoder, header_ids, budget: int) -> None:
        self.memory = memory
        self.encoder = encoder
        self.header_ids = tuple(header_ids)
        self.budget = budget
        # plans: chain plans composed; hits: those injecting at least one link; link_tokens: fact
        # tokens injected from links; prefilled_tokens: chain facts prefilled as text (not stored
        # yet); extensions: runs that encoded links; links_encoded / links_dropped: links written /
        # removed as no longer on a chain; errors: runs that failed (logged)
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._header_kv: tuple[np.ndarray, np.ndarray] | None = None  # the header's pre-RoPE KV (exact)

    # -- what a request injects --------------------------------------------------------------
    def keys(self, incarnation: str, facts: Sequence[Sequence[int]]) -> list[str]:
        """The link keys of facts (token ids, in memory order) of a user of this incarnation."""
        return chain_keys(self.header_ids, incarnation, facts)

    def held(self, facts: Sequence[Sequence[int]]) -> int:
        """How many facts, from the first, fit in the chain's budget."""
        return within_budget(facts, self.budget)

    def stored(self, user: str, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the user's store holds (one round trip)."""
        if not keys:
            return 0
        try:
            store = self.memory.kv.read(user)
        except FileNotFoundError:
            return 0
        return stored_prefix(keys, store.missing(list(keys)))

    def count(self, n_links: int, link_tokens: int, prefilled_tokens: int) -> None:
        """Record one served chain plan."""
        with self._lock:
            self.stats["plans"] += 1
            self.stats["hits"] += n_links > 0
            self.stats["link_tokens"] += link_tokens
            self.stats["prefilled_tokens"] += prefilled_tokens

    def select(self, user: str, question: str, rest_k: int, filters=None) -> tuple[list, int, FactPlan]:
        """(facts, n, plan) a whole-memory request serves: the user's live facts (`MemoryFact`,
        insertion order) that fit in the chain's budget, the first `n`; then, when the memory is
        longer, the `rest_k` of the others most relevant to `question`, best first (retrieval, as
        top-k serves); and their `FactPlan`, from the rows read for them."""
        facts, plan = self.memory.list_plan(user, filters)
        n = self.held([tokens for _, _, tokens in plan.facts])
        if n == len(facts) or rest_k == 0:
            return facts[:n], n, FactPlan(plan.version, plan.incarnation, plan.facts[:n])
        held = {f.fact_id for f in facts[:n]}
        hits, found = self.memory.search_plan(user, question, rest_k + n, filters=filters)
        rest = [(h, p) for h, p in zip(hits, found.facts) if h.fact_id not in held][:rest_k]
        chosen = facts[:n] + [h for h, _ in rest]
        if (found.version, found.incarnation) != (plan.version, plan.incarnation):  # written meanwhile
            return chosen, n, self.memory.fact_plan(user, [f.fact_id for f in chosen])
        return chosen, n, FactPlan(plan.version, plan.incarnation, plan.facts[:n] + [p for _, p in rest])

    def status(self, user: str) -> dict[str, int]:
        """{"facts": live facts, "held": those within the budget, "stored": links a request injects now}."""
        facts, plan = self.memory.list_plan(user)
        tokens = [t for _, _, t in plan.facts]
        held = self.held(tokens)
        return {"facts": len(facts), "held": held,
                "stored": self.stored(user, self.keys(plan.incarnation, tokens[:held]))}

    # -- keeping it ----------------------------------------------------------------------------
    def extend(self, user: str) -> dict[str, int]:
        """Encode the user's missing links (one pass from the first missing one) and drop the links
        no longer on the chain, under the user's writer lock: {"encoded": n, "dropped": m}."""
        memory = self.memory
        with memory.writer(user):
            incarnation = memory.catalog.incarnation(user)
            rows = memory.catalog.facts(user, now=memory.clock()) if incarnation is not None else []
            if not rows:
                return {"encoded": 0, "dropped": self._drop(user, set())}
            store = memory.kv.open_or_create(user, memory.meta)
            try:  # the tokens as a request's plan reads them
                facts = [list(store.info(r.kv_key)["tokens"]) for r in rows]
            except UnknownFactError:  # a request encodes lost fact KV again first
                raise RuntimeError(f"user {user}: fact KV is missing from {memory.kv.describe()}") from None
            facts = facts[:self.held(facts)]
            keys = self.keys(incarnation, facts)
            start = stored_prefix(keys, store.missing(keys))
            dropped = self._drop(user, set(keys), store)  # first: no stale link outlives a failed encode
            if start < len(facts):
                k, v = self._encode(store, keys, facts, start)
                links = split_links(k, v, [len(f) for f in facts[start:]])
                store.put([FactKV(key, ids_, lk, lv, text="<memory chain link>")
                           for key, ids_, (lk, lv) in zip(keys[start:], facts[start:], links)])
        encoded = len(facts) - start
        with self._lock:
            self.stats["extensions"] += encoded > 0
            self.stats["links_encoded"] += encoded
        return {"encoded": encoded, "dropped": dropped}

    def _encode(self, store, keys: list[str], facts: list[list[int]], start: int) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) of the facts from `start` on, after the header and the facts before them: from the
        stored links before `start` where the encoder extends KV (`encode_after`: only the new
        tokens run), else one pass over everything (`encode_ids`)."""
        if start and getattr(self.encoder, "extends_kv", False):
            if self._header_kv is None:
                ((hk, hv),) = self.encoder.encode_ids([((), self.header_ids)])
                self._header_kv = (hk, hv)
            links = store.get(keys[:start])
            prefix_k = np.concatenate([self._header_kv[0]] + [link.k for link in links], axis=1)
            prefix_v = np.concatenate([self._header_kv[1]] + [link.v for link in links], axis=1)
            return self.encoder.encode_after(prefix_k, prefix_v, [t for ids in facts[start:] for t in ids])
        ((k, v),) = self.encoder.encode_ids([extension_item(self.header_ids, facts, start)])
        return k, v

    def _drop(self, user: str, keep: set[str], store=None) -> int:
        """Remove the user's links not in `keep` (call with the writer lock held)."""
        if store is None:
            try:
                store = self.memory.kv.open(user)
            except FileNotFoundError:
                return 0
        stale = [key for key in store.fact_ids() if is_chain_key(key) and key not in keep]
        if stale:
            store.delete(stale)
        with self._lock:
            self.stats["links_dropped"] += len(stale)
        return len(stale)

    def schedule(self, user: str) -> Future:
        """`extend(user)` on the chain's background thread (once while one is pending)."""
        with self._lock:
            pending = self._pending.get(user)
            if pending is not None and not pending.done():
                return pending
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferscale-chain")
            fut = self._pool.submit(self._run, user)
            self._pending[user] = fut
            return fut

    def _run(self, user: str) -> dict[str, int]:
        try:
            return self.extend(user)
        except Exception:
            log.exception("user %s: extending the memory chain failed; the next request tries again", user)
            with self._lock:
                self.stats["errors"] += 1
            return {"encoded": 0, "dropped": 0}
        finally:
            with self._lock:
                self._pending.pop(user, None)

    def drain(self) -> None:
        """Wait for every scheduled extension."""
        while True:
            with self._lock:
                futures = list(self._pending.values())
            if not futures:
                return
            for f in futures:
                f.result()

    def close(self) -> None:
        """Finish the scheduled extensions and stop the background thread."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
