"""The JAX research engine: encode facts, then answer by joint prefill or by KV injection.

    engine = Engine.from_pretrained("path/to/hf_model")
    kv = engine.encode_facts(facts, conversation, w=5)          # list[FactKV], pre-RoPE
    ans = engine.answer("Where does Tom live?", kv, mode="inject")
    ans.text, ans.ttft_s, ans.timings
    ans = engine.answer("Where does Tom live?", kv, policy=RecoveryPolicy.parse("heads:4"))

A recovery policy (`inferscale.common.prompt.recovery`) marks memory positions "recompute": they are
computed at their serving positions after every injected position is written, so each attends to
everything before it (injected or computed), and the paged attention's position mask keeps later
positions out. Any mask works here, not only a prefix; `blend:R` chooses its mask from the stored
KV's deviation from joint prefill at layer 1 (`kv_deviation`).

One sequence at a time (a research engine, not a server). Scheduling (layout, blocks, slots) is
plain Python/numpy; tensor work is three jitted functions: the dense encoder forward, the paged
forward over new tokens, and the chunked-RoPE injection of stored KV.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inferscale.common.prompt.conversation_pass import conversation_plan
from inferscale.common.facts import Conversation, Fact, Turn
from inferscale.common.storage.kvquant import QUANTIZED
from inferscale.common.prompt.layout import PromptBuilder, PromptLayout
from inferscale.common.modes import JAX_MODES
from inferscale.common.prompt.recovery import RecoveryPolicy
from inferscale.common.model.spec import ModelSpec, model_fingerprint
from inferscale.common.storage.format import CompactKV, FactKV, StoreMeta, fact_kvs
from inferscale.jax.cache import BlockAllocator, block_table, init_cache, slots_for
from inferscale.jax.encoder import EncodeItem, bucket, encode_items, encode_packed, run_plan
from inferscale.jax.inject import inject_compact_pallas, inject_compact_reference, inject_pallas, inject_reference
from inferscale.jax.model import PagedBatch, Transformer, TreeMask
from inferscale.jax.rope import rope_tables
from inferscale.jax.engine_config import DTYPES, Answer, EngineConfig
from inferscale.jax.weights import eos_token_ids, load_params

BLEND_LAYER = 1  # the layer whose KV deviation `blend:R` selects by (CacheBlend uses an early one)
QUANTIZED_JAX = {"int8": np.int8, "float8_e4m3": jnp.float8_e4m3fn}  # how stored codes are viewed


class Engine:
    def __init__(self, model_dir: str | Path, spec: ModelSpec, params: dict, tokenizer,
                 fingerprint: str, config: EngineConfig) -> None:
        self.model_dir = Path(model_dir)
        self.spec = spec
        self.params = params
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.config = config
        self.max_context = min(config.max_context or 4096, spec.max_position)
        kernels = config.kernels
        if kernels == "auto":
            kernels = "pallas" if jax.default_backend() == "gpu" else "reference"
        self.kernels = kernels
        self.dtype = DTYPES[config.dtype]
        self.model = Transformer(spec, kernels=kernels, dtype=self.dtype)
        self.builder = PromptBuilder.for_tokenizer(tokenizer, self.max_context)
        bs = config.block_size
        self.max_blocks = -(-self.max_context // bs)
        self.allocator = BlockAllocator(self.max_blocks + 1)
        self.cache = init_cache(spec, self.max_blocks + 1, bs, self.dtype)
        self.table = rope_tables(spec, bucket(self.max_context))  # [R, 2, positions, r // 2]
        self.eos_ids = eos_token_ids(tokenizer, self.model_dir)
        self._dense_kv = jax.jit(self._dense_kv_fn)
        self._tree_kv = jax.jit(self._tree_kv_fn)
        self._paged = jax.jit(self._paged_fn, donate_argnums=(1,))
        self._inject = jax.jit(self._inject_fn, donate_argnums=(0,))
        self._inject_compact = jax.jit(self._inject_compact_fn, donate_argnums=(0,))
        self._header_kv: tuple[np.ndarray, np.ndarray] | None = None
        self._group: tuple[jax.Array, jax.Array] | None = None  # APE, during one sequence: (memory, mass)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> "Engine":
        """Load a Hugging Face folder (config.json, safetensors, tokenizer with a chat template)."""
        from transformers import AutoTokenizer

        config = config or EngineConfig()
        spec = ModelSpec.from_pretrained(model_dir)
        fp = model_fingerprint(model_dir, spec)
        params = load_params(model_dir, spec, fp, DTYPES[config.dtype], config.checkpoint_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(model_dir, spec, params, tokenizer, fp, config)

    def store_meta(self, w: int, context: str = "turns") -> StoreMeta:
        return StoreMeta.for_model(self.spec, self.fingerprint, dtype=self.config.dtype, w=w, context=context)

    # -- jitted tensor work ----------------------------------------------------------------
    def _dense_kv_fn(self, params, tokens, positions):
        cos, sin = self.table[:, 0][:, positions], self.table[:, 1][:, positions]  # [R, B, T, r // 2]
        _, _, kvs = self.model.apply({"params": params}, tokens, cos, sin, want_logits=False)
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])  # [L, B, T, KVH, D]

    def _tree_kv_fn(self, params, tokens, positions, visible):
        cos, sin = self.table[:, 0][:, positions], self.table[:, 1][:, positions]  # [R, B, T, r // 2]
        tree = TreeMask(visible=visible, positions=positions)
        _, _, kvs = self.model.apply({"params": params}, tokens, cos, sin, want_logits=False, tree=tree)
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])  # [L, B, T, KVH, D]

    def _paged_fn(self, params, cache, tokens, positions, slots, table, logit_index, memory=None, mass=None):
        cos, sin = self.table[:, 0][:, positions][:, None], self.table[:, 1][:, positions][:, None]
        paged = PagedBatch(slots=slots, block_table=table, positions=positions, memory=memory, mass=mass)
        logits, cache, _ = self.model.apply({"params": params}, tokens[None], cos, sin, cache=cache,
                                            paged=paged, logit_index=logit_index[None])
        return logits[0], cache

    def _inject_compact_fn(self, cache, k, v, k_scale, v_scale, token_fact, positions, slots):
        """Quantised memory: codes [L, n, KVH, D], scales [L, F, KVH, D]; dequantised, rotated and
        written in one pass per layer."""
        inject = inject_compact_pallas if self.kernels == "pallas" else inject_compact_reference
        return self._each_layer(cache, positions, lambda l, kc, vc, cos, sin, rope: inject(
            kc, vc, k[l], v[l], k_scale[l], v_scale[l], token_fact, cos, sin, slots, rope))

    def _inject_fn(self, cache, k, v, positions, slots):
        inject = inject_pallas if self.kernels == "pallas" else inject_reference
        return self._each_layer(cache, positions, lambda l, kc, vc, cos, sin, rope: inject(
            kc, vc, k[l], v[l], cos, sin, slots, rope))

    def _each_layer(self, cache, positions, write):
        """`write(layer, k_cache, v_cache, cos, sin, rope)` on every layer's flat cache view, each
        layer with its own RoPE table at `positions`; returns the new cache."""
        cos, sin = self.table[:, 0][:, positions], self.table[:, 1][:, positions]  # [R, n, r // 2]
        out = []
        for layer, (kc, vc) in enumerate(cache):
            nb, bs = kc.shape[:2]
            i = self.spec.layer_rope_index(layer)
            kf, vf = write(layer, kc.reshape(nb * bs, *kc.shape[2:]), vc.reshape(nb * bs, *vc.shape[2:]),
                           cos[i], sin[i], self.spec.ropes[i])
            out.append((kf.reshape(kc.shape), vf.reshape(vc.shape)))
        return out

    # -- encoding --------------------------------------------------------------------------
    def _forward_kv(self, tokens, positions):
        return self._dense_kv(self.params, jnp.asarray(tokens), jnp.asarray(positions))

    def _forward_tree_kv(self, tokens, positions, visible):
        return self._tree_kv(self.params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(visible))

    def encode_ids(self, items: Sequence[EncodeItem | tuple[Sequence[int], Sequence[int]]],
                   progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
        """(context ids, fact ids) items -> per item (k, v), each [L, n_fact, KVH, D] (numpy), run
        as `config.encode_mode` says (one pass over shared prefixes, or fact by fact)."""
        items = [it if isinstance(it, EncodeItem) else EncodeItem(tuple(it[0]), tuple(it[1])) for it in items]
        if self.config.encode_mode == "one-pass":
            return encode_packed(self._forward_tree_kv, self._forward_kv, items, self.max_context,
                                 self.config.encode_batch_size, progress)
        return encode_items(self._forward_kv, items, self.max_context, self.config.encode_batch_size, progress)

    def encode_facts(self, facts: Sequence[Fact], conversation: Conversation | None = None, w: int = 0,
                     progress=None) -> list[FactKV]:
        """Context-Window Encoding of facts: each after the header and its `w` preceding turns."""
        windows = [conversation.context_window(f, w) if conversation is not None else [] for f in facts]
        return self.encode_windowed(facts, windows, w, progress)

    def encode_windowed(self, facts: Sequence[Fact], windows: Sequence[Sequence[Turn]], w: int,
                        progress=None) -> list[FactKV]:
        """Encode each fact after the header and the given window turns (the memory service's entry)."""
        plans = self.builder.windowed_plans(facts, windows)
        return fact_kvs(facts, plans, self.encode_ids(plans, progress), {"w": w})

    def encode_conversation(self, facts: Sequence[Fact], spans: Sequence[Sequence[Turn]], w: int,
                            progress=None, share: bool = True) -> list[FactKV]:
        """Conversation encoding (`inferscale.common.prompt.conversation_pass`, the memory service's entry
        for `context="conversation"`): each fact's window read from one pass over its span
        (`Conversation.context_span`); `share=False` runs each fact's span on its own (the reference)."""
        items = self.builder.span_items(facts, spans, w)
        plan = conversation_plan(self.builder.header_ids, items, w, self.max_context, share=share)
        kvs = run_plan(self._forward_tree_kv, self._forward_kv, plan, self.config.encode_batch_size,
                       progress) if items else []
        return fact_kvs(facts, [((), it.fact) for it in items], kvs, {"w": w, "context": "conversation"})

    def encode_listed(self, facts: Sequence[Fact], previous: Sequence[Sequence[Fact]], w: int,
                      progress=None) -> list[FactKV]:
        """List-context encoding (the memory service's entry for `context="facts"`): each fact after
        the header and the facts before it in the memory (`previous[i]`, the `w` before it), rendered
        as the memory block renders them (`PromptBuilder.list_plan`)."""
        plans = self.builder.listed_plans(facts, previous)
        return fact_kvs(facts, plans, self.encode_ids(plans, progress), {"w": w, "context": "facts"})

    def encode_after_facts(self, memory: Sequence[Fact], n: int, which: Sequence[int] | None = None,
                           progress=None) -> list[FactKV]:
        """List-context encoding of `memory[i]` (memory in its order) after the `n` facts before it,
        for every i in `which` (default: all)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        which = range(len(memory)) if which is None else which
        return self.encode_listed([memory[i] for i in which], [memory[max(0, i - n): i] for i in which], n, progress)

    def encode_exact(self, layout: PromptLayout) -> list[FactKV]:
        """Encode each fact of `layout` after exactly the tokens that precede it when served."""
        segs = layout.facts
        items = [EncodeItem(tuple(layout.prefix_ids(s)), s.token_ids) for s in segs]
        return [FactKV(s.fact_id, s.token_ids, k, v) for s, (k, v) in zip(segs, self.encode_ids(items))]

    def header_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """Pre-RoPE KV of the prompt header: computed once, exact (it is always served first)."""
        if self._header_kv is None:
            (self._header_kv,) = self.encode_ids([EncodeItem((), self.builder.header_ids)])
        return self._header_kv

    # -- serving ---------------------------------------------------------------------------
    def layout(self, question: str, facts: Sequence[FactKV | CompactKV]) -> PromptLayout:
        return self.builder.layout([(f.fact_id, f.token_ids.tolist()) for f in facts],
                                   self.builder.question_ids(question))

    def answer(self, question: str, facts: Sequence[FactKV | CompactKV], mode: str = "inject",
               max_new_tokens: int = 48, policy: RecoveryPolicy | None = None) -> Answer:
        """Greedy answer with the facts' memory, by injection (with an optional recovery policy: the
        facts laid out in its order, `RecoveryPolicy.arrange`) or by joint prefill of the text."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        t0 = time.perf_counter()
        facts = policy.arrange(facts) if policy is not None and mode == "inject" else facts
        layout = self.layout(question, facts)
        with self._sequence(len(layout) + max_new_tokens) as (blocks, table):
            logits, timings, n_inj = self._prefill(layout, facts, mode, (), blocks, table, t0, policy)
            tokens = [int(jnp.argmax(logits[0]))]
            ttft = time.perf_counter() - t0
            logps = [float(jax.nn.log_softmax(logits[0])[tokens[0]])]
            pos = len(layout)
            while len(tokens) < max_new_tokens and tokens[-1] not in self.eos_ids:
                lg = self._forward([tokens[-1]], pos, blocks, table, [0])[0]
                tokens.append(int(jnp.argmax(lg)))
                logps.append(float(jax.nn.log_softmax(lg)[tokens[-1]]))
                pos += 1
        timings["total"] = time.perf_counter() - t0
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True)
        return Answer(text.strip(), tokens, logps, ttft, timings, n_inj, len(layout) - n_inj)

    def score(self, question: str, facts: Sequence[FactKV | CompactKV], continuation: Sequence[int],
              mode: str = "inject", policy: RecoveryPolicy | None = None) -> np.ndarray:
        """Logits [1 + len(continuation), vocab] at the prompt's last token and each continuation token."""
        t0 = time.perf_counter()
        facts = policy.arrange(facts) if policy is not None and mode == "inject" else facts
        layout = self.layout(question, facts)
        with self._sequence(len(layout) + len(continuation)) as (blocks, table):
            logits, _, _ = self._prefill(layout, facts, mode, tuple(continuation), blocks, table, t0, policy)
        return np.asarray(logits)

    @contextmanager
    def _sequence(self, num_tokens: int):
        """Blocks (and their padded block table) for one sequence, freed afterwards."""
        if num_tokens > self.max_context:
            raise ValueError(f"sequence of {num_tokens} tokens (prompt + new tokens) would exceed the "
                             f"context of {self.max_context}")
        blocks = self.allocator.allocate(-(-num_tokens // self.config.block_size))
        try:
            # attention walks only this sequence's blocks (padded to a power of two: few shapes)
            width = min(bucket(len(blocks), 1), self.max_blocks)
            yield blocks, jnp.asarray(block_table(blocks, width))
        finally:
            self.allocator.free(blocks)
            self._group = None

    def _prefill(self, layout: PromptLayout, facts: Sequence[FactKV | CompactKV], mode: str, continuation: tuple,
                 blocks: list[int], table, t0: float, policy: RecoveryPolicy | None = None):
        """Inject the memory positions the policy keeps (mode "inject"; default policy "none") and
        compute every other position; logits at the prompt's last token and at each continuation
        token. Returns (logits, timings, number of injected tokens)."""
        if mode not in JAX_MODES:
            raise ValueError(f"mode must be one of {JAX_MODES}, got {mode!r}")
        if policy is not None and mode != "inject":
            raise ValueError("a recovery policy applies to mode 'inject' only")
        timings = {"compose": time.perf_counter() - t0}
        mask = np.zeros(len(layout), dtype=bool)
        if mode == "inject":
            policy = policy or RecoveryPolicy()
            deviation = None
            if policy.needs_deviation:
                deviation = self.kv_deviation(layout, [f.dequantized() if isinstance(f, CompactKV) else f
                                                       for f in facts])
            mask = policy.mask(layout, deviation)
            if policy.memory_mass != 1.0:  # APE: the injected facts' share of attention rescaled
                memory = np.zeros(int(table.shape[0]) * self.config.block_size, bool)
                for seg in layout.facts:
                    memory[seg.start : seg.end] = mask[seg.start : seg.end]
                self._group = (jnp.asarray(memory), jnp.float32(policy.memory_mass))
            t = time.perf_counter()
            self._inject_memory(layout, facts, blocks, mask, policy.key_scale)
            timings["inject"] = time.perf_counter() - t
        t = time.perf_counter()
        prompt = layout.token_ids
        computed = np.flatnonzero(~mask)  # ascending; always ends with the prompt's last position
        n = len(prompt)
        new = [prompt[p] for p in computed] + list(continuation)
        positions = np.concatenate([computed, np.arange(n, n + len(continuation))]).astype(np.int32)
        want = [len(computed) - 1] + [len(computed) + i for i in range(len(continuation))]
        logits = self._forward(new, positions, blocks, table, want)
        logits.block_until_ready()
        timings["prefill"] = time.perf_counter() - t
        return logits, timings, int(mask.sum())

    def kv_deviation(self, layout: PromptLayout, facts: Sequence[FactKV], layer: int = BLEND_LAYER) -> np.ndarray:
        """[len(layout)] float: per fact token, the squared distance of its stored K and V at `layer`
        from joint prefill's (0 elsewhere): what `blend:R` selects by (CacheBlend). Research cost:
        this runs the whole prompt through every layer; CacheBlend computes only the first ones."""
        ids = layout.token_ids
        T = bucket(len(ids))
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(ids)] = ids
        k, v = self._forward_kv(tokens, np.arange(T, dtype=np.int32)[None])  # [L, 1, T, KVH, D] pre-RoPE
        k, v = np.asarray(k[layer, 0]), np.asarray(v[layer, 0])
        by_id = {f.fact_id: f for f in facts}
        dev = np.zeros(len(ids))
        for seg in layout.facts:
            f, span = by_id[seg.fact_id], slice(seg.start, seg.end)
            dev[span] = ((f.k[layer] - k[span]) ** 2).sum((1, 2)) + ((f.v[layer] - v[span]) ** 2).sum((1, 2))
        return dev

    def _inject_memory(self, layout: PromptLayout, facts: Sequence[FactKV | CompactKV], blocks: list[int],
                       mask: np.ndarray, key_scale: float = 1.0) -> None:
        """Write the stored KV of every position where `mask` is True (rotated to that position);
        the facts' keys scaled by `key_scale` (`keys:S`; the header's never). Facts given as a
        quantised store keeps them (`CompactKV`) are dequantised inside the injection kernel."""
        by_id = {f.fact_id: f for f in facts}
        floats: list = []  # (k, v, positions) of float KV
        compact: dict[str, list] = {}  # quantised dtype -> (fact, selected tokens, positions)
        for seg in layout.segments:
            sel = np.flatnonzero(mask[seg.start : seg.end])
            if not len(sel):
                continue
            if seg.kind == "header":
                k, v = self.header_kv()
            elif seg.kind == "fact":
                f = by_id[seg.fact_id]
                if tuple(f.token_ids.tolist()) != seg.token_ids:  # fail closed: KV must match the span
                    raise ValueError(f"stored tokens of fact {seg.fact_id!r} differ from its prompt span")
                if isinstance(f, CompactKV) and f.dtype in QUANTIZED:
                    compact.setdefault(f.dtype, []).append((f, sel, seg.start + sel))
                    continue
                k, v = (f.k, f.v) if key_scale == 1.0 else (np.asarray(f.k, np.float32) * np.float32(key_scale), f.v)
            else:
                raise ValueError(f"a {seg.kind} segment has no stored KV to inject")
            floats.append((k[:, sel], v[:, sel], seg.start + sel))
        if floats:
            k = np.concatenate([k for k, _, _ in floats], axis=1)  # [L, n, KVH, D]
            v = np.concatenate([v for _, v, _ in floats], axis=1)
            pos = np.concatenate([p for _, _, p in floats])
            m = bucket(len(pos))
            positions, slots = self._slots(blocks, pos, m)
            pad = ((0, 0), (0, m - len(pos)), (0, 0), (0, 0))
            self.cache = self._inject(self.cache, jnp.asarray(np.pad(k, pad), self.dtype),
                                      jnp.asarray(np.pad(v, pad), self.dtype), positions, slots)
        for dtype, group in compact.items():
            self._inject_quantized(dtype, group, blocks, key_scale)

    def _inject_quantized(self, dtype: str, group: list, blocks: list[int], key_scale: float) -> None:
        """One dtype's quantised facts: codes [L, n, KVH, D] and scales [L, F, KVH, D] (`keys:S`
        scales the key scales, which is exact) into the compact injection kernel."""
        pos = np.concatenate([p for _, _, p in group])
        m = bucket(len(pos))
        positions, slots = self._slots(blocks, pos, m)
        pad = ((0, 0), (0, m - len(pos)), (0, 0), (0, 0))
        as_codes = lambda x: jnp.asarray(np.pad(x, pad).view(QUANTIZED_JAX[dtype]))  # noqa: E731
        k = as_codes(np.concatenate([f.k[:, sel] for f, sel, _ in group], axis=1))
        v = as_codes(np.concatenate([f.v[:, sel] for f, sel, _ in group], axis=1))
        k_scale = np.stack([f.k_scale for f, _, _ in group], axis=1) * np.float32(key_scale)
        v_scale = np.stack([f.v_scale for f, _, _ in group], axis=1)
        token_fact = np.zeros(m, np.int32)
        token_fact[: len(pos)] = np.repeat(np.arange(len(group)), [len(sel) for _, sel, _ in group])
        self.cache = self._inject_compact(self.cache, k, v, jnp.asarray(k_scale), jnp.asarray(v_scale),
                                          jnp.asarray(token_fact), positions, slots)

    def _slots(self, blocks: list[int], pos: np.ndarray, m: int) -> tuple[jax.Array, jax.Array]:
        """Positions and cache slots of `pos`, padded to m (padding: slot -1, writes nothing)."""
        positions = np.zeros(m, np.int32)
        positions[: len(pos)] = pos
        slots = np.full(m, -1, np.int32)
        slots[: len(pos)] = slots_for(blocks, pos, self.config.block_size)
        return jnp.asarray(positions), jnp.asarray(slots)

    def _forward(self, tokens: list[int], start, blocks: list[int], table, want: list[int]):
        """Compute `tokens` at serving positions `start` (an int: contiguous from there; or an array
        of positions) into the cache; logits at the indices `want` of `tokens`."""
        T, M = bucket(len(tokens), 1), bucket(len(want), 1)
        ids = np.zeros(T, np.int32)
        ids[: len(tokens)] = tokens
        positions = np.zeros(T, np.int32)
        positions[: len(tokens)] = (np.arange(start, start + len(tokens)) if np.isscalar(start)
                                    else np.asarray(start, np.int32))
        slots = np.full(T, -1, np.int32)
        slots[: len(tokens)] = slots_for(blocks, positions[: len(tokens)], self.config.block_size)
        idx = np.zeros(M, np.int32)
        idx[: len(want)] = want
        logits, self.cache = self._paged(self.params, self.cache, jnp.asarray(ids), jnp.asarray(positions),
                                         jnp.asarray(slots), table, jnp.asarray(idx), *(self._group or ()))
        return logits[: len(want)]
