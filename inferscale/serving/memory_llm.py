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

Every request goes through `serving.prepare`, as the server's do; `MemoryLLM` holds the
`MemoryComposer` (`composer`) and the engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Sequence

from inferscale.common.prompt.plan import PlanError
from inferscale.retrieval.embedders import Embedder
from inferscale.serving.composer import ContextFull, MemoryComposer, MemoryLLMConfig
from inferscale.serving.prepare import prepare
from inferscale.serving.request import MemoryRequest, Prepared

log = logging.getLogger("inferscale.serving")


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


class MemoryLLM:
    """The offline engine (`vllm.LLM`) with memory: one call, one answer."""

    def __init__(self, config: MemoryLLMConfig, embedder: Embedder | None = None, **llm_kwargs) -> None:
        self.composer = MemoryComposer(config, embedder)
        from vllm import LLM

        from inferscale.vllm.model_access import ATTACH, attach_reasons

        self.llm = LLM(**self.composer.engine_kwargs(**llm_kwargs))
        # "" when plans that recompute inside the memory (heads:N) are computed, else why not
        self.recompute_off = attach_reasons(self.llm.collective_rpc(ATTACH))
        if self.recompute_off:
            log.warning("heads:N plans will be injected plainly: %s", self.recompute_off)

    @property
    def config(self) -> MemoryLLMConfig:
        return self.composer.config

    @property
    def memory(self):
        """The memory service (`MemoryService`) of the config's window."""
        return self.composer.memory

    @property
    def chain(self):
        """The users' memory chains (`MemoryChain`)."""
        return self.composer.chain

    @property
    def encoder(self):
        """The torch fact encoder (`TorchFactEncoder`), which also tokenizes."""
        return self.composer.encoder

    def memory_for(self, w: int | None = None):
        """The memory service of facts encoded with window `w` (`MemoryComposer.memory_for`)."""
        return self.composer.memory_for(w)

    def resolve(self, mode: str, k: "int | str", policy: str | None = None) -> tuple[str, str | None, str]:
        """(mode, policy, why) a request would be served with (`MemoryComposer.resolve`)."""
        return self.composer.resolve(mode, k, policy)

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes), finish the memory chain's
        extensions and close the memory services. Idempotent; the object is unusable afterwards.
        Also on leaving a `with` block."""
        composer = getattr(self, "composer", None)
        if composer is not None:
            composer.chain.close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if composer is not None:
            composer.close()

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
                 chat_layout: str | None = None, repeat: int | None = None) -> MemoryOutput:
        """Retrieve the user's top-k facts (or use `fact_ids`; k "all": every live fact, in the order
        they were added, and a chat laid out memory-first), compose, and answer greedily.

        `cache_salt` replaces the per-(user, memory version) prefix-cache salt (benchmarks: a fresh
        salt per request defeats vLLM's prefix cache). Never share a salt across users. `messages`:
        the whole chat (system prompts, earlier turns) ending with the user's `question`. `boundary`:
        end the memory with its boundary (None: the config's `memory_boundary`). `chat_layout`: where
        the chat's memory goes (None: the config's). `repeat` (the whole memory): its facts most
        relevant to the question repeated as text next to it (None: the config's `chain_repeat`)."""
        req = MemoryRequest(user, question, k, mode, None if fact_ids is None else tuple(fact_ids), w, max_tokens,
                            cache_salt, policy, None if messages is None else tuple(messages), boundary, chat_layout,
                            repeat=repeat)
        return self.generate_many([req], logprobs)[0]

    def prepare(self, r: MemoryRequest, continuation: Sequence[int] = ()) -> Prepared:
        """`r` ready for the engine (`serving.prepare`), as the server prepares its requests."""
        return prepare(self.composer, r, continuation)

    def generate_many(self, requests: Sequence[MemoryRequest], logprobs: int | None = None) -> list[MemoryOutput]:
        """Answer every request greedily in one vLLM batch (the engine schedules them together).

        Raises `PlanError` before anything is submitted if any request cannot be composed, and
        `ContextFull` if a prompt leaves less room than its `max_tokens` (an answer is never cut
        short by the context; the server, like vLLM's, answers in the room left). Timings:
        "search" and "compose" are per request; "engine" and `ttft_s` are the whole batch's call
        (with one request, its time to the full answer)."""
        t0 = time.perf_counter()
        preps = [self.prepare(replace(r, sampling={**r.sampling, "logprobs": logprobs}) if logprobs else r)
                 for r in requests]
        for r, p in zip(requests, preps):  # an answer is never cut short by the context
            if p.params.max_tokens < r.max_tokens:
                raise ContextFull(f"a prompt of {p.prompt_tokens} tokens leaves {p.params.max_tokens} of the "
                                  f"{r.max_tokens} max_tokens to answer in the context of {self.config.max_model_len} "
                                  "tokens: retrieve fewer facts or raise max_model_len", "max_tokens")
        t1 = time.perf_counter()
        outs = self.llm.generate([p.prompt for p in preps], [p.params for p in preps], use_tqdm=False)
        t2 = time.perf_counter()
        results = []
        for p, out in zip(preps, outs):
            c = out.outputs[0]
            lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [])] if logprobs else []
            total = (t1 - t0) / len(requests) + (t2 - t1) if len(requests) > 1 else t2 - t0
            results.append(MemoryOutput(c.text, list(c.token_ids), lps, p.fact_ids, p.mode, p.injected_tokens,
                                        p.prompt_tokens, total, {**p.timings, "engine": t2 - t1}, p.policy, p.why,
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
        items = []  # (request, answer token ids)
        for r, ans in zip(requests, answers):
            cont = tok.encode(str(ans), add_special_tokens=False)
            if not cont:
                raise ValueError(f"answer {ans!r} has no tokens")
            items.append((replace(r, max_tokens=1, sampling={"prompt_logprobs": 0, "detokenize": False,
                                                              "skip_reading_prefix_cache": False}), cont))
        scores = self._score_pass(items)
        again = [i for i, sc in enumerate(scores) if sc is None]
        for i, sc in zip(again, self._score_pass([(replace(items[i][0], cache_salt=uuid.uuid4().hex), items[i][1])
                                                  for i in again])):
            if sc is None:
                raise RuntimeError(f"vLLM returned no prompt logprobs for answer {answers[i]!r}")
            scores[i] = sc
        return scores

    def _score_pass(self, items: Sequence[tuple[MemoryRequest, list[int]]]) -> list[AnswerScore | None]:
        """One batch of score requests; None where vLLM did not compute every answer position."""
        preps = [self.prepare(r, cont) for r, cont in items]
        outs = self.llm.generate([p.prompt for p in preps], [p.params for p in preps], use_tqdm=False) if preps else []
        scores: list[AnswerScore | None] = []
        for (_, cont), p, out in zip(items, preps, outs):
            # the first answer token's logprob comes from the logits of the prompt's last position
            computed = (out.num_cached_tokens or 0) <= p.prompt_tokens - 1
            tail = (out.prompt_logprobs or [])[-len(cont):]
            if not computed or len(tail) != len(cont) or any(d is None or t not in d for t, d in zip(cont, tail)):
                scores.append(None)
            else:
                scores.append(AnswerScore([float(d[t].logprob) for t, d in zip(cont, tail)], p.fact_ids))
        return scores


__all__ = ["AnswerScore", "ContextFull", "MemoryComposer", "MemoryLLM", "MemoryLLMConfig", "MemoryOutput", "MemoryRequest",
           "PlanError", "Prepared"]
