"""Run by the client environment's Python (scripts/setup_client_tests.sh), not by pytest: the
open-source mem0ai library's own `Memory.add` / `search` / `get_all`, with `inferscale serve` as its
OpenAI-compatible LLM, a local hashing embedder and a local Qdrant. Prints one JSON line.

    python mem0_client.py BASE_URL MODEL WORKDIR [--short-prompt]
"""

import hashlib
import json
import math
import os
import sys

os.environ["MEM0_TELEMETRY"] = "False"  # before mem0 is imported: nothing leaves the machine

import mem0.memory.main as mem0_main  # noqa: E402
from mem0 import Memory  # noqa: E402

if len(sys.argv) > 4 and sys.argv[4] == "--short-prompt":
    # mem0's extraction prompt is ~34,000 characters (~8,000 tokens of a real tokenizer, ~24,000 of
    # the tests' 400-token one): the tiny test model's 2,048-token context takes a short one that
    # asks for the same JSON. Everything else is mem0's own pipeline.
    mem0_main.ADDITIVE_EXTRACTION_PROMPT = (
        'Extract facts about the user from the new messages. Answer with JSON only: '
        '{"memory": [{"id": "0", "text": "a fact"}]}')

DIMS = 64


class HashEmbedding:
    """A local embedder: hashed words, normalised (deterministic, no model to download)."""

    def embed(self, text, memory_action=None):
        v = [0.0] * DIMS
        for word in str(text).lower().split():
            v[int(hashlib.sha256(word.strip(".,!?").encode()).hexdigest(), 16) % DIMS] += 1.0
        n = math.sqrt(sum(x * x for x in v)) or 1.0
        return [x / n for x in v]

    def embed_batch(self, texts, memory_action="add"):
        return [self.embed(t, memory_action) for t in texts]


url, model, work = sys.argv[1:4]
m = Memory.from_config({
    "llm": {"provider": "openai", "config": {"model": model, "openai_base_url": f"{url}/v1", "api_key": "none",
                                             "temperature": 0.0, "max_tokens": 120}},
    "embedder": {"provider": "openai", "config": {"api_key": "none", "embedding_dims": DIMS}},
    "vector_store": {"provider": "qdrant", "config": {"path": os.path.join(work, "qdrant"), "collection_name": "t",
                                                      "embedding_model_dims": DIMS, "on_disk": True}},
    "history_db_path": os.path.join(work, "history.db"),
})
m.embedding_model = HashEmbedding()  # replaces the OpenAI embedder before anything is embedded
inferred = m.add([{"role": "user", "content": "I moved to Leeds last week and adopted a cat named Pixel."}],
                 user_id="maya")  # extraction by the served model, through InferScale's chat endpoint
raw = m.add([{"role": "user", "content": "Maya plays the cello on Sundays."}], user_id="maya", infer=False)
found = m.search("What instrument does Maya play?", top_k=3, filters={"user_id": "maya"})
every = m.get_all(filters={"user_id": "maya"})
print(json.dumps({"inferred": inferred, "raw": raw, "search": found, "all": every}, default=str))
