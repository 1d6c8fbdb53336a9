"""Torch fact encoder (transformers): Context-Window Encoding into the common store format.

Captures each layer's pre-RoPE keys and values with forward hooks on the modules the family names
(`Family.kv_taps`: `k_proj` / `v_proj`, `k_norm` for q/k-norm families, slices of a fused
`qkv_proj`), keeps the fact tokens' rows, and returns `FactKV`s that are interchangeable with the
JAX encoder's: same prompt plans
(`PromptBuilder.encode_plan`, `list_plan`), same model fingerprint, same store meta.

`encode_mode="one-pass"` (default) runs the items as packed prefix trees (`inferscale.common.
packing`: shared prefixes once, a 4-D attention mask of each token's ancestors, position ids of its
own item); `"per-fact"` runs each item as its own sequence and is the reference. On CPU, masked
rows run with `inferscale.encoders.tiled_attention` (`attention="tiled"`, the default there: each
query tile over only the keys it sees); `attention="sdpa"` (dense masked SDPA, the default on a
GPU) is its reference.

    kv:  [num_layers, n_fact_tokens, num_kv_heads, head_dim]
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from inferscale.common.prompt.conversation_pass import conversation_plan
from inferscale.common.facts import Fact, Turn
from inferscale.common.model.families import family
from inferscale.common.prompt.layout import PromptBuilder
from inferscale.common.modes import ENCODE_MODES
from inferscale.common.prompt.packing import (
    PackPlan,
    batch_rows,
    check_items,
    pack_items,
    row_budget,
)
from inferscale.common.model.spec import ModelSpec, model_fingerprint
from inferscale.common.storage.format import FactKV, StoreMeta, fact_kvs
from inferscale.encoders.tiled_attention import ATTENTION_IMPLS, use_tiled_attention

Progress = Callable[[int, int], None]  # (rows run, rows in all)


class TorchFactEncoder:
    def __init__(self, model_dir: str | Path, *, max_context: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int = 8, encode_mode: str = "one-pass",
                 attention: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if encode_mode not in ENCODE_MODES:
            raise ValueError(f"encode_mode must be one of {', '.join(ENCODE_MODES)}, got {encode_mode!r}")
        if attention is None:  # tiled on CPU; a GPU's dense masked kernels need no per-tile host loop
            attention = "tiled" if torch.device(device).type == "cpu" else "sdpa"
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_IMPLS)}, got {attention!r}")
        self.encode_mode, self.attention = encode_mode, attention
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.fingerprint = model_fingerprint(model_dir, self.spec)
        self.max_context = min(max_context or 4096, self.spec.max_position)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.builder = PromptBuilder.for_tokenizer(self.tokenizer, self.max_context)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        if attention == "tiled":  # masked rows attend over the keys they see (`tiled_attention`); causal rows as before
            use_tiled_attention(self.model)
        self._decoder = family(self.spec.family).decoder(self.model)  # embeddings + layers, no lm_head
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self._lock = threading.Lock()  # the capture hooks sit on the shared modules: one encode at a time

    def store_meta(self, w: int, context: str = "turns") -> StoreMeta:
        dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[self.dtype]
        return StoreMeta.for_model(self.spec, self.fingerprint, dtype=dtype, w=w, context=context)

    def _capture(self):
        """Forward hooks collecting per-layer pre-RoPE K and V: ([B,T,KVH,D] per layer) x 2."""
        ks, vs, handles = {}, {}, []
        s = self.spec
        fam = family(s.family)
        for i, layer in enumerate(self._decoder.layers):
            for module, take in fam.kv_taps(layer.self_attn, s):  # where this family's K and V come from

                def hook(_mod, _inp, out, i=i, take=take):
                    for name, t in take(out).items():
                        (ks if name == "k" else vs)[i] = t.reshape(t.shape[0], t.shape[1], s.num_kv_heads, s.head_dim)

                handles.append(module.register_forward_hook(hook))
        return ks, vs, handles

    @torch.inference_mode()
    def encode_ids(self, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                   progress: Progress | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """(context ids, fact ids) items -> per item (k, v), each [L, n_fact, KVH, D] (numpy).
        `progress(rows run, rows in all)` is called after each batch of rows the model runs."""
        check_items(items, self.max_context, self.batch_size)
        with self._lock:
            if self.encode_mode == "one-pass":
                return self._encode_packed(items, progress)
            return self._encode_ids(items, progress)

    def _kv_of(self, ks, vs) -> tuple[np.ndarray, np.ndarray]:
        """Captured layers -> (k, v), each [L, B, T, KVH, D] float32 numpy."""
        k = torch.stack([ks[l] for l in range(self.spec.num_layers)]).float().cpu().numpy()
        v = torch.stack([vs[l] for l in range(self.spec.num_layers)]).float().cpu().numpy()
        return k, v

    def _tree_mask(self, rows, T: int):
        """The rows' ancestor masks as the decoder takes them: [B, 1, T, T] bool, or one per layer
        type when layers differ (Gemma 3's sliding layers see only their window)."""
        def stack(window):
            return torch.from_numpy(np.stack([r.visible(T, window) for r in rows])[:, None]).to(self.device)

        if self.spec.layer_types is None:
            return stack(None)
        return {"full_attention": stack(None), "sliding_attention": stack(self.spec.sliding_window)}

    def _encode_packed(self, items, progress: Progress | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """One pass: each shared prefix once (`pack_items`), each token attending to its ancestors."""
        if not items:
            return []
        return self._run_plan(pack_items(items, row_budget(items)), progress)

    def _run_plan(self, plan: PackPlan, progress: Progress | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Run a plan's rows (chains causally, the others with their masks); per item (k, v)."""
        rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        ks, vs, handles = self._capture()
        try:
            for idx in batch_rows(plan, self.batch_size):
                batch = [plan.rows[r] for r in idx]
                T = max(len(r) for r in batch)
                tokens = torch.zeros((len(idx), T), dtype=torch.long)
                positions = torch.zeros((len(idx), T), dtype=torch.long)
                for b, row in enumerate(batch):
                    tokens[b, : len(row)] = torch.from_numpy(row.tokens)
                    positions[b, : len(row)] = torch.from_numpy(row.positions)
                if batch[0].is_chain:  # plain causal attention is exact; right padding stays invisible
                    self._decoder(input_ids=tokens.to(self.device), use_cache=False)
                else:
                    self._decoder(input_ids=tokens.to(self.device), position_ids=positions.to(self.device),
                                  attention_mask=self._tree_mask(batch, T), use_cache=False)
                k, v = self._kv_of(ks, vs)
                for b, r in enumerate(idx):
                    rows[r] = (k[:, b], v[:, b])
                if progress is not None:
                    progress(len(rows), len(plan.rows))
        finally:
            for h in handles:
                h.remove()
        return [(rows[r][0][:, at].copy(), rows[r][1][:, at].copy()) for r, at in plan.where]

    def _encode_ids(self, items, progress: Progress | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per fact (the reference): each item its own causal sequence."""
        out: list = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]))
        ks, vs, handles = self._capture()
        try:
            for b in range(0, len(order), self.batch_size):
                idx = order[b : b + self.batch_size]
                T = max(len(items[i][0]) + len(items[i][1]) for i in idx)
                tokens = torch.zeros((len(idx), T), dtype=torch.long)
                for row, i in enumerate(idx):  # right padding: causal attention keeps it invisible
                    ids = list(items[i][0]) + list(items[i][1])
                    tokens[row, : len(ids)] = torch.tensor(ids)
                self._decoder(input_ids=tokens.to(self.device), use_cache=False)
                k, v = self._kv_of(ks, vs)
                for row, i in enumerate(idx):
                    a, n = len(items[i][0]), len(items[i][1])
                    out[i] = (k[:, row, a : a + n].copy(), v[:, row, a : a + n].copy())
                if progress is not None:
                    progress(min(b + self.batch_size, len(order)), len(order))
        finally:
            for h in handles:
                h.remove()
        return out

    @property
    def extends_kv(self) -> bool:
        """Whether `encode_after` serves this model: one rotary embedding for every layer (not
        Gemma 3's sliding layers, which rotate with their own)."""
        return self.spec.layer_types is None and hasattr(self._decoder, "rotary_emb")

    @torch.inference_mode()
    def encode_after(self, prefix_k: np.ndarray, prefix_v: np.ndarray, ids: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) of `ids`, [L, n, KVH, D] each, encoded after a prefix of which only the pre-RoPE KV
        is given (`prefix_k`, `prefix_v`: [L, T, KVH, D], at positions 0..T-1): the prefix's keys are
        rotated as the model rotates them into the decoder's cache, and only `ids` run. The KV of
        one pass over the prefix's tokens and `ids` (tests/encoders: equal on every family)."""
        if not self.extends_kv:
            raise NotImplementedError(f"{self.spec.family}: its layers do not share one rotary embedding")
        n_prefix = prefix_k.shape[1]
        check_items([(range(n_prefix), ids)], self.max_context, 1)
        import importlib

        from transformers import DynamicCache

        apply_rope = importlib.import_module(type(self._decoder.layers[0].self_attn).__module__).apply_rotary_pos_emb
        cache = DynamicCache()
        positions = torch.arange(n_prefix, device=self.device)[None]
        for layer in range(prefix_k.shape[0]):
            k = torch.from_numpy(np.ascontiguousarray(prefix_k[layer])).to(self.device, self.dtype).transpose(0, 1)[None]
            v = torch.from_numpy(np.ascontiguousarray(prefix_v[layer])).to(self.device, self.dtype).transpose(0, 1)[None]
            cos, sin = self._decoder.rotary_emb(k, position_ids=positions)  # [1, T, D]: as the layers rotate
            _, k = apply_rope(k, k, cos, sin)
            cache.update(k, v, layer)  # [1, KVH, T, D], post-RoPE, as the decoder's own cache holds it
        with self._lock:
            ks, vs, handles = self._capture()
            try:
                self._decoder(input_ids=torch.tensor([list(ids)], device=self.device),
                              position_ids=torch.arange(n_prefix, n_prefix + len(ids), device=self.device)[None],
                              past_key_values=cache, use_cache=True)
                k_out, v_out = self._kv_of(ks, vs)
            finally:
                for h in handles:
                    h.remove()
        return k_out[:, 0].copy(), v_out[:, 0].copy()

    def encode_windowed(self, facts: Sequence[Fact], windows: Sequence[Sequence[Turn]], w: int,
                        progress: Progress | None = None) -> list[FactKV]:
        """Encode each fact after the prompt header and its window turns."""
        plans = self.builder.windowed_plans(facts, windows)
        return fact_kvs(facts, plans, self.encode_ids(plans, progress), {"w": w})

    def encode_conversation(self, facts: Sequence[Fact], spans: Sequence[Sequence[Turn]], w: int,
                            share: bool = True, progress: Progress | None = None) -> list[FactKV]:
        """Conversation encoding (`inferscale.common.prompt.conversation_pass`): each fact's window read
        from one pass over its span; `share=False` runs each fact's span on its own (the reference)."""
        items = self.builder.span_items(facts, spans, w)
        plan = conversation_plan(self.builder.header_ids, items, w, self.max_context, share=share)
        with self._lock, torch.inference_mode():
            kvs = self._run_plan(plan, progress) if items else []
        return fact_kvs(facts, [((), it.fact) for it in items], kvs, {"w": w, "context": "conversation"})

    def encode_listed(self, facts: Sequence[Fact], previous: Sequence[Sequence[Fact]], w: int,
                      progress: Progress | None = None) -> list[FactKV]:
        """List-context encoding: each fact after the prompt header and the facts before it in the
        memory (`previous[i]`, the `w` before it), rendered as the memory block renders them."""
        plans = self.builder.listed_plans(facts, previous)
        return fact_kvs(facts, plans, self.encode_ids(plans, progress), {"w": w, "context": "facts"})
