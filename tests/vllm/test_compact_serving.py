"""Memory kept compact (int8 codes with per-channel scales, or bfloat16) is served by the connector
from the stored layout (codes dequantised and rotated layer by layer, `inferscale/vllm/kernels/compact.py`)
and answers exactly as the JAX reference engine injecting the store's reference dequantisation
(greedy tokens, logprobs <= 1e-4). One engine per dtype, each a case of the session's engine
processes (tests/vllm/conftest.py)."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_scripts import selected_params  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder
from tiny_models import make_tiny_model
from inferscale.evaluation.datasets import load_demo
from inferscale.common.storage.local_store import Store
from inferscale.jax.engine import Engine
from inferscale.jax.engine_config import EngineConfig
from inferscale.common.storage.paths import user_store_dir
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

model, root = {model!r}, {root!r}
make_tiny_model(model, "qwen2", head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=3, max_model_len=2048, kv_dtype={dtype!r},
                                enable_prefix_caching=False), embedder=HashEmbedder())
try:
    conv = load_demo().conversation
    llm.memory.add("u", turns=conv.turns, facts=conv.facts[:8])
    q = "Where does Tom live now?"
    facts = [f.fact_id for f in llm.memory.search("u", q, k=5)]
    out = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)
    ref = Engine.from_pretrained(model, EngineConfig(max_context=2048)).answer(
        q, llm.memory.load_kv("u", facts), mode="inject", max_new_tokens=6)
    RESULT = {{"store": Store.open(user_store_dir(root, "u")).meta.dtype,
                                  "vllm": [out.token_ids, out.logprobs, out.num_injected],
                                  "jax": [ref.token_ids, ref.logprobs, ref.num_injected]}}
finally:
    llm.close()
"""


DTYPES = ("int8", "bfloat16")


def engine_cases(items, root):
    """The selected dtypes' cases (tests/vllm/conftest.py): "compact:DTYPE"."""
    return {f"compact:{d}": SCRIPT.format(tests=str(TESTS), model=str(root / f"m-{d}"), root=str(root / f"mem-{d}"),
                                          dtype=d)
            for d in selected_params(items, "dtype")}


@pytest.mark.parametrize("dtype", DTYPES)
def test_compact_store_served_from_its_layout_equals_the_reference(dtype, engine_runs):
    r = engine_runs[f"compact:{dtype}"].result()
    assert r["store"] == dtype
    (tokens, logprobs, injected), (ref_tokens, ref_logprobs, ref_injected) = r["vllm"], r["jax"]
    assert injected == ref_injected > 0 and tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= 1e-4
