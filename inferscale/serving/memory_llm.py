"""`MemoryLLM`: vLLM with InferScale's connector, answering with a user's memory.

    llm = MemoryLLM(MemoryLLMConfig(model="path/to/hf_model", memory_root="mem"))
    llm.memory.add("alice", turns=[...], facts=[...])           # the memory service
    out = llm.generate("alice", "Where does Tom live?", k=10)   # mode="inject" (default)
    base = llm.generate("alice", "Where does Tom live?", k=10, mode="text")  # facts as prompt text
    outs = llm.generate_many([MemoryRequest("alice", q, k=10) for q in questions])  # one vLLM batch
    ll = llm.score_many([MemoryRequest("alice", q, fact_ids=ids)], ["Paris"])  # gold log-likelihood
    out = llm.generate("alice", "Where does Tom live?", k=10, policy="last:2")  # recompute the last 2 facts

Both modes run on the same engine with the same retrieved facts and the same prompt tokens; in
"inject" mode the connector writes the memory's KV and vLLM prefills only the footer and the
question. Timings are split into embed+search, compose (layout and plan), and engine.

The composition (layout, plan, salt, the gate) is `MemoryComposer`'s (`serving.composer`).
"""

from __future__ import annotations

import logging

import time
from dataclasses import dataclass, field
from typing import Sequence

from inferscale.common.modes import SERVE_MODES, WHOLE_MEMORY
from inferscale.common.plan import PlanError
from inferscale.retrieval.embedders import Embedder
from inferscale.serving.composer import MemoryComposer, MemoryLLMConfig, served_policy

log = logging.getLogger("inferscale.serving")


