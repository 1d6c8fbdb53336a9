"""vLLM's sampling parameters, the one place they are built: greedy unless asked otherwise, and
JSON answers laid out as models write JSON (structured outputs through llguidance)."""

from __future__ import annotations

import json


# How JSON answers are laid out (llguidance's `x-guidance` options of a schema): the separators
# models write on their own (", " and ": "), and no other whitespace. Compact JSON (",", ":") is
# off the models' distribution: Qwen2.5-Coder-1.5B answers an extraction with `{"facts":[]}` under
# it and lists the facts under this; free whitespace would let a model spend its answer on blanks.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def json_layout(structured: dict) -> dict:
    """`structured` (StructuredOutputsParams fields) with JSON answers laid out as `JSON_LAYOUT`
    says, unless the schema says otherwise (its own `x-guidance`): `json_object` becomes the schema
    of any object."""
    out = dict(structured)
    if out.pop("json_object", None):
        out["json"] = {"type": "object"}
    schema = out.get("json")
    if isinstance(schema, str):
        schema = json.loads(schema)
    if isinstance(schema, dict) and "x-guidance" not in schema:
        out["json"] = {**schema, "x-guidance": dict(JSON_LAYOUT)}
    return out


def sampling_params(max_tokens: int, **kwargs):
    """vLLM's SamplingParams, greedy unless `temperature` says otherwise (the one place they are built)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs.setdefault("temperature", 0.0)
    if isinstance(kwargs.get("structured_outputs"), dict):  # {"json": schema} / {"json_object": True}
        kwargs["structured_outputs"] = StructuredOutputsParams(**json_layout(kwargs["structured_outputs"]))
    return SamplingParams(max_tokens=max_tokens, **kwargs)
