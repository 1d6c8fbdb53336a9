"""Extraction through the served model's own engine (`EngineJsonLLM`): vLLM's structured outputs
hold even a tiny random model's answers to the extraction and decision schemas, and what it
extracts lands in memory as facts with their source turns; the embedded model (SmolLM2-135M-
Instruct, a real one) extracts facts that say what the messages say. Cases of the session's
engine processes (tests/vllm/conftest.py)."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")

TESTS = Path(__file__).resolve().parents[1]
PREAMBLE = """
import json, sys
sys.path.insert(0, {tests!r})
import jsonschema
from doubles import HashEmbedder
from inferscale.memory.extraction import Extractor, turns_from_messages
from inferscale.memory.extraction_llms import EngineJsonLLM
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

class Checked(EngineJsonLLM):  # every answer, checked against the schema it was decoded under
    answers = []
    def complete_json_many(self, calls, max_tokens):
        texts = super().complete_json_many(calls, max_tokens)
        for (_, schema), text in zip(calls, texts):
            jsonschema.validate(json.loads(text), schema)
            self.answers.append(text)
        return texts
"""
SCRIPT = PREAMBLE + """
from tiny_models import make_tiny_model

model, root = {model!r}, {root!r}
make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=2, max_model_len=2048, enable_prefix_caching=False),
                embedder=HashEmbedder())
try:
    msgs = [{{"id": "m1", "role": "user", "content": "I moved to Leeds last week."}},
            {{"id": "m2", "role": "assistant", "content": "How exciting!"}},
            {{"id": "m3", "role": "user", "content": "My cat Pixel loves the new flat."}}]
    out = Extractor(llm.memory, Checked(llm), max_facts=1, max_tokens=400).remember("maya", turns_from_messages(msgs))
    again = llm.remember("maya", msgs, max_facts=1, max_tokens=400)  # the Python API; a retry adds nothing new
    facts = llm.memory.list("maya")
    RESULT = {{"answers": len(Checked.answers), "added": out.added, "candidates": out.candidates,
              "sources": sorted({{f.source_turn for f in facts}}), "again": again.to_dict(), "turns": [t.turn_id for t in llm.memory.catalog.turns("maya")]}}
finally:
    llm.close()
"""


SMOL_SCRIPT = PREAMBLE + """
from inferscale.default_model import ensure_default_model

llm = MemoryLLM(MemoryLLMConfig(model=str(ensure_default_model()), memory_root={root!r}, w=2, max_model_len=2048,
                                enable_prefix_caching=False), embedder=HashEmbedder())
try:
    msgs = [{{"id": "s1", "role": "user", "content": "Hi! I'm Maya. I just adopted a cat and named her Luna."}},
            {{"id": "s2", "role": "assistant", "content": "Congratulations on adopting Luna!"}}]
    out = Extractor(llm.memory, Checked(llm), max_facts=3, max_tokens=200).remember("maya", turns_from_messages(msgs))
    RESULT = {{"answers": Checked.answers, "facts": [(f.text, f.source_turn) for f in llm.memory.list("maya")]}}
finally:
    llm.close()
"""


def engine_cases(items, root):
    cases = {"extraction:llama": SCRIPT.format(tests=str(TESTS), model=str(root / "llama"), root=str(root / "mem"))}
    if any(it.name == "test_the_embedded_model_extracts_what_the_messages_say" for it in items):
        cases["extraction:smollm2"] = SMOL_SCRIPT.format(tests=str(TESTS), root=str(root / "mem-smol"))
    return cases


def test_the_served_model_extracts_under_the_schema(engine_runs):
    r = engine_runs["extraction:llama"].result()
    assert r["turns"] == ["m1", "m2", "m3"]
    assert r["answers"] >= 1  # each one valid under its schema (checked in the engine process)
    assert len(r["added"]) <= r["candidates"] <= 1  # max_facts held
    assert set(r["sources"]) <= {"m1", "m2", "m3"}
    assert r["again"]["turns_stored"] == 0 and not r["again"]["added"]  # greedy: the same candidates, found done


def test_the_embedded_model_extracts_what_the_messages_say(engine_runs):
    """A real model under the schemas: every answer valid JSON of its schema (checked in the
    engine process) and laid out as models write JSON (`composer.JSON_LAYOUT`), and the facts name
    the cat the messages name, from the message naming it."""
    r = engine_runs["extraction:smollm2"].result()
    assert r["answers"] and r["facts"], r
    assert any("Luna" in text for text, _ in r["facts"]), r["facts"]
    assert all(a.startswith('{"facts": [') for a in r["answers"]), r["answers"]  # laid out as models write JSON
    assert {turn for _, turn in r["facts"]} <= {"s1", "s2"}
