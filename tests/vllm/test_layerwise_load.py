"""Layer-by-layer loading (`wait_for_layer_load` writes each layer right before its attention),
also from the device tier, and background loading (every layer written by the connector's writer
thread while the forward pass runs, `wait_for_layer_load` waiting for each), written straight into
the paged cache (`compact.prepare_paged`, the CPU default), answer exactly as the synchronous
reference (every layer written in `start_load_kv` through the attention backend's own cache
write): same greedy tokens and logprobs, every planned token injected, no failed load. A write that
fails on the writer thread fails its load (vLLM recomputes it) and the next request is served as
before. One engine per mode, each a case of the session's engine processes
(tests/vllm/conftest.py); int8 memory, so every path dequantises as it writes."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")


TESTS = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder
from tiny_models import make_tiny_model
from inferscale.evaluation.datasets import load_demo
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig
from vllm.distributed.kv_transfer import get_kv_transfer_group

model, root = {model!r}, {root!r}
make_tiny_model(model, "qwen2", head_dim=32, max_position_embeddings=2048)
llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=3, max_model_len=2048, kv_dtype="int8",
                                enable_prefix_caching=False, kv_load={mode!r}.split("+")[0],
                                kv_write="backend" if {mode!r}.endswith("+backend") else "auto",
                                device_cache_bytes=(64 << 20) if {mode!r}.endswith("+device") else None),
                embedder=HashEmbedder())
try:
    conv = load_demo().conversation
    llm.memory.add("u", turns=conv.turns, facts=conv.facts[:8])
    outs = []
    for q in ("Where does Tom live now?", "What did Maya adopt?", "Where does Tom live now?"):
        facts = [f.fact_id for f in llm.memory.search("u", q, k=5)]
        out = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)
        outs.append([out.token_ids, out.logprobs, out.num_injected])
    conn = get_kv_transfer_group()
    w = conn.worker  # the connector's worker half: its tiers and writes
    d = w.device_tier
    stats = dict(w.stats)
    after = None
    if w.load_mode == "background":  # a write that fails on the writer thread, then one that does not
        write = w._write
        def broken(staged, ids):
            if 1 in ids:
                raise OSError("the store went away")
            return write(staged, ids)
        w._write = broken
        q = "Where does Tom live now?"
        facts = [f.fact_id for f in llm.memory.search("u", q, k=5)]
        failed = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)
        del w._write
        again = llm.generate("u", q, mode="inject", fact_ids=facts, max_tokens=6)
        after = {{"failed": failed.token_ids, "again": [again.token_ids, again.logprobs], "stats": dict(w.stats),
                 "writer": w._writer is not None}}
    RESULT = {{"mode": w.load_mode, "outs": outs, "stats": stats, "after": after,
                                  "device": None if d is None else [d.stats.hits, d.stats.misses, d.used]}}
finally:
    llm.close()
"""


MODES = ("sync+backend", "layerwise+device", "background")


def engine_cases(items, root):
    """The modes' cases (tests/vllm/conftest.py): "layerwise:MODE"."""
    return {f"layerwise:{m}": SCRIPT.format(tests=str(TESTS), model=str(root / f"m-{m}"),
                                            root=str(root / m.replace("+", "-")), mode=m) for m in MODES}


def test_layerwise_loading_and_the_device_tier_equal_the_synchronous_reference(engine_runs):
    """Also the device tier (forced on here: on CPU it is off by default, the host tier being that
    memory): the repeated question is served from it (hits), with the same answer."""
    runs = {m: engine_runs[f"layerwise:{m}"] for m in MODES}
    sync = runs["sync+backend"].result()
    assert sync["mode"] == "sync" and sync["device"] is None and sync["stats"]["failed_loads"] == 0
    assert sync["stats"]["paged_write_tokens"] == 0
    for mode in ("background", "layerwise+device"):
        run = runs[mode].result()
        assert run["mode"] == mode.split("+")[0] and run["stats"]["failed_loads"] == 0
        assert run["stats"]["injected_tokens"] == sync["stats"]["injected_tokens"] > 0
        assert run["stats"]["paged_write_tokens"] == run["stats"]["injected_tokens"]  # all written directly
        for (tok, lp, inj), (rtok, rlp, rinj) in zip(run["outs"], sync["outs"]):
            assert inj == rinj > 0 and tok == rtok
            assert max(abs(a - b) for a, b in zip(lp, rlp)) <= 1e-5
    background = runs["background"].result()
    after = background["after"]
    assert after["writer"] and len(after["failed"]) == 6  # answered (its memory recomputed by vLLM)
    assert after["stats"]["failed_loads"] == 1
    # the failed load is not counted as injected; the next request injected all its planned tokens
    planned = background["outs"][0][2]
    assert after["stats"]["injected_tokens"] == background["stats"]["injected_tokens"] + planned
    tok, lp = after["again"]
    assert tok == sync["outs"][0][0] and max(abs(a - b) for a, b in zip(lp, sync["outs"][0][1])) <= 1e-5
    hits, misses, used = run["device"]
    assert hits > 0 and misses > 0 and used > 0  # the third question's facts came from the device tier
