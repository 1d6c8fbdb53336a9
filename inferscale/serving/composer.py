"""`MemoryComposer`: everything between a request and vLLM, shared by `MemoryLLM` and the server.

    composer = MemoryComposer(MemoryLLMConfig(model="path/to/hf_model", memory_root="mem"))
    mode, policy, why = composer.resolve("auto", k=10)              # the model's quality gate
    prompt, params, layout, plan = composer.build_request("alice", "Where does Tom live?", ids, mode, 64, None)

It owns the memory service (retrieval), the shared prompt header's KV, prompt layout, the
injection plan and its prefix-cache salt, vLLM's sampling parameters, and the engine arguments
with the connector configured (`ConnectorConfig`). One request at a time goes through
`inferscale.serving.prepare`.

A recovery policy (`inferscale.common.recovery`) may recompute part of the memory. vLLM's
connector injects a prefix of the prompt, so only prefix-compatible policies (`none`, `last:N`,
`all`) are served here: the plan stops where the first recomputed fact starts and vLLM prefills
the rest, those facts included, attending to every injected one. `heads:N` needs the JAX engine.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inferscale.common.gate import Calibration, decide, encoding_key
from inferscale.common.layout import PromptLayout
from inferscale.common.modes import (
    SERVE_MODES,
)
from inferscale.common.plan import MemoryPlan, Segment
from inferscale.common.recovery import RecoveryPolicy, injected_prefix, prefix_policy
from inferscale.common.storage.format import FactKV
from inferscale.config import ConnectorConfig, EngineSettings, check_str
from inferscale.encoders.torch_encoder import TorchFactEncoder
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig
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
        from vllm.inputs import TokensPrompt

        if mode not in SERVE_MODES:
            raise ValueError(f"mode must be one of {SERVE_MODES}, got {mode!r}")
        if mode == "auto":  # callers that resolved already pass the served mode: the gate runs once
            mode, policy, _ = self.resolve(mode, len(fact_ids), policy)
        else:
            policy = served_policy(mode, policy)
        layout, plan = self.compose(user, question, fact_ids if mode != "none" else [], w, len(continuation),
                                    policy)
        extra = {"kv_transfer_params": plan.to_params()} if mode == "inject" else None
        params = self.sampling_params(max_tokens, logprobs=logprobs, extra_args=extra, **sampling)
        prompt = TokensPrompt(prompt_token_ids=list(layout.token_ids) + list(continuation),
                              cache_salt=cache_salt or self.salt(plan, mode))
        return prompt, params, layout, plan

    def plain_request(self, question: str, scope: str, max_tokens: int, **sampling):
        """(TokensPrompt, SamplingParams, prompt tokens) of a request without memory, salted for
        `scope` (see `scope_salt`); SamplingParams None when the prompt leaves no room to answer.
        ValueError when the question alone is longer than the model's context."""
        from vllm.inputs import TokensPrompt

        ids = self.builder.layout([], self.builder.question_ids(question)).token_ids
        room = self.config.max_model_len - len(ids)
        params = self.sampling_params(min(max_tokens, room), **sampling) if room >= 1 else None
        return TokensPrompt(prompt_token_ids=list(ids), cache_salt=self.scope_salt(scope)), params, len(ids)

    @staticmethod
    def sampling_params(max_tokens: int, **kwargs):
        """vLLM's SamplingParams, greedy unless `temperature` says otherwise (the one place they are built)."""
        from vllm import SamplingParams

        kwargs.setdefault("temperature", 0.0)
        return SamplingParams(max_tokens=max_tokens, **kwargs)
