"""The model families InferScale supports, one module each, registered here (plain Python).

    fam = family("qwen2")          # UnsupportedModelError naming the supported ones otherwise
    fam.hf_weights(spec)           # what the JAX loader reads; fam.kv_taps(...) for the torch encoder

Adding a family: a module with a `Family` subclass (see `base.py`), its entry in `_MODULES`, and
its tiny random model in `tests/tiny_models.py`; the shared test suite then covers it.
"""

from __future__ import annotations

from importlib import import_module

from inferscale.common.model.families.base import Family, HFWeight, Target

_MODULES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
_ALIASES = {"gemma3": "gemma3_text"}  # model_type of a multimodal checkpoint -> its decoder's family


class UnsupportedModelError(ValueError):
    """The config names a model family (or a setting of one) InferScale does not implement."""


def _registry() -> dict[str, Family]:
    fams = [import_module(f"{__name__}.{m}").FAMILY for m in _MODULES]
    return {f.name: f for f in fams}


FAMILIES: dict[str, Family] = _registry()
SUPPORTED_FAMILIES = tuple(FAMILIES)


def family(name: str | None) -> Family:
    name = _ALIASES.get(name, name)
    if name not in FAMILIES:
        raise UnsupportedModelError(f"unsupported model_type {name!r} in config.json; "
                                    f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    return FAMILIES[name]


__all__ = ["FAMILIES", "SUPPORTED_FAMILIES", "Family", "HFWeight", "Target", "UnsupportedModelError", "family"]
