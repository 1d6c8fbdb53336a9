"""Phi-3 and Phi-4-mini: the Llama layout with fused projections and, on Phi-4-mini, partial rotary.

* `qkv_proj` holds q, k and v stacked on its output axis ([H*hd | KVH*hd | KVH*hd] rows): the JAX
  loader splits it into the canonical q/k/v projections and the torch encoder takes the pre-RoPE
  key (and the value) as slices of its output.
* `gate_up_proj` holds the MLP's gate and up projections ([F | F] rows, gate first).
* partial rotary (`partial_rotary_factor`, Phi-4-mini: 0.75) is read by `ModelSpec` for every family.
* longrope / su RoPE scaling (Phi-3 128k variants, Phi-4-mini) switches from its short to its long
  factors when a sequence (transformers) or the engine's max_model_len (vLLM) outgrows the
  original context (4096 on Phi-4-mini): InferScale serves it within that context, with the short
  factors and the attention factor (`ModelSpec` caps `max_position` there), where every engine
  rotates a position the same way whatever the sequence's length.
* a `sliding_window` bounds the served context (within the window attention is exact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferscale.common.model.families.base import Family, HFWeight, Target

if TYPE_CHECKING:
    from inferscale.common.model.spec import ModelSpec


class Phi3(Family):
    name = "phi3"
    description = "Phi-3, Phi-3.5-mini, Phi-4-mini (longrope within its original context); fused qkv / gate-up"

    def spec_fields(self, cfg: dict) -> dict:
        return {"qkv_bias": False, "qk_norm": False, "max_position": self.windowed_max_position(cfg)}

    def attention_weights(self, spec: "ModelSpec", p: str, layer: str) -> dict[str, HFWeight]:
        D, nq, nkv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        qkv = tuple(Target((layer, "self_attn", name, "kernel"), rows, transpose=True)
                    for name, rows in (("q_proj", slice(0, nq)), ("k_proj", slice(nq, nq + nkv)),
                                       ("v_proj", slice(nq + nkv, nq + 2 * nkv))))
        return {f"{p}self_attn.qkv_proj.weight": HFWeight((nq + 2 * nkv, D), qkv),
                f"{p}self_attn.o_proj.weight": HFWeight((D, nq), (Target((layer, "self_attn", "o_proj", "kernel"),
                                                                         transpose=True),))}

    def mlp_weights(self, spec: "ModelSpec", p: str, layer: str) -> dict[str, HFWeight]:
        D, F = spec.hidden_size, spec.intermediate_size
        gate_up = (Target((layer, "mlp", "gate_proj", "kernel"), slice(0, F), transpose=True),
                   Target((layer, "mlp", "up_proj", "kernel"), slice(F, 2 * F), transpose=True))
        return {f"{p}mlp.gate_up_proj.weight": HFWeight((2 * F, D), gate_up),
                f"{p}mlp.down_proj.weight": HFWeight((D, F), (Target((layer, "mlp", "down_proj", "kernel"),
                                                                     transpose=True),))}

    def kv_taps(self, attn, spec: "ModelSpec"):
        nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [(attn.qkv_proj, lambda out: {"k": out[..., nq: nq + nkv], "v": out[..., nq + nkv:]})]


FAMILY = Phi3()