@dataclass(frozen=True)
class MemoryRequest:
    """One request of `MemoryLLM.generate_many` / `score_many`. `fact_ids` None: retrieve the
    user's top-k facts for the question (mode "none" uses no facts). `messages` (OpenAI-style
    `{"role", "content"}` dicts ending with the user's `question`): a whole chat, its system prompts
    and earlier turns served after the memory (`MemoryComposer.compose_chat`); None: the question
    alone after the memory."""

    user: str
    question: str
    k: int | str = 10  # or "all": the whole memory, in insertion order (`common.modes.WHOLE_MEMORY`)
    mode: str = "inject"
    fact_ids: tuple[str, ...] | None = None
    w: int | None = None
    max_tokens: int = 64
    cache_salt: str | None = None
    policy: str | None = None  # recovery policy of mode "inject" (None: plain injection)
    messages: tuple[dict, ...] | None = None
    boundary: bool | None = None  # end the memory with `layout.BOUNDARY` (None: the config's memory_boundary)
    chat_layout: str | None = None  # where a chat's memory goes (common.modes.CHAT_LAYOUTS; None: the config's)

    def __post_init__(self) -> None:
        if self.mode not in SERVE_MODES:
            raise ValueError(f"mode must be one of {SERVE_MODES}, got {self.mode!r}")
        served_policy(self.mode, self.policy)  # ValueError for a policy this mode cannot take
        if self.k != WHOLE_MEMORY and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0):
            raise ValueError(f"k must be an integer >= 0 or {WHOLE_MEMORY!r}, got {self.k!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.mode == "chain" and self.fact_ids is not None:
            raise ValueError("mode chain serves the whole memory; name no fact_ids")
        if self.fact_ids is not None and not isinstance(self.fact_ids, tuple):
            object.__setattr__(self, "fact_ids", tuple(self.fact_ids))
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


@dataclass(frozen=True)
class AnswerScore:
    """Log-likelihood of a given answer after a memory prompt (`MemoryLLM.score_many`)."""

    logprobs: list[float]  # of each answer token, given the prompt and the answer tokens before it
    facts: list[str]

    @property
    def num_tokens(self) -> int:
        return len(self.logprobs)

    @property
    def mean(self) -> float:
        return sum(self.logprobs) / len(self.logprobs)


@dataclass
class MemoryOutput:
    text: str
    token_ids: list[int]
    logprobs: list[float]  # of each generated token
    facts: list[str]  # fact ids in the prompt, in order
    mode: str
    num_injected: int  # prompt tokens whose stored KV the connector injected (planned; not those it recomputed)
    num_prompt: int
    ttft_s: float  # request in -> first token out, when max_tokens == 1; else time to the full answer
    timings: dict[str, float] = field(default_factory=dict)
    policy: str | None = None  # the recovery policy that served it (mode "inject")
    why: str = ""  # why this mode and policy (the gate's reason under mode "auto")
    cached_tokens: int = 0  # prompt tokens vLLM did not prefill: its prefix cache's and the connector's


class MemoryLLM(MemoryComposer):
    """The offline engine (`vllm.LLM`) with memory: one call, one answer."""

    def __init__(self, config: MemoryLLMConfig, embedder: Embedder | None = None, **llm_kwargs) -> None:
        super().__init__(config, embedder)
        from vllm import LLM

        from inferscale.vllm.model_access import ATTACH, attach_reasons

        self.llm = LLM(**self.engine_kwargs(**llm_kwargs))
        # "" when plans that recompute inside the memory (heads:N) are computed, else why not
        self.recompute_off = attach_reasons(self.llm.collective_rpc(ATTACH))
        if self.recompute_off:
            log.warning("heads:N plans will be injected plainly: %s", self.recompute_off)

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes), finish the memory chain's
        extensions and close the memory services. Idempotent; the object is unusable afterwards.
        Also on leaving a `with` block."""
        if getattr(self, "chain", None) is not None:
            self.chain.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for svc in self._by_w.values():
            svc.close()

    def __enter__(self) -> "MemoryLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def remember(self, user: str, messages: Sequence[dict], **extractor_kwargs):
        """Store `messages` (OpenAI chat messages, optional ids and dates) as the user's turns and
        extract facts from them with this model, through this engine (add / update / delete
        decisions; `inferscale.memory.extraction`). Returns the `Extracted` outcome."""
        from inferscale.memory.extraction import Extractor, turns_from_messages
        from inferscale.memory.extraction_llms import EngineJsonLLM

        return Extractor(self.memory, EngineJsonLLM(self), **extractor_kwargs).remember(
            user, turns_from_messages(messages))

    # -- generation --------------------------------------------------------------------------
    def generate(self, user: str, question: str, k: "int | str" = 10, mode: str = "inject", max_tokens: int = 64,
                 fact_ids: list[str] | None = None, logprobs: int | None = 1,
                 cache_salt: str | None = None, w: int | None = None, policy: str | None = None,
                 messages: Sequence[dict] | None = None, boundary: bool | None = None,
                 chat_layout: str | None = None) -> MemoryOutput:
        """Retrieve the user's top-k facts (or use `fact_ids`; k "all": every live fact, in the order
        they were added, and a chat laid out memory-first), compose, and answer greedily.

        `cache_salt` replaces the per-(user, memory version) prefix-cache salt (benchmarks: a fresh
        salt per request defeats vLLM's prefix cache). Never share a salt across users. `messages`:
        the whole chat (system prompts, earlier turns) ending with the user's `question`. `boundary`:
        end the memory with its boundary (None: the config's `memory_boundary`). `chat_layout`: where
        the chat's memory goes (None: the config's)."""
        req = MemoryRequest(user, question, k, mode, None if fact_ids is None else tuple(fact_ids), w, max_tokens,
                            cache_salt, policy, None if messages is None else tuple(messages), boundary, chat_layout)
        return self.generate_many([req], logprobs)[0]

    def _retrieve(self, r: MemoryRequest) -> tuple[list[str], int | None]:
        """(fact ids, n): n is the whole memory's chain facts, the first n (None: top k or named)."""
        if r.mode == "none":
            return [], None
        if r.fact_ids is not None:
            return list(r.fact_ids), None
        if r.k == WHOLE_MEMORY or r.mode == "chain":
            chosen, n = self.chain.select(r.user, r.question, self.config.chain_rest_k) if r.w in (None, self.config.w) \
                else (self.memory_for(r.w).list(r.user), None)
            return [f.fact_id for f in chosen], n
        return [f.fact_id for f in self.memory_for(r.w).search(r.user, r.question, r.k)], None

    def _served(self, r: MemoryRequest, ids: list[str], n: int | None) -> tuple[str, str | None, str]:
        """(mode, policy, why) of a request whose facts are `ids` (`_retrieve`): the gate asked at the
        k requested, as the server's `prepare` asks it (the facts named, when they are)."""
        k = WHOLE_MEMORY if n is not None else len(ids) if r.fact_ids is not None else r.k
        mode, policy, why = self.resolve(r.mode, k, r.policy)
        if mode == "chain" and n is None:
            raise ValueError(f"the memory chain is kept for facts encoded with w={self.config.w}, not w={r.w}")
        return mode, policy, why

    def generate_many(self, requests: Sequence[MemoryRequest], logprobs: int | None = None) -> list[MemoryOutput]:
        """Answer every request greedily in one vLLM batch (the engine schedules them together).

        Raises `PlanError` before anything is submitted if any request cannot be composed. Timings:
        "search" and "compose" are per request; "engine" and `ttft_s` are the whole batch's call
        (with one request, its time to the full answer)."""
        t0 = time.perf_counter()
        built, times, served = [], [], []
        for r in requests:
            a = time.perf_counter()
            ids, n = self._retrieve(r)
            b = time.perf_counter()
            whole = (r.k == WHOLE_MEMORY or r.mode == "chain") and r.fact_ids is None
            mode, policy, why = self._served(r, ids, n)
            served.append((mode, policy, why))
            chain = n if mode == "chain" else None
            injects = mode in ("inject", "chain")
            if r.messages is None:
                prompt, params, layout, plan = self.build_request(r.user, r.question, ids, mode, r.max_tokens, logprobs,
                                                                  r.cache_salt, r.w, policy=policy, boundary=r.boundary,
                                                                  chain=chain)
                built.append((ids, prompt, params, len(layout), plan.num_injected if injects else 0))
            elif mode == "none":  # the chat alone, as vLLM's own chat endpoint renders it (the server's path)
                plain, _ = self.plain_chat(r.messages)
                prompt, params = self.plain_request(plain, r.user, r.max_tokens, cache_salt=r.cache_salt,
                                                    logprobs=logprobs)
                built.append((ids, prompt, params, len(plain), 0))
            else:
                layout, plan, _ = self.compose_chat(r.user, r.messages, ids, policy,
                                                    w=r.w, boundary=r.boundary, mode=mode,
                                                    chat_layout=r.chat_layout, whole=whole, chain=chain)
                built.append((ids, *self.engine_request(layout, plan, mode, r.max_tokens, logprobs, r.cache_salt,
                                                        policy=policy),
                              len(layout), plan.num_injected if injects else 0))
            if chain is not None:
                self.served_chain(r.user, layout, plan, chain)
            times.append((b - a, time.perf_counter() - b))
        t1 = time.perf_counter()
        outs = self.llm.generate([p for _, p, *_ in built], [s for _, _, s, *_ in built], use_tqdm=False)
        t2 = time.perf_counter()
        results = []
        for (mode, policy, why), (ids, _, _, n_prompt, n_injected), (ts, tc), out in zip(served, built, times, outs):
            c = out.outputs[0]
            lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [])] if logprobs else []
            total = (t1 - t0) / len(requests) + (t2 - t1) if len(requests) > 1 else t2 - t0
            results.append(MemoryOutput(c.text, list(c.token_ids), lps, ids, mode, n_injected, n_prompt, total,
                                        {"search": ts, "compose": tc, "engine": t2 - t1}, policy, why,
                                        int(out.num_cached_tokens or 0)))
        return results

    def score_many(self, requests: Sequence[MemoryRequest], answers: Sequence[str]) -> list[AnswerScore]:
        """Log-likelihood of each `answers[i]` as the assistant's reply to `requests[i]` (same
        prompt, facts and injection as generation), in one vLLM batch.

        The answer's tokens are appended to the prompt and scored with vLLM's prompt logprobs, which
        vLLM returns only for the positions it computes. vLLM skips prefix-cache and connector hits
        for prompt-logprob requests by default; here they are kept (`skip_reading_prefix_cache=False`):
        the injected memory is the point, and the prefix a generation request just computed is
        reused. A request whose prefix-cache hit reached into the answer (the same prompt scored
        before) is scored again under a fresh salt, so every answer position is computed."""
        if len(requests) != len(answers):
            raise ValueError(f"{len(requests)} requests but {len(answers)} answers")
        tok = self.encoder.tokenizer
        items = []  # (request, fact ids, answer token ids)
        for r, ans in zip(requests, answers):
            cont = tok.encode(str(ans), add_special_tokens=False)
            if not cont:
                raise ValueError(f"answer {ans!r} has no tokens")
            items.append((r, *self._retrieve(r), cont))
        scores = self._score_pass(items, fresh_salt=False)
        again = [i for i, sc in enumerate(scores) if sc is None]
        for i, sc in zip(again, self._score_pass([items[i] for i in again], fresh_salt=True)):
            if sc is None:
                raise RuntimeError(f"vLLM returned no prompt logprobs for answer {answers[i]!r}")
            scores[i] = sc
        return scores

    def _score_pass(self, items, fresh_salt: bool) -> list[AnswerScore | None]:
        """One batch of score requests; None where vLLM did not compute every answer position."""
        import uuid

        built = []
        for r, ids, n, cont in items:
            salt = uuid.uuid4().hex if fresh_salt else r.cache_salt
            mode, policy, _ = self._served(r, ids, n)
            prompt, params, layout, _ = self.build_request(r.user, r.question, ids, mode, 1, None, salt, r.w,
                                                           continuation=cont, policy=policy, boundary=r.boundary,
                                                           chain=n if mode == "chain" else None, prompt_logprobs=0,
                                                           detokenize=False, skip_reading_prefix_cache=False)
            built.append((prompt, params, len(layout)))
        outs = self.llm.generate([b[0] for b in built], [b[1] for b in built], use_tqdm=False) if built else []
        scores: list[AnswerScore | None] = []
        for (_, ids, _, cont), (_, _, n_prompt), out in zip(items, built, outs):
            # the first answer token's logprob comes from the logits of the prompt's last position
            computed = (out.num_cached_tokens or 0) <= n_prompt - 1
            tail = (out.prompt_logprobs or [])[-len(cont):]
            if not computed or len(tail) != len(cont) or any(d is None or t not in d for t, d in zip(cont, tail)):
                scores.append(None)
            else:
                scores.append(AnswerScore([float(d[t].logprob) for t, d in zip(cont, tail)], list(ids)))
        return scores


__all__ = ["AnswerScore", "MemoryComposer", "MemoryLLM", "MemoryLLMConfig", "MemoryOutput", "MemoryRequest",
           "PlanError"]
