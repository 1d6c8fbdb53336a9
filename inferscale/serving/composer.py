"""`MemoryComposer`: everything between a request and vLLM, shared by `MemoryLLM` and the server.

    composer = MemoryComposer(MemoryLLMConfig(model="path/to/hf_model", memory_root="mem"))
    mode, policy, why = composer.resolve("auto", k=10)              # the model's quality gate
    layout, plan = composer.compose("alice", "Where does Tom live?", ["f1", "f2"])  # or a FactPlan
    prompt, params = composer.engine_request(layout, plan, mode, max_tokens=64)

It owns the memory service (retrieval), the shared prompt header's KV, prompt layout, the
injection plan and its prefix-cache salt, vLLM's sampling parameters, and the engine arguments
with the connector configured (`ConnectorConfig`). Requests go through `inferscale.serving.prepare`,
which reads the memory and calls these methods once each.

A recovery policy (`inferscale.common.prompt.recovery`) may recompute part of the memory. The plan
stops after the last fact with an injected position, and vLLM prefills the rest (`last:N`: the
last N facts, attending to every injected one); recomputed positions before that point
(`heads:N`) are the plan's `recompute` runs, which the connector computes with the engine's own
model before the forward pass (`inferscale.vllm.recompute`). `keys:S` and `blend:R` need the JAX
engine.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from inferscale.gate.calibration import Calibration, decide, settings_key
from inferscale.common.prompt.layout import PromptLayout, fit_turns
from inferscale.common.modes import CHAT_LAYOUTS, WHOLE_MEMORY
from inferscale.common.prompt.plan import MemoryPlan, PlanSegment
from inferscale.common.prompt.plan_signing import load_secret, secret_path, sign
from inferscale.common.prompt.recovery import RecoveryPolicy, connector_policy, memory_end, recompute_runs
from inferscale.common.storage.format import FactKV
from inferscale.config import ConnectorConfig, EngineSettings, check_choice, check_str, section
from inferscale.encoders.torch_encoder import TorchFactEncoder
from inferscale.memory.chain import MemoryChain
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import FactPlan, MemoryConfig
from inferscale.retrieval.embedders import Embedder, MiniLMEmbedder
from inferscale.serving.request import served_policy
from inferscale.serving.salts import memory_salt, scope_salt
from inferscale.serving.sampling import JSON_LAYOUT, json_layout, sampling_params  # noqa: F401 - re-exported


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


class ContextFull(ValueError):
    """The prompt leaves no room to answer in the model's context; `field` names what to change."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


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
        # each user's whole memory, encoded jointly after the prompt header
        self.chain = MemoryChain(self.memory, self.encoder, self.builder.header_ids, config.chain_budget)
        # every plan is signed: the connector injects only what this secret signed (common.prompt.plan_signing)
        self.plan_secret = load_secret(secret_path(config.memory_root, config.plan_secret_file))
        # the quality gate of mode "auto" (None: uncalibrated, which serves text), decided within the
        # operator's tolerance when the config names one
        self.calibration = Calibration.find(config.memory_root, self.encoder.fingerprint,
                                            settings_key(config))
        if self.calibration is not None and config.tolerance is not None:
            self.calibration = self.calibration.at_tolerance(config.tolerance)

    def resolve(self, mode: str, k: "int | str", policy: "str | RecoveryPolicy | None" = None
                ) -> tuple[str, str | None, str]:
        """(mode, policy, why) to serve: mode "auto" serves the whole memory (k "all") from the
        user's memory chain, and asks the calibration for k facts (text when the model is not
        calibrated or no policy passed at that k); other modes are served as asked."""
        policy = served_policy(mode, policy)
        if mode != "auto":
            return mode, policy, f"mode {mode} requested"
        if k == WHOLE_MEMORY:
            return "chain", None, "the whole memory (k: all) is served from the memory chain: exact, as text is"
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
        # no KV cache in this process: serving reads KV through the connector's tier, in the engine
        return section(MemoryConfig, self.config, root=self.config.memory_root, w=w)

    def memory_for(self, w: int | None = None) -> MemoryService:
        """The memory service whose facts are encoded with context window `w` (default: the
        config's). Services of several w share the root, encoder and embedder; a user's store
        records its w, so a user is always served through the service it was written with."""
        w = self.config.w if w is None else w
        if w not in self._by_w:
            self._by_w[w] = MemoryService(self.memory_config(w), self.encoder, self.memory.embedder)
        return self._by_w[w]

    def close(self) -> None:
        """Close the memory services of every window (the chain's extensions finish first: close
        `chain` before this). Idempotent."""
        for svc in self._by_w.values():
            svc.close()

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
            kv_connector_extra_config=section(
                ConnectorConfig, c, memory_root=str(Path(c.memory_root).resolve()),
                plan_secret_file=str(secret_path(c.memory_root, c.plan_secret_file).resolve()),
                model_fingerprint=self.encoder.fingerprint,
                parent_pid=os.getpid()).to_extra(),  # the engine dies with this process
        )
        from vllm.config import StructuredOutputsConfig

        from inferscale.vllm.model_access import EXTENSION

        kwargs = dict(model=c.model, dtype=c.dtype, max_model_len=c.max_model_len, block_size=c.block_size,
                      worker_extension_cls=EXTENSION,  # hands vLLM's model to the connector (heads:N)
                      enforce_eager=True, enable_prefix_caching=c.enable_prefix_caching,
                      enable_chunked_prefill=c.enable_chunked_prefill, kv_transfer_config=kv, seed=0,
                      # JSON answers (response_format) through llguidance (broad JSON-schema support),
                      # without free whitespace between tokens: a model cannot spend its answer on blanks
                      structured_outputs_config=StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True))
        if c.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
        kwargs.update(overrides)
        return kwargs

    def compose(self, user: str, question: str, facts: "FactPlan | Sequence[str]",
                w: int | None = None, extra_tokens: int = 0,
                policy: "str | RecoveryPolicy | None" = None,
                boundary: bool | None = None, chain: int | None = None, repeat: FactPlan | None = None
                ) -> tuple[PromptLayout, MemoryPlan]:
        """Prompt layout and injection plan of the question alone after these facts of this user
        (their `FactPlan`, or their ids to read it for), validated for a prompt of the layout plus
        `extra_tokens` appended tokens (e.g. an answer to score). The plan covers the prefix the
        recovery `policy` injects (default: header and every fact). `boundary`: end the memory with
        `layout.BOUNDARY` (default: `memory_boundary`). `chain`: the first `chain` facts are the
        user's memory chain (`whole_memory`), injected from its links. `repeat`: facts repeated as
        text after the memory (`PromptBuilder.repeat_ids`; the whole memory's most relevant)."""
        fp = self._fact_plan(user, facts, w)
        layout = self.builder.layout([(fid, tokens) for fid, _, tokens in fp.facts], self.builder.question_ids(question),
                                     self._with_boundary(boundary), self._repeat(repeat))
        return layout, self._plan(user, layout, fp, policy, extra_tokens, chain)

    def _repeat(self, repeat: FactPlan | None) -> list[int]:
        return self.builder.repeat_ids([tokens for _, _, tokens in repeat.facts]) if repeat is not None else []

    def _fact_plan(self, user: str, facts: "FactPlan | Sequence[str]", w: int | None) -> FactPlan:
        return facts if isinstance(facts, FactPlan) else self.memory_for(w).fact_plan(user, list(facts))

    def whole_memory(self, user: str, question: str, filters=None) -> tuple[list, int, FactPlan]:
        """(facts, n, plan) of a whole-memory request (k "all"): the user's facts in the order they
        were added, the first `n` within the chain's budget, then the `chain_rest_k` most relevant
        of the others (`MemoryChain.select`), and their plan. Served as text, these are the chain's
        prompt token for token."""
        return self.chain.select(user, question, self.config.chain_rest_k, filters)

    def served_chain(self, user: str, layout: PromptLayout, plan: MemoryPlan, n: int, extend: bool = True
                     ) -> dict[str, int]:
        """Record a chain plan of `n` chain facts, and schedule the encoding of the links it lacked
        (`extend`; not for a filtered memory, whose links are not the user's chain): {"facts": n,
        "stored": links injected}."""
        n = min(n, len(layout.facts))
        stored = max(0, len(plan.segments) - 1)  # the header, then one segment per link
        link_tokens = plan.end - len(self.builder.header_ids) if stored else 0
        self.chain.count(stored, link_tokens, sum(len(s.token_ids) for s in layout.facts[stored:n]))
        if extend and stored < n:
            self.chain.schedule(user)
        return {"facts": n, "stored": stored}

    def compose_chat(self, user: str, messages: Sequence[dict], facts: "FactPlan | Sequence[str]",
                     policy: "str | RecoveryPolicy | None" = None, room: int = 1,
                     w: int | None = None, boundary: bool | None = None,
                     chat_layout: str | None = None, mode: str = "text",
                     whole: bool = False, chain: int | None = None, repeat: FactPlan | None = None
                     ) -> tuple[PromptLayout, MemoryPlan, dict[str, int]]:
        """Layout and plan of a chat with memory served in `mode`, as `chat_layout` places it (see
        `chat_layout`; `whole`: the facts are the whole memory, k "all"): history-first (the
        system prompts and earlier turns, then the facts inside the new user turn, then its text;
        `PromptBuilder.history_ids`) or memory-first (the facts' block first, then the whole chat;
        `PromptBuilder.conversation_ids`). When it leaves fewer than `room` tokens to answer in,
        the oldest turns go first, then the last facts (the least relevant, retrieval ranks best
        first); what went is returned (`{"turns": n, "facts": m}`). `ContextFull` when the new
        message alone does not fit. `facts`, `chain` (mode "chain") and `repeat`: as `compose` says
        (`repeat` memory-first only)."""
        fp = self._fact_plan(user, facts if mode != "none" else [], w)
        facts = [(fid, tokens) for fid, _, tokens in fp.facts]
        boundary = self._with_boundary(boundary)
        history = self.chat_layout(mode, chat_layout, whole) == "history-first"
        repeated = self._repeat(repeat)
        if repeated and history:
            raise ValueError("repeated facts follow the whole memory, which is laid out memory-first")
        budget = self.config.max_model_len - room - (len(self.builder.boundary_ids) if boundary else 0) - \
            (0 if history else len(self.builder.header_ids)) - len(repeated)

        def render(msgs: Sequence[dict]) -> list[int]:
            if not history:
                return self.builder.conversation_ids(msgs)
            before, after = self.builder.history_ids(msgs, memory=bool(facts))
            return before + after

        messages, turns, conversation = fit_turns(messages, budget - sum(len(t) for _, t in facts), render)
        dropped_facts = 0
        while facts and sum(len(t) for _, t in facts) + len(conversation) > budget:
            facts.pop()
            dropped_facts += 1
        if len(conversation) > budget:
            raise ContextFull(f"the new message alone ({len(conversation)} tokens with the prompt's header) "
                              f"leaves no room to answer in the model's context of {self.config.max_model_len} "
                              "tokens", "messages")
        kept = {fid for fid, _ in facts}
        fp = FactPlan(fp.version, fp.incarnation, [f for f in fp.facts if f[0] in kept])
        if history:
            before, after = self.builder.history_ids(messages, memory=bool(facts))
            layout = self.builder.history_layout(facts, before, after, boundary and bool(facts))
        else:
            layout = self.builder.chat_layout(facts, conversation, boundary, repeated)
        if mode == "chain" and chain is None:
            chain = len(layout.facts)
        return layout, self._plan(user, layout, fp, policy, 0, chain if mode == "chain" else None), \
            {"turns": turns, "facts": dropped_facts}

    def chat_layout(self, mode: str, chat_layout: str | None = None, whole: bool = False) -> str:
        """The layout a chat served in `mode` gets: memory-first for the chain (its links were
        encoded after the header alone); `chat_layout` when given; else memory-first for the whole
        memory (k "all": the same facts every turn, so memory and chat stay one prefix); else the
        config's, where "auto" is history-first for text (vLLM's prefix cache then reuses the
        conversation from turn to turn) and memory-first for inject (the conversation is then
        prefilled by vLLM, which is faster than the connector computing it before the memory)."""
        if mode == "chain":
            if chat_layout not in (None, "auto", "memory-first"):
                raise ValueError(f"chat_layout must be memory-first for mode chain, got {chat_layout!r}")
            return "memory-first"
        name = check_choice(chat_layout or ("memory-first" if whole else self.config.chat_layout), CHAT_LAYOUTS,
                            "chat_layout")
        if name == "auto":
            return "memory-first" if mode == "inject" else "history-first"
        return name

    def _with_boundary(self, boundary: bool | None) -> bool:
        return self.config.memory_boundary if boundary is None else bool(boundary)

    def plain_chat(self, messages: Sequence[dict], room: int = 1) -> tuple[list[int], dict[str, int]]:
        """Token ids of a chat without memory (the chat template alone, as vLLM's chat endpoint
        renders it), the oldest turns dropped while fewer than `room` tokens are left to answer."""
        _, turns, ids = fit_turns(messages, self.config.max_model_len - room, self.builder.plain_ids)
        if len(ids) > self.config.max_model_len - room:
            raise ContextFull(f"the new message alone ({len(ids)} tokens) leaves no room to answer in the model's "
                              f"context of {self.config.max_model_len} tokens", "messages")
        return ids, {"turns": turns, "facts": 0}

    def _plan(self, user: str, layout: PromptLayout, fp: FactPlan, policy, extra_tokens: int,
              chain: int | None = None) -> MemoryPlan:
        """The injection plan of `layout`: its injected segments up to the last one `policy` injects,
        with every computed position before that point (the policy's, and a history-first chat's
        conversation) a recompute run. A plan with no segments when nothing is injected. With
        `chain`, the header and the stored links of the first `chain` facts (`_chain_plan`)."""
        if chain is not None:
            return self._chain_plan(user, layout, fp, chain, extra_tokens)
        keys = {fid: key for fid, key, _ in fp.facts}
        mask = connector_policy(policy).mask(layout)
        n_inject = memory_end(layout, mask)
        segs = []
        for s in layout.segments:
            if s.start >= n_inject:
                break
            if s.action == "inject":
                store, key = ("shared", self.header_key) if s.kind == "header" else ("user", keys[s.fact_id])
                segs.append(PlanSegment(store, key, s.start, len(s.token_ids)))
        plan = MemoryPlan(user, fp.version, tuple(segs), fp.incarnation, recompute_runs(mask, n_inject))
        if segs:
            plan.check_shape()
            plan.check_prompt(len(layout) + extra_tokens, self.config.max_model_len)
        return plan

    def _chain_plan(self, user: str, layout: PromptLayout, fp: FactPlan, n: int, extra_tokens: int) -> MemoryPlan:
        """The header and the longest stored prefix of the first `n` facts' links: everything after
        it (facts whose links are not stored yet, the rest of the prompt) vLLM prefills."""
        head = layout.segments[0]
        if head.kind != "header":
            raise ValueError("the memory chain is served memory-first, after the prompt header")
        facts = layout.facts[:n]
        keys = self.chain.keys(fp.incarnation, [s.token_ids for s in facts])
        m = self.chain.stored(user, keys)
        segs = [PlanSegment("shared", self.header_key, 0, len(head.token_ids))]
        segs += [PlanSegment("user", key, s.start, len(s.token_ids)) for key, s in zip(keys[:m], facts)]
        plan = MemoryPlan(user, fp.version, tuple(segs), fp.incarnation)
        plan.check_shape()
        plan.check_prompt(len(layout) + extra_tokens, self.config.max_model_len)
        return plan

    salt = staticmethod(memory_salt)  # the prefix-cache salt of a memory request (`serving.salts`)
    scope_salt = staticmethod(scope_salt)  # ... of a request without memory
    sampling_params = staticmethod(sampling_params)  # vLLM's SamplingParams (`serving.sampling`)

    def engine_request(self, layout: PromptLayout, plan: MemoryPlan, mode: str, max_tokens: int,
                       logprobs: int | None = None, cache_salt: str | None = None, continuation: Sequence[int] = (),
                       policy: "str | RecoveryPolicy | None" = None, **sampling):
        """(TokensPrompt, SamplingParams) of a composed prompt served in `mode` ("inject" carries
        the plan, composed with recovery `policy`, to the connector); salted as `salt` says unless
        `cache_salt` is given."""
        from vllm.inputs import TokensPrompt

        ids = list(layout.token_ids) + list(continuation)
        inject = mode in ("inject", "chain") and plan.segments  # a plan that injects nothing is plain prefill
        extra = {"kv_transfer_params": sign(plan.to_params(), ids, self.plan_secret)} if inject else None
        params = self.sampling_params(max_tokens, logprobs=logprobs, extra_args=extra, **sampling)
        prompt = TokensPrompt(prompt_token_ids=ids,
                              cache_salt=cache_salt or self.salt(plan, mode, policy))
        return prompt, params

    def plain_request(self, ids: Sequence[int], scope: str, max_tokens: int, cache_salt: str | None = None,
                      continuation: Sequence[int] = (), **sampling):
        """(TokensPrompt, SamplingParams) of a prompt without memory (`plain_chat`), salted for
        `scope` (see `scope_salt`) unless `cache_salt` is given; `continuation` as `engine_request`'s."""
        from vllm.inputs import TokensPrompt

        ids = list(ids) + list(continuation)
        room = self.config.max_model_len - len(ids)
        params = self.sampling_params(max(1, min(max_tokens, room)), **sampling)
        return TokensPrompt(prompt_token_ids=ids, cache_salt=cache_salt or self.scope_salt(scope)), params
