"""How JSON answers are laid out under structured outputs (`composer.json_layout`): the separators
models write on their own, no free whitespace, and a schema's own layout kept."""

import json

from inferscale.serving.composer import JSON_LAYOUT, json_layout


def test_every_json_answer_is_laid_out_as_models_write_json():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert json_layout({"json": schema}) == {"json": {**schema, "x-guidance": JSON_LAYOUT}}
    assert json_layout({"json_object": True}) == {"json": {"type": "object", "x-guidance": JSON_LAYOUT}}
    assert json_layout({"json": json.dumps(schema)})["json"]["x-guidance"] == JSON_LAYOUT  # a schema given as text
    assert "x-guidance" not in schema  # the caller's schema is not changed
    # json.dumps's own separators: what the models saw in training
    assert json.dumps({"a": [1, 2]}) == '{"a": [1, 2]}' and (JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"]) == (", ", ": ")


def test_a_schema_with_its_own_layout_and_other_outputs_are_kept():
    own = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    assert json_layout({"json": own}) == {"json": own}
    assert json_layout({"regex": "[a-z]+"}) == {"regex": "[a-z]+"}
    assert json_layout({"choice": ["yes", "no"]}) == {"choice": ["yes", "no"]}
