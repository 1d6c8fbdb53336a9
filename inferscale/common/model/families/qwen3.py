"""Qwen3: RMSNorm on each head's queries and keys before RoPE; the stored key is `k_norm`'s output."""

from inferscale.common.model.families.base import Family


class Qwen3(Family):
    name = "qwen3"
    description = "Qwen3 (dense), q/k RMSNorm"

    def spec_fields(self, cfg: dict) -> dict:
        return {"qkv_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True}


FAMILY = Qwen3()
