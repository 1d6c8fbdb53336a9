"""Two replicas over one PostgreSQL catalog and one Redis KV tier (real servers on loopback).

Replica A is the memory API of one replica (a `MemoryComposer`: catalog, encoder, KV tier; no
engine); replica B is a full `MemoryLLM` (vLLM with the InferScale connector) in a process of its
own, with its own memory root. Every write through A is answered from by B at once; after an
update or a delete on A, B plans and injects only the current KV: the fact ids and kv keys of its
plan, and the bytes its connector injected, are checked against what A wrote."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from doubles import HashEmbedder  # noqa: E402
from engine_scripts import engine_env  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from inferscale.evaluation.datasets import load_demo  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
Q = "Where does Tom live now?"
REPLICA = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder
from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig
from vllm.distributed.kv_transfer import get_kv_transfer_group

llm = MemoryLLM(MemoryLLMConfig(model={model!r}, memory_root={root!r}, w=3, max_model_len=2048, kv_dtype="bfloat16",
                                catalog={catalog!r}, kv_store={kv!r}), embedder=HashEmbedder())
print("READY", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        llm.memory.fact_plan(req["user"], req["facts"])
    except Exception as e:
        print("RESULT " + json.dumps({{"error": type(e).__name__ + ": " + str(e)}}), flush=True)
        continue
    out = llm.generate(req["user"], req["q"], mode="inject", fact_ids=req["facts"], max_tokens=4)
    plan = llm.memory.fact_plan(req["user"], req["facts"])
    host = get_kv_transfer_group().worker.host  # the worker connector's cache: the KV it injected, as loaded
    injected = {{key: hashlib.sha256(host.get((req["user"], key)).k.tobytes()).hexdigest()
                for _, key, _ in plan.facts}}
    print("RESULT " + json.dumps({{"tokens": out.token_ids, "num_injected": out.num_injected,
                                  "keys": [[f, k] for f, k, _ in plan.facts], "injected": injected}}), flush=True)
llm.close()
"""


def _digest(store, key):
    (c,) = store.get_compact([key])
    return hashlib.sha256(c.k.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    make_tiny_model(path, "qwen2", head_dim=32, max_position_embeddings=2048)
    return path


def test_writes_on_one_replica_are_served_by_another_and_never_stale(model_dir, tmp_path, shared_storage):
    from inferscale.serving.memory_llm import MemoryLLMConfig
    from inferscale.serving.composer import MemoryComposer

    catalog, kv = shared_storage
    cfg = MemoryLLMConfig(model=str(model_dir), memory_root=str(tmp_path / "a"), w=3, max_model_len=2048,
                          kv_dtype="bfloat16", catalog=catalog, kv_store=kv)
    a = MemoryComposer(cfg, embedder=HashEmbedder())
    conv = load_demo().conversation
    a.memory.add("t:u", turns=conv.turns, facts=conv.facts[:8])
    facts = [f.fact_id for f in a.memory.search("t:u", Q, k=4)]

    env = engine_env()
    code = REPLICA.format(tests=str(TESTS), model=str(model_dir), root=str(tmp_path / "b"), catalog=catalog, kv=kv)
    b = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)

    def ask(fact_ids):
        b.stdin.write(json.dumps({"user": "t:u", "q": Q, "facts": fact_ids}) + "\n")
        b.stdin.flush()
        for line in b.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(b.stderr.read()[-3000:])

    try:
        for line in b.stdout:
            if line.startswith("READY"):
                break
        else:
            raise AssertionError(b.stderr.read()[-3000:])
        store = a.memory.store("t:u")
        first = ask(facts)  # B answers from what A wrote: same keys, same bytes
        current = {f: a.memory.catalog.fact("t:u", f).kv_key for f in facts}
        assert first["num_injected"] > 0 and dict(first["keys"]) == current
        assert first["injected"] == {k: _digest(store, k) for k in current.values()}

        old_key, old_digest = current[facts[0]], _digest(store, current[facts[0]])
        a.memory.update("t:u", facts[0], "Tom moved to Porto, by the sea, last winter.")
        second = ask(facts)  # the very next request on B sees the update
        new_key = a.memory.catalog.fact("t:u", facts[0]).kv_key
        assert dict(second["keys"])[facts[0]] == new_key != old_key
        assert second["injected"][new_key] == _digest(store, new_key) != old_digest
        assert old_key not in second["injected"] and old_key not in store  # gone from the shared tier

        a.memory.delete("t:u", facts[1])
        assert ask(facts)["error"].startswith("UnknownFactError")  # B no longer has the deleted fact
        rest = [f for f in facts if f != facts[1]]
        third = ask(rest)
        assert [f for f, _ in third["keys"]] == rest and current[facts[1]] not in third["injected"]
    finally:
        b.stdin.close()
        try:
            b.wait(120)
        except subprocess.TimeoutExpired:
            b.kill()
        a.memory.close()
