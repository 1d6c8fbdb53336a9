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

A recovery policy (`inferscale.common.recovery`) may recompute part of the memory. vLLM's
connector injects a prefix of the prompt, so only prefix-compatible policies (`none`, `last:N`,
`all`) are served here: the plan stops where the first recomputed fact starts and vLLM prefills
the rest, those facts included, attending to every injected one. `heads:N` needs the JAX engine.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from inferscale.common.gate import Calibration, decide, encoding_key
from inferscale.common.layout import PromptLayout
from inferscale.common.modes import (
    SERVE_MODES,
)
from inferscale.common.plan import MemoryPlan, PlanError, Segment
from inferscale.common.recovery import RecoveryPolicy, injected_prefix, prefix_policy
from inferscale.common.storage.format import FactKV
from inferscale.config import ConnectorConfig, EngineSettings, check_str
from inferscale.encoders.torch_encoder import TorchFactEncoder
from inferscale.memory.service import MemoryConfig, MemoryService
from inferscale.retrieval.embedders import Embedder, MiniLMEmbedder


@dataclass(frozen=True)
class MemoryLLMConfig(EngineSettings):
    """`MemoryLLM`'s settings: the model and the memory root, and the shared `EngineSettings`
    (encoding, storage, retrieval, engine, connector), all keyword arguments."""

    model: str
    memory_root: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, str) or not Path(self.model, "config.json").is_file():
            raise ValueError(f"model must be a Hugging Face folder with config.json, got {self.model!r}")
        check_str("memory_root", self.memory_root)


@dataclass(frozen=True)
class MemoryRequest:
    """One request of `MemoryLLM.generate_many` / `score_many`. `fact_ids` None: retrieve the
    user's top-k facts for the question (mode "none" uses no facts)."""

    user: str
    question: str
    k: int = 10
    mode: str = "inject"
    fact_ids: tuple[str, ...] | None = None
    w: int | None = None
    max_tokens: int = 64
    cache_salt: str | None = None
    policy: str | None = None  # recovery policy of mode "inject" (None: plain injection)

    def __post_init__(self) -> None:
        if self.mode not in SERVE_MODES:
            raise ValueError(f"mode must be one of {SERVE_MODES}, got {self.mode!r}")
        served_policy(self.mode, self.policy)  # ValueError for a policy this mode cannot take
        if self.k < 0 or self.max_tokens < 1:
            raise ValueError(f"k must be >= 0 and max_tokens >= 1, got k={self.k}, max_tokens={self.max_tokens}")
        if self.fact_ids is not None and not isinstance(self.fact_ids, tuple):
            object.__setattr__(self, "fact_ids", tuple(self.fact_ids))


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
    num_injected: int  # prompt tokens whose KV the connector injected (planned)
    num_prompt: int
    ttft_s: float  # request in -> first token out, when max_tokens == 1; else time to the full answer
    timings: dict[str, float] = field(default_factory=dict)
    policy: str | None = None  # the recovery policy that served it (mode "inject")
    why: str = ""  # why this mode and policy (the gate's reason under mode "auto")


def served_policy(mode: str, policy: "str | RecoveryPolicy | None") -> str | None:
    """The recovery policy a request of `mode` is served with: for "inject" the given one if vLLM
    can serve it (prefix-compatible; default `none`); every other mode takes none ("auto" chooses
    its own). ValueError naming the problem otherwise."""
    if mode == "inject":
        return str(prefix_policy(policy))
    if policy is not None:
        raise ValueError("mode 'auto' chooses the recovery policy itself; do not pass one" if mode == "auto"
                         else f"a recovery policy applies to mode 'inject' only, got mode {mode!r}")
    return None


