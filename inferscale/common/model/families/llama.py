"""Llama (1-3.x): the base layout; RoPE scaling "llama3" is read by `ModelSpec` for every family."""

from inferscale.common.model.families.base import Family


class Llama(Family):
    name = "llama"
    description = "Llama 1-3.x (llama3 RoPE scaling), SmolLM"


FAMILY = Llama()
