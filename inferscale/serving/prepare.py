"""One request, from what the client asked to what vLLM runs: resolved, searched, laid out,
planned, salted and given its sampling parameters, each exactly once.

    prep = prepare(composer, PrepareRequest(tenant="acme", uid="acme:alice", question="Where do I live?",
                                            messages=[{"role": "user", "content": "Where do I live?"}],
                                            mode="auto", k=10, max_tokens=64))
    engine.generate(prep.prompt, prep.params, request_id)

The server's gateway runs it on a read thread; `MemoryLLM` runs the same composer methods for its
offline batches. Plain Python around the composer: vLLM's types are built by the composer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inferscale.common.modes import WHOLE_MEMORY
from inferscale.memory.service_types import UnknownFactError


@dataclass(frozen=True)
class PrepareRequest:
    """What a request asks of the memory. `uid` None (no user) or mode "none" serve no memory;
    `fact_ids` names the facts instead of retrieving the top `k`."""

    tenant: str
    uid: str | None
    question: str  # what the memory is searched with (the new message)
    messages: list[dict]  # the whole chat, {"role", "content"} with text content
    mode: str  # as requested: auto | inject | text | chain | none
    k: int | str  # facts to retrieve, or "all" (`common.modes.WHOLE_MEMORY`: every live fact, in insertion order)
    max_tokens: int
    fact_ids: list[str] | None = None
    policy: str | None = None  # the recovery policy asked for (mode "inject")
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments
    filters: Any = None  # retrieval among the facts that satisfy it (`common.storage.filters`)


@dataclass
class Prepared:
    """One request, ready for the engine."""

    prompt: Any  # vllm TokensPrompt
    params: Any  # vllm SamplingParams
    mode: str  # what is served: inject | text | chain | none
    facts: list[dict]  # [{id, text, score}] in prompt order ("source": chain | retrieval for the whole memory)
    prompt_tokens: int
    injected_tokens: int  # memory tokens planned for injection (0 unless mode is "inject" or "chain")
    timings: dict[str, float] = field(default_factory=dict)
    policy: str | None = None  # the recovery policy that served it (mode "inject")
    why: str | None = None  # the gate's reason, when mode "auto" was asked for
    dropped: dict[str, int] = field(default_factory=dict)  # {"turns": n, "facts": m} left out to fit the context
    chain: dict[str, int] | None = None  # mode "chain": {"facts": chain facts served, "stored": those from links}


def prepare(composer, r: PrepareRequest) -> Prepared:
    """`r` composed by `composer` (a `MemoryComposer`); `ContextFull` when even the new message
    leaves no room to answer, and the memory service's errors (unknown user or fact, bad input)
    as they are."""
    t0 = time.perf_counter()
    if r.uid is None or r.mode == "none" or (r.k == 0 and r.fact_ids is None and r.mode != "chain"):
        ids, dropped = composer.plain_chat(r.messages)
        scope = r.uid if r.uid is not None else f"{r.tenant}:"  # uid is "<tenant>:<user>"
        prompt, params = composer.plain_request(ids, scope, r.max_tokens, **r.sampling)
        return Prepared(prompt, params, "none", [], len(ids), 0, {"search": 0.0, "compose": time.perf_counter() - t0},
                        dropped=dropped)
    memory = composer.memory
    mode, policy, why = composer.resolve(r.mode, r.k, r.policy)  # once per request: the gate's decision
    if mode == "chain" and r.fact_ids is not None:
        raise ValueError("mode chain serves the whole memory; name no fact ids")
    whole = (r.k == WHOLE_MEMORY or mode == "chain") and r.fact_ids is None
    n_chain = None
    for attempt in range(2):
        if whole:  # the whole memory, in the order it was added (beyond the chain's budget: the most relevant)
            chosen, n = composer.whole_memory(r.uid, r.question, r.filters)
            facts = {f.fact_id: {"id": f.fact_id, "text": f.text, "source": "chain" if i < n else "retrieval"}
                     for i, f in enumerate(chosen)}
            n_chain = n if mode == "chain" else None
        elif r.fact_ids is None:
            hits = memory.search(r.uid, r.question, r.k, filters=r.filters)
            facts = {h.fact_id: {"id": h.fact_id, "text": h.text, "score": h.score} for h in hits}
        else:
            facts = {f.fact_id: {"id": f.fact_id, "text": f.text} for f in (memory.get(r.uid, fid)
                                                                            for fid in r.fact_ids)}
        t1 = time.perf_counter()
        try:
            layout, plan, dropped = composer.compose_chat(r.uid, r.messages, list(facts) if mode != "none" else [],
                                                          policy, mode=mode, whole=whole, chain=n_chain)
            break
        except UnknownFactError:  # a retrieved fact was deleted or expired meanwhile: retrieve again
            if attempt or r.fact_ids is not None:
                raise
    room = composer.config.max_model_len - len(layout)
    sampling = dict(r.sampling)
    logprobs = sampling.pop("logprobs", None)
    prompt, params = composer.engine_request(layout, plan, mode, min(r.max_tokens, room), logprobs, policy=policy,
                                             **sampling)
    served = [facts[s.fact_id] for s in layout.facts]
    chain = None
    if n_chain is not None:  # links the chain lacked are encoded in the background (not for a filtered memory)
        chain = composer.served_chain(r.uid, layout, plan, n_chain, extend=r.filters is None)
    t2 = time.perf_counter()
    return Prepared(prompt, params, mode, served, len(layout), plan.num_injected if mode in ("inject", "chain") else 0,
                    {"search": t1 - t0, "compose": t2 - t1}, policy, why if r.mode == "auto" else None, dropped, chain)
