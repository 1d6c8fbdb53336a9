"""Qwen2 / Qwen2.5: the Llama layout with a bias on the q, k and v projections."""

from inferscale.common.model.families.base import Family


class Qwen2(Family):
    name = "qwen2"
    description = "Qwen2, Qwen2.5 (incl. Coder), qkv bias"

    def spec_fields(self, cfg: dict) -> dict:
        return {"qkv_bias": True, "qk_norm": False}


FAMILY = Qwen2()
