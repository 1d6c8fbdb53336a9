"""Extraction through the served model's own engine (`EngineJsonLLM`): vLLM's structured outputs
hold even a tiny random model's answers to the extraction and decision schemas, and what it
extracts lands in memory as facts with their source turns. A case of the session's engine
processes (tests/vllm/conftest.py)."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import jsonschema
from doubles import HashEmbedder
from tiny_models import make_tiny_model
from inferscale.memory.extraction import Extractor, turns_from_messages
from inferscale.memory.extraction_llms import EngineJsonLLM
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

model, root = {model!r}, {root!r}
make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=2, max_model_len=2048, enable_prefix_caching=False),
                embedder=HashEmbedder())
try:
    class Checked(EngineJsonLLM):  # every answer, checked against the schema it was decoded under
        answers = []
        def complete_json(self, messages, schema, max_tokens):
            text = super().complete_json(messages, schema, max_tokens)
            jsonschema.validate(json.loads(text), schema)
            self.answers.append(text)
            return text
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


def engine_cases(items, root):
    return {"extraction:llama": SCRIPT.format(tests=str(TESTS), model=str(root / "llama"), root=str(root / "mem"))}


def test_the_served_model_extracts_under_the_schema(engine_runs):
    r = engine_runs["extraction:llama"].result()
    assert r["turns"] == ["m1", "m2", "m3"]
    assert r["answers"] >= 1  # each one valid under its schema (checked in the engine process)
    assert len(r["added"]) <= r["candidates"] <= 1  # max_facts held
    assert set(r["sources"]) <= {"m1", "m2", "m3"}
    assert r["again"]["turns_stored"] == 0 and not r["again"]["added"]  # greedy: the same candidates, found done
