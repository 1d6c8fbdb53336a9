"""One request, from what was asked to what vLLM runs: resolved, searched, laid out, planned,
salted and given its sampling parameters, each exactly once. The only composer: the server's
gateway runs it on a read thread, `MemoryLLM` for its batches, the calibration through those.

    prep = prepare(composer, MemoryRequest("acme:alice", "Where do I live?", k=10, mode="auto",
                                           messages=[{"role": "user", "content": "Where do I live?"}]))
    engine.generate(prep.prompt, prep.params, request_id)

The memory is read once: the search (or the list of the whole memory, or the facts named) returns
the rows' `FactPlan` from the same catalog snapshot, and the composer lays out and plans from it.
"""

from __future__ import annotations

import time
from typing import Sequence

from inferscale.common.prompt.recovery import RecoveryPolicy
from inferscale.common.storage.format import UnknownFactError
from inferscale.memory.service_types import FactPlan
from inferscale.serving.composer import MemoryComposer
from inferscale.serving.request import MemoryRequest, Prepared


def prepare(composer: MemoryComposer, r: MemoryRequest, continuation: Sequence[int] = ()) -> Prepared:
    """`r` composed by `composer`. `continuation`: token ids appended after the prompt, to be scored
    with `prompt_logprobs` (the layout and plan still describe the prompt alone). Raises
    `ContextFull` when even the new message leaves no room to answer, `PlanError` for a prompt the
    plan refuses, and the memory service's errors (unknown user or fact, bad input) as they are."""
    t0 = time.perf_counter()
    sampling = dict(r.sampling)
    logprobs = sampling.pop("logprobs", None)
    if r.memoryless:
        return _memoryless(composer, r, continuation, logprobs, sampling, t0)
    mode, policy, why = composer.resolve(r.mode, r.gate_k, r.policy)  # once per request: the gate's decision
    for attempt in range(2):
        try:
            facts, fp, n_chain = _find(composer, r, mode)
            repeat = _repeated(composer, r)
            t1 = time.perf_counter()
            break
        except UnknownFactError:  # a fact was deleted or expired between reads: read again
            if attempt or r.fact_ids is not None:
                raise
    chain = n_chain if mode == "chain" else None
    fp = _arranged(fp, policy, r)
    if r.messages is None:  # the question alone after the memory
        layout, plan = composer.compose(r.user, r.question, fp, r.w, len(continuation), policy, r.boundary, chain,
                                        repeat)
        dropped: dict[str, int] = {}
    else:
        layout, plan, dropped = composer.compose_chat(r.user, r.messages, fp, policy, w=r.w, boundary=r.boundary,
                                                      chat_layout=r.chat_layout, mode=mode, whole=r.whole,
                                                      chain=chain, repeat=repeat)
    room = composer.config.max_model_len - len(layout) - len(continuation)
    prompt, params = composer.engine_request(layout, plan, mode, max(1, min(r.max_tokens, room)), logprobs,
                                             r.cache_salt, continuation, policy, **sampling)
    served_chain = None
    if chain is not None:  # links the chain lacked are encoded in the background (not for a filtered memory)
        served_chain = composer.served_chain(r.user, layout, plan, chain, extend=r.filters is None)
    t2 = time.perf_counter()
    return Prepared(prompt, params, mode, [facts[s.fact_id] for s in layout.facts], len(layout),
                    plan.num_injected if mode in ("inject", "chain") else 0, {"search": t1 - t0, "compose": t2 - t1},
                    policy, why, dropped, served_chain, [fid for fid, _, _ in repeat.facts] if repeat else [])


def _find(composer: MemoryComposer, r: MemoryRequest, mode: str) -> tuple[dict[str, dict], FactPlan, int | None]:
    """({fact id: what the response says of it}, their plan, n): the facts a request of `mode`
    serves, read once. `n`: how many, from the first, are the whole memory's chain (None unless
    the whole memory is served)."""
    memory = composer.memory_for(r.w)
    if r.whole:  # the whole memory, in the order it was added (beyond the chain's budget: the most relevant)
        if memory is composer.memory:
            chosen, n, fp = composer.whole_memory(r.user, r.question, r.filters)
        elif mode == "chain":
            raise ValueError(f"the memory chain is kept for facts encoded with w={composer.config.w}, not w={r.w}")
        else:
            (chosen, fp), n = memory.list_plan(r.user, r.filters), None
        facts = {f.fact_id: {"id": f.fact_id, "text": f.text, "source": "chain" if i < n else "retrieval"}
                 for i, f in enumerate(chosen)} if n is not None else \
            {f.fact_id: {"id": f.fact_id, "text": f.text} for f in chosen}
        return facts, fp, n
    if r.fact_ids is None:
        hits, fp = memory.search_plan(r.user, r.question, r.k, filters=r.filters)
        return {h.fact_id: {"id": h.fact_id, "text": h.text, "score": h.score} for h in hits}, fp, None
    named, fp = memory.get_plan(r.user, r.fact_ids)
    return {f.fact_id: {"id": f.fact_id, "text": f.text} for f in named}, fp, None


def _arranged(fp: FactPlan, policy: str | None, r: MemoryRequest) -> FactPlan:
    """The facts in the order the recovery policy lays them out (`RecoveryPolicy.arrange`: `top:N`
    moves the N most relevant next to the question); the whole memory keeps the order it was added."""
    parsed = RecoveryPolicy.parse(policy) if policy is not None else None
    if parsed is None or not parsed.reorders:
        return fp
    if r.whole:
        raise ValueError(f"recovery policy {policy!r} moves the most relevant of the retrieved facts next to the "
                         "question; the whole memory (k 'all') is served in the order it was added")
    return FactPlan(fp.version, fp.incarnation, parsed.arrange(fp.facts))


def _repeated(composer: MemoryComposer, r: MemoryRequest) -> FactPlan | None:
    """The plan of the whole memory's facts most relevant to the question, repeated next to it
    (`MemoryRequest.repeat`, else the config's `chain_repeat`); None for none."""
    n = r.repeat if r.repeat is not None else composer.config.chain_repeat if r.whole else 0
    if not n:
        return None
    return composer.memory_for(r.w).search_plan(r.user, r.question, n, filters=r.filters)[1]


def _memoryless(composer: MemoryComposer, r: MemoryRequest, continuation: Sequence[int], logprobs, sampling: dict,
                t0: float) -> Prepared:
    """A request served without memory: the chat as vLLM's chat endpoint renders it, or the
    question alone after the prompt header (the memory prompt without facts)."""
    if r.messages is None:
        layout = composer.builder.layout([], composer.builder.question_ids(r.question), False)
        ids, dropped = list(layout.token_ids), {}
    else:
        ids, dropped = composer.plain_chat(r.messages)
    prompt, params = composer.plain_request(ids, r.scope, r.max_tokens, r.cache_salt, continuation,
                                            logprobs=logprobs, **sampling)
    return Prepared(prompt, params, "none", [], len(ids), 0, {"search": 0.0, "compose": time.perf_counter() - t0},
                    why="no memory requested", dropped=dropped)
