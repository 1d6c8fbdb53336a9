"""Gemma 3: sliding-window and global layers with their own RoPE bases, and the Gemma block.

* `layer_types` (or, in older configs, `sliding_window_pattern`: every n-th layer is global) says
  which layers attend to the last `sliding_window` positions only; those rotate with the local base
  (`rope_local_base_freq`, default 10,000), the global ones with `rope_theta` (default 1,000,000)
  and its scaling (`linear`, factor 8 on the 4B and larger models). Newer configs give both under
  `rope_parameters` keyed by layer type.
* q/k RMSNorm per head; the stored pre-RoPE key is `k_norm`'s output (transformers applies it
  to [B, heads, T, hd], so the tap transposes it back to [B, T, heads, hd]).
* RMSNorm scales by (1 + weight); each block is wrapped in sandwich norms (pre- and post-attention,
  pre- and post-feedforward); GELU-tanh gated MLP; token embeddings times sqrt(hidden_size);
  queries scaled by `query_pre_attn_scalar ** -0.5`; optional final-logit soft-capping.
* `gemma3` (multimodal) checkpoints: the decoder's settings sit under `text_config` and its weights
  under `model.language_model.` (or `language_model.model.` in older exports); only the text
  decoder is used.
* Attention-logit soft-capping (Gemma 2) and bidirectional attention (EmbeddingGemma) are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferscale.common.model.families.base import Family

if TYPE_CHECKING:
    from inferscale.common.model.spec import ModelSpec

_LOCAL_THETA, _GLOBAL_THETA = 10_000.0, 1_000_000.0
_DECODER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."))


class Gemma3(Family):
    name = "gemma3_text"
    description = "Gemma 3 (text decoder), sliding-window + global layers"

    def text_config(self, cfg: dict) -> dict:
        if "text_config" in cfg:  # a `gemma3` (multimodal) checkpoint
            text = dict(cfg["text_config"])
            text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
            return text
        return cfg

    def check_config(self, cfg: dict) -> None:
        from inferscale.common.model.families import UnsupportedModelError

        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError("Gemma attention-logit soft-capping (attn_logit_softcapping) is not supported")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional Gemma 3 (use_bidirectional_attention) is not a causal decoder")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"Gemma 3 hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")

    def spec_fields(self, cfg: dict) -> dict:
        from inferscale.common.model.spec import rope_from_config

        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:
            every = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:  # keyed by layer type
            full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
            rope = rope_from_config({}, full, head_dim, theta=full.get("rope_theta") or _GLOBAL_THETA)
            local_rope = rope_from_config({}, local, head_dim, theta=local.get("rope_theta") or _LOCAL_THETA)
        else:
            rope = rope_from_config({}, cfg.get("rope_scaling") or {}, head_dim,
                                    theta=cfg.get("rope_theta") or _GLOBAL_THETA)
            local_rope = rope_from_config({}, {}, head_dim, theta=cfg.get("rope_local_base_freq") or _LOCAL_THETA)
        return {"qkv_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True,
                "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "layer_types": tuple(types), "sliding_window": int(cfg.get("sliding_window") or 4096),
                "rope": rope, "local_rope": local_rope, "norm_offset": 1.0, "sandwich_norm": True,
                "hidden_act": "gelu_tanh", "embed_scale": True,
                "attn_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                "final_logit_softcap": cfg.get("final_logit_softcapping")}

    def canonical_weight_name(self, name: str) -> str:
        for prefix, canonical in _DECODER_PREFIXES:
            if name.startswith(prefix):
                return canonical + name[len(prefix):]
        return super().canonical_weight_name(name)

    def decoder(self, hf_model):
        inner = hf_model.model
        return getattr(inner, "language_model", inner)

    def kv_taps(self, attn, spec: "ModelSpec"):
        # transformers normalises k after moving heads forward: k_norm's output is [B, KVH, T, hd]
        return [(attn.k_norm, lambda out: {"k": out.transpose(1, 2)}), (attn.v_proj, lambda out: {"v": out})]


FAMILY = Gemma3()
