"""What one model family needs from InferScale, in one place (`Family`); one module per family.

A family reads its own `config.json` fields, names its weights and says where the pre-RoPE keys
and the values come from. The engines never branch on a family's name:

* `ModelSpec.from_hf_config` asks `spec_fields(cfg)` for the family's architecture switches
  (bias on q/k/v, q/k norm) and `check_config(cfg)` for what it refuses;
* the JAX loader asks `hf_weights(spec)` which Hugging Face tensor (or which rows of a fused one)
  fills each parameter of the canonical JAX model (`inferscale.jax.model`);
* the torch encoder asks `kv_taps(attn, spec)` which module outputs to capture as K and V.

    class MyFamily(Family):              # a new family: one file, plus its tiny test model
        name = "my_model_type"

        def spec_fields(self, cfg): ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from inferscale.common.model.spec import ModelSpec


@dataclass(frozen=True)
class Target:
    """A parameter of the canonical JAX model filled from (rows of) one HF tensor.

    path: the Flax params path; rows: the slice of the HF tensor's first axis (a fused projection
    holds several); transpose: HF Linear weights are [out, in], Flax Dense kernels [in, out]."""

    path: tuple[str, ...]
    rows: slice | None = None
    transpose: bool = False


@dataclass(frozen=True)
class HFWeight:
    """One Hugging Face tensor: its full shape and the parameters it fills."""

    shape: tuple[int, ...]
    targets: tuple[Target, ...]


# A torch forward hook's output -> the captured tensors by name ("k", "v"), each [B, T, out].
Tap = tuple[Any, Callable[[Any], dict]]


class Family:
    """The Llama layout; a family overrides what differs."""

    name: str = ""
    description: str = ""

    # -- config.json ---------------------------------------------------------------------------
    def text_config(self, cfg: dict) -> dict:
        """The decoder's settings (a multimodal config nests them under `text_config`)."""
        return cfg

    def check_config(self, cfg: dict) -> None:
        """Raise `UnsupportedModelError` for settings this family's support does not cover."""

    def spec_fields(self, cfg: dict) -> dict:
        """Family-specific `ModelSpec` fields."""
        return {"qkv_bias": bool(cfg.get("attention_bias", False)), "qk_norm": False}

    @staticmethod
    def windowed_max_position(cfg: dict) -> int:
        """The longest sequence served exactly by a family whose attention is windowed when the config
        sets `sliding_window`: within the window, attention is full causal attention."""
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window")
        return min(max_pos, int(window)) if window else max_pos

    # -- weights -------------------------------------------------------------------------------
    def canonical_weight_name(self, name: str) -> str:
        """A checkpoint tensor's name as `hf_weights` spells it (a multimodal checkpoint nests the
        decoder's under its own prefix); names the model does not use are ignored by the loader."""
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"

    def attention_weights(self, spec: "ModelSpec", p: str, layer: str) -> dict[str, HFWeight]:
        """q, k, v, o projections (and q/k norms) of one layer: separate q_proj/k_proj/v_proj."""
        D, H, KVH, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        out = {}
        for name, n in {"q_proj": H * hd, "k_proj": KVH * hd, "v_proj": KVH * hd}.items():
            out[f"{p}self_attn.{name}.weight"] = HFWeight((n, D), (Target((layer, "self_attn", name, "kernel"),
                                                                          transpose=True),))
            if spec.qkv_bias:
                out[f"{p}self_attn.{name}.bias"] = HFWeight((n,), (Target((layer, "self_attn", name, "bias")),))
        out[f"{p}self_attn.o_proj.weight"] = HFWeight((D, H * hd), (Target((layer, "self_attn", "o_proj", "kernel"),
                                                                           transpose=True),))
        if spec.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{p}self_attn.{name}.weight"] = HFWeight((hd,), (Target((layer, "self_attn", name, "weight")),))
        return out

    def mlp_weights(self, spec: "ModelSpec", p: str, layer: str) -> dict[str, HFWeight]:
        """Gated MLP of one layer: separate gate_proj/up_proj, then down_proj."""
        D, F = spec.hidden_size, spec.intermediate_size
        out = {f"{p}mlp.{name}.weight": HFWeight((F, D), (Target((layer, "mlp", name, "kernel"), transpose=True),))
               for name in ("gate_proj", "up_proj")}
        out[f"{p}mlp.down_proj.weight"] = HFWeight((D, F), (Target((layer, "mlp", "down_proj", "kernel"),
                                                                   transpose=True),))
        return out

    def hf_weights(self, spec: "ModelSpec") -> dict[str, HFWeight]:
        """Every HF tensor the canonical model needs, by its name in the checkpoint."""
        D = spec.hidden_size
        out = {"model.embed_tokens.weight": HFWeight((spec.vocab_size, D), (Target(("embed_tokens", "embedding")),)),
               "model.norm.weight": HFWeight((D,), (Target(("norm", "weight")),))}
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = HFWeight((spec.vocab_size, D), (Target(("lm_head", "kernel"), transpose=True),))
        for i in range(spec.num_layers):
            p, layer = f"model.layers.{i}.", f"layers_{i}"
            out.update(self.attention_weights(spec, p, layer))
            out.update(self.mlp_weights(spec, p, layer))
            for norm in self.layer_norms(spec):
                out[f"{p}{norm}.weight"] = HFWeight((D,), (Target((layer, norm, "weight")),))
        return out

    @staticmethod
    def layer_norms(spec: "ModelSpec") -> tuple[str, ...]:
        """The RMSNorms of one decoder layer: pre-attention and pre-MLP, plus the post-attention
        and post-MLP ones of sandwich-norm layers (Gemma: there `post_attention_layernorm` is the
        attention output's norm and `pre_feedforward_layernorm` the MLP input's)."""
        norms = ("input_layernorm", "post_attention_layernorm")
        return norms + (("pre_feedforward_layernorm", "post_feedforward_layernorm") if spec.sandwich_norm else ())

    # -- the torch encoder ---------------------------------------------------------------------
    def decoder(self, hf_model):
        """The transformers decoder (embeddings + layers) inside an `AutoModelForCausalLM`."""
        return hf_model.model

    def kv_taps(self, attn, spec: "ModelSpec") -> list[Tap]:
        """(module, output -> {"k"|"v": tensor [B, T, KVH * hd]}) pairs on one HF attention module:
        the pre-RoPE key is the output of `k_norm` (q/k-norm families) or `k_proj`."""
        k_mod = attn.k_norm if spec.qk_norm else attn.k_proj
        return [(k_mod, lambda out: {"k": out}), (attn.v_proj, lambda out: {"v": out})]
