"""Torch fact encoder (transformers): Context-Window Encoding into the common store format.

Captures each layer's pre-RoPE keys and values with forward hooks on the modules the family names
(`Family.kv_taps`: `k_proj` / `v_proj`, `k_norm` for q/k-norm families, slices of a fused
`qkv_proj`), keeps the fact tokens' rows, and returns `FactKV`s that are interchangeable with the
JAX encoder's: same prompt plans
(`PromptBuilder.encode_plan`, `list_plan`), same model fingerprint, same store meta.

    kv:  [num_layers, n_fact_tokens, num_kv_heads, head_dim]
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from inferscale.common.layout import PromptBuilder
from inferscale.common.memory import Fact, Turn
from inferscale.common.families import family
from inferscale.common.spec import ModelSpec, model_fingerprint
from inferscale.common.store import FactKV, StoreMeta, fact_kvs


class TorchFactEncoder:
    def __init__(self, model_dir: str | Path, *, max_context: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, batch_size: int = 8) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_dir = Path(model_dir)
        self.spec = ModelSpec.from_pretrained(model_dir)
        self.fingerprint = model_fingerprint(model_dir, self.spec)
        self.max_context = min(max_context or 4096, self.spec.max_position)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.builder = PromptBuilder.for_tokenizer(self.tokenizer, self.max_context)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
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
    def encode_ids(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(context ids, fact ids) items -> per item (k, v), each [L, n_fact, KVH, D] (numpy)."""
        with self._lock:
            return self._encode_ids(items)

    def _encode_ids(self, items) -> list[tuple[np.ndarray, np.ndarray]]:
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
                k = torch.stack([ks[l] for l in range(self.spec.num_layers)]).float().cpu().numpy()
                v = torch.stack([vs[l] for l in range(self.spec.num_layers)]).float().cpu().numpy()
                for row, i in enumerate(idx):
                    a, n = len(items[i][0]), len(items[i][1])
                    out[i] = (k[:, row, a : a + n].copy(), v[:, row, a : a + n].copy())
        finally:
            for h in handles:
                h.remove()
        return out

    def encode_windowed(self, facts: Sequence[Fact], windows: Sequence[Sequence[Turn]], w: int) -> list[FactKV]:
        """Encode each fact after the prompt header and its window turns."""
        plans = self.builder.windowed_plans(facts, windows)
        return fact_kvs(facts, plans, self.encode_ids(plans), {"w": w})

    def encode_listed(self, facts: Sequence[Fact], previous: Sequence[Sequence[Fact]], w: int) -> list[FactKV]:
        """List-context encoding: each fact after the prompt header and the facts before it in the
        memory (`previous[i]`, the `w` before it), rendered as the memory block renders them."""
        plans = self.builder.listed_plans(facts, previous)
        return fact_kvs(facts, plans, self.encode_ids(plans), {"w": w, "context": "facts"})