class MemoryComposer:
    """Everything between a request and vLLM, shared by `MemoryLLM` and the server: the memory
    service (retrieval), the shared header KV, prompt layout, the injection plan and its salt,
    and the vLLM engine arguments with the connector configured."""

    def __init__(self, config: MemoryLLMConfig, embedder: Embedder | None = None) -> None:
        self.config = config
        self.encoder = TorchFactEncoder(config.model, max_context=config.max_model_len, device=self._encoder_device(),
                                        encode_mode=config.encode_mode)
        if config.max_model_len > self.encoder.spec.max_position:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond what this model serves exactly "
                             f"({self.encoder.spec.max_position} positions: its context, sliding window or "
                             "LongRoPE original context); lower --max-model-len")
        self.builder = self.encoder.builder
        embedder = embedder or MiniLMEmbedder(query_weights=config.query_weights)
        self.memory = MemoryService(self.memory_config(config.w), self.encoder, embedder)
        self._by_w: dict[int, MemoryService] = {config.w: self.memory}
        self.header_key = self._ensure_header()
        # the quality gate of mode "auto" (None: uncalibrated, which serves text)
        self.calibration = Calibration.load(config.memory_root, self.encoder.fingerprint,
                                            encoding_key(config.context, config.w))

    def resolve(self, mode: str, k: int, policy: "str | RecoveryPolicy | None" = None) -> tuple[str, str | None, str]:
        """(mode, policy, why) to serve: mode "auto" asks the calibration for k facts (text when the
        model is not calibrated or no policy passed at that k); other modes are served as asked."""
        policy = served_policy(mode, policy)
        if mode != "auto":
            return mode, policy, f"mode {mode} requested"
        d = decide(self.calibration, k)
        return d.mode, d.policy, d.reason
    def _encoder_device(self) -> str:
        if self.config.encoder_device != "auto":
            return self.config.encoder_device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def memory_config(self, w: int) -> MemoryConfig:
        """The memory service config of window `w` (what `memory_for(w)` opens): this config's root,
        context, store dtype, index and storage."""
        c = self.config
        # no KV cache in this process: serving reads KV through the connector's tier, in the engine
        return MemoryConfig(root=c.memory_root, w=w, context=c.context, kv_dtype=c.kv_dtype, index=c.index,
                            catalog=c.catalog, kv_store=c.kv_store)

    def memory_for(self, w: int | None = None) -> MemoryService:
        """The memory service whose facts are encoded with context window `w` (default: the
        config's). Services of several w share the root, encoder and embedder; a user's store
        records its w, so a user is always served through the service it was written with."""
        w = self.config.w if w is None else w
        if w not in self._by_w:
            self._by_w[w] = MemoryService(self.memory_config(w), self.encoder, self.memory.embedder)
        return self._by_w[w]

    def _ensure_header(self) -> str:
        """The prompt header's KV (exact: it is always served first), in the shared store."""
        ids = list(self.builder.header_ids)
        key = "header~" + hashlib.sha256(repr(ids).encode()).hexdigest()[:24]
        store = self.memory.kv.open_or_create_shared(self.encoder.store_meta(0))  # where the connector reads it
        if key not in store:
            ((k, v),) = self.encoder.encode_ids([((), ids)])
            store.put([FactKV(key, ids, k, v, text="<prompt header>")])
        return key

    def engine_kwargs(self, **overrides) -> dict:
        """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` with the InferScale connector."""
        c = self.config
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(c.cpu_kv_cache_gib))  # vLLM CPU's own setting
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # vLLM reports usage to a public host by default
        os.environ.setdefault("DO_NOT_TRACK", "1")
        from vllm.config import KVTransferConfig

        kv = KVTransferConfig(
            kv_connector="InferScaleConnector",
            kv_connector_module_path="inferscale.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=ConnectorConfig(
                memory_root=str(Path(c.memory_root).resolve()), model_fingerprint=self.encoder.fingerprint,
                kv_store=c.kv_store, kv_load=c.kv_load, kv_load_cpus=c.kv_load_cpus,
                kv_write_threads=c.kv_write_threads, kv_write=c.kv_write, device_cache_bytes=c.device_cache_bytes,
                parent_pid=os.getpid()).to_extra(),  # the engine dies with this process
        )
        kwargs = dict(model=c.model, dtype=c.dtype, max_model_len=c.max_model_len, block_size=c.block_size,
                      enforce_eager=True, enable_prefix_caching=c.enable_prefix_caching,
                      enable_chunked_prefill=c.enable_chunked_prefill, kv_transfer_config=kv, seed=0)
        if c.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
        kwargs.update(overrides)
        return kwargs

    def compose(self, user: str, question: str, fact_ids: list[str],
                w: int | None = None, extra_tokens: int = 0,
                policy: "str | RecoveryPolicy | None" = None) -> tuple[PromptLayout, MemoryPlan]:
        """Prompt layout and injection plan for these facts of this user (validated, for a prompt
        of the layout plus `extra_tokens` appended tokens, e.g. an answer to score). The plan
        covers the prefix the recovery `policy` injects (default: header and every fact)."""
        fp = self.memory_for(w).fact_plan(user, fact_ids)
        layout = self.builder.layout([(fid, tokens) for fid, _, tokens in fp.facts], self.builder.question_ids(question))
        keys = {fid: key for fid, key, _ in fp.facts}
        n_inject = injected_prefix(prefix_policy(policy).mask(layout))
        segs = []
        for s in layout.segments[: 1 + len(fp.facts)]:
            if s.end > n_inject:
                break
            store, key = ("shared", self.header_key) if s.kind == "header" else ("user", keys[s.fact_id])
            segs.append(Segment(store, key, s.start, len(s.token_ids)))
        plan = MemoryPlan(user, fp.version, tuple(segs), fp.incarnation)
        plan.check_shape()
        plan.check_prompt(len(layout) + extra_tokens, self.config.max_model_len)
        return layout, plan

    @staticmethod
    def salt(plan: MemoryPlan, mode: str = "inject") -> str:
        """Prefix-cache salt of a memory request. Injected (approximate, per-user) KV is only ever
        shared with requests of the same user, incarnation and memory version, which would inject
        exactly the same KV; prompts whose KV vLLM computes itself ("text", "none") are exact and
        get a salt of their own (per user and incarnation), so they never reuse blocks an injection
        left in the cache. A user deleted and created again shares nothing with its former self, and
        requests that inject different prefixes (recovery policies) share nothing either."""
        kind = "inject" if mode == "inject" else "exact"
        key = f"inferscale:{kind}:{plan.user}:{plan.incarnation}"
        if kind == "inject":  # the injected length too: a block a policy recomputed is not an injected one
            key += f":{plan.version}:{plan.end}"
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    @staticmethod
    def scope_salt(scope: str) -> str:
        """Prefix-cache salt of a request without memory, for a scope (a tenant, or a tenant's
        user): such prompts share cached blocks only inside their scope, never across tenants."""
        return hashlib.sha256(f"inferscale:scope:{scope}".encode()).hexdigest()[:32]

    def build_request(self, user: str, question: str, fact_ids: list[str], mode: str, max_tokens: int,
                      logprobs: int | None, cache_salt: str | None = None, w: int | None = None,
                      continuation: Sequence[int] = (), policy: "str | RecoveryPolicy | None" = None, **sampling):
        """(TokensPrompt, SamplingParams, layout, plan) for one request; greedy unless `sampling`
        says otherwise. `cache_salt` replaces the per-(user, version) salt (never share one across users).
        `continuation`: token ids appended to the prompt after the assistant header (to score them
        with `prompt_logprobs`; the plan and the layout still describe the memory prompt alone).
        `policy`: the recovery policy of mode "inject" (see `compose`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if mode not in SERVE_MODES:
            raise ValueError(f"mode must be one of {SERVE_MODES}, got {mode!r}")
        mode, policy, _ = self.resolve(mode, len(fact_ids), policy)
        layout, plan = self.compose(user, question, fact_ids if mode != "none" else [], w, len(continuation),
                                    policy)
        extra = {"kv_transfer_params": plan.to_params()} if mode == "inject" else None
        sampling.setdefault("temperature", 0.0)
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, extra_args=extra, **sampling)
        prompt = TokensPrompt(prompt_token_ids=list(layout.token_ids) + list(continuation),
                              cache_salt=cache_salt or self.salt(plan, mode))
        return prompt, params, layout, plan


class MemoryLLM(MemoryComposer):
    """The offline engine (`vllm.LLM`) with memory: one call, one answer."""

    def __init__(self, config: MemoryLLMConfig, embedder: Embedder | None = None, **llm_kwargs) -> None:
        super().__init__(config, embedder)
        from vllm import LLM

        self.llm = LLM(**self.engine_kwargs(**llm_kwargs))

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes) and close the memory
        services. Idempotent; the object is unusable afterwards. Also on leaving a `with` block."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for svc in self._by_w.values():
            svc.close()

    def __enter__(self) -> "MemoryLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- generation --------------------------------------------------------------------------
    def generate(self, user: str, question: str, k: int = 10, mode: str = "inject", max_tokens: int = 64,
                 fact_ids: list[str] | None = None, logprobs: int | None = 1,
                 cache_salt: str | None = None, w: int | None = None, policy: str | None = None) -> MemoryOutput:
        """Retrieve the user's top-k facts (or use `fact_ids`), compose, and answer greedily.

        `cache_salt` replaces the per-(user, memory version) prefix-cache salt (benchmarks: a fresh
        salt per request defeats vLLM's prefix cache). Never share a salt across users."""
        req = MemoryRequest(user, question, k, mode, None if fact_ids is None else tuple(fact_ids), w, max_tokens,
                            cache_salt, policy)
        return self.generate_many([req], logprobs)[0]

    def _retrieve(self, r: MemoryRequest) -> list[str]:
        if r.mode == "none":
            return []
        if r.fact_ids is not None:
            return list(r.fact_ids)
        return [f.fact_id for f in self.memory_for(r.w).search(r.user, r.question, r.k)]

    def generate_many(self, requests: Sequence[MemoryRequest], logprobs: int | None = None) -> list[MemoryOutput]:
        """Answer every request greedily in one vLLM batch (the engine schedules them together).

        Raises `PlanError` before anything is submitted if any request cannot be composed. Timings:
        "search" and "compose" are per request; "engine" and `ttft_s` are the whole batch's call
        (with one request, its time to the full answer)."""
        t0 = time.perf_counter()
        built, times, served = [], [], []
        for r in requests:
            a = time.perf_counter()
            ids = self._retrieve(r)
            b = time.perf_counter()
            mode, policy, why = self.resolve(r.mode, len(ids), r.policy)
            served.append((mode, policy, why))
            built.append((ids, *self.build_request(r.user, r.question, ids, mode, r.max_tokens, logprobs,
                                                   r.cache_salt, r.w, policy=policy)))
            times.append((b - a, time.perf_counter() - b))
        t1 = time.perf_counter()
        outs = self.llm.generate([p for _, p, *_ in built], [s for _, _, s, *_ in built], use_tqdm=False)
        t2 = time.perf_counter()
        results = []
        for (mode, policy, why), (ids, _, _, layout, plan), (ts, tc), out in zip(served, built, times, outs):
            c = out.outputs[0]
            lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs or [])] if logprobs else []
            total = (t1 - t0) / len(requests) + (t2 - t1) if len(requests) > 1 else t2 - t0
            results.append(MemoryOutput(c.text, list(c.token_ids), lps, ids, mode,
                                        plan.end if mode == "inject" else 0, len(layout), total,
                                        {"search": ts, "compose": tc, "engine": t2 - t1}, policy, why))
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
            items.append((r, self._retrieve(r), cont))
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
        for r, ids, cont in items:
            salt = uuid.uuid4().hex if fresh_salt else r.cache_salt
            prompt, params, layout, _ = self.build_request(r.user, r.question, ids, r.mode, 1, None, salt, r.w,
                                                           continuation=cont, policy=r.policy, prompt_logprobs=0,
                                                           detokenize=False, skip_reading_prefix_cache=False)
            built.append((prompt, params, len(layout)))
        outs = self.llm.generate([b[0] for b in built], [b[1] for b in built], use_tqdm=False) if built else []
        scores: list[AnswerScore | None] = []
        for (_, ids, cont), (_, _, n_prompt), out in zip(items, built, outs):
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
