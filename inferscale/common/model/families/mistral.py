"""Mistral: the Llama layout; a sliding window, if the config sets one, bounds the served context
(`ModelSpec.sliding_window`: within the window, attention is full and exact)."""

from inferscale.common.model.families.base import Family


class Mistral(Family):
    name = "mistral"
    description = "Mistral 7B (v0.1-v0.3), Ministral"

    def spec_fields(self, cfg: dict) -> dict:
        return {**super().spec_fields(cfg), "max_position": self.windowed_max_position(cfg)}


FAMILY = Mistral()
