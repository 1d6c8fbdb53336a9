import json
import math
import os

import pytest

from inferscale.common.model.families import family
from inferscale.common.model.spec import ModelSpec, UnsupportedModelError, model_fingerprint

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_families_and_their_features():
    llama = ModelSpec.from_hf_config({**BASE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert llama.rope.scaling == "llama3" and llama.rope.theta == 5e5 and llama.head_dim == 16
    assert llama.group_size == 2 and not llama.qkv_bias and not llama.qk_norm
    assert ModelSpec.from_hf_config({**BASE, "model_type": "qwen2"}).qkv_bias
    q3 = ModelSpec.from_hf_config({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32 and q3.rope.rotary_dim == 32
    assert ModelSpec.from_hf_config({**BASE, "model_type": "mistral"}).family == "mistral"
    # a sliding window bounds what is served exactly (Mistral v0.1, Phi-3 4k: 2047); Qwen2's is unused
    assert ModelSpec.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 256}).max_position == 256
    assert ModelSpec.from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 256}).max_position == 512


def test_phi3_fused_weights_partial_rotary_and_longrope_within_its_original_context():
    phi = ModelSpec.from_hf_config({**BASE, "model_type": "phi3", "sliding_window": 2047, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}})
    assert phi.rope.rotary_dim == 12 and phi.max_position == 512 and not phi.qkv_bias
    weights = family("phi3").hf_weights(phi)
    qkv = weights["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (64 + 2 * 32, 64)
    assert [(t.path[-2], t.rows) for t in qkv.targets] == [("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)),
                                                           ("v_proj", slice(96, 128))]
    gate_up = weights["model.layers.0.mlp.gate_up_proj.weight"]
    assert [(t.path[-2], t.rows) for t in gate_up.targets] == [("gate_proj", slice(0, 128)),
                                                               ("up_proj", slice(128, 256))]
    assert "model.layers.0.self_attn.k_proj.weight" not in weights
    # Phi-4-mini: longrope ("su" in the first 128k configs) served within its original context
    for kind in ("longrope", "su"):
        phi4 = ModelSpec.from_hf_config({**BASE, "model_type": "phi3", "max_position_embeddings": 131072,
                                         "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
                                         "rope_scaling": {"type": kind, "short_factor": [1.5] * 6,
                                                          "long_factor": [9.0] * 6}})
        assert (phi4.rope.scaling, phi4.rope.short_factor, phi4.max_position) == ("longrope", (1.5,) * 6, 4096)
        assert abs(phi4.rope.attention_factor - (1 + math.log(32) / math.log(4096)) ** 0.5) < 1e-12
        assert ModelSpec.from_dict(json.loads(json.dumps(phi4.to_dict()))) == phi4
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelSpec.from_hf_config({**BASE, "model_type": "phi3", "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    with pytest.raises(ValueError, match="short_factor has 5 entries"):
        ModelSpec.from_hf_config({**BASE, "model_type": "phi3", "original_max_position_embeddings": 256,
                                  "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 5}})


GEMMA = {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 6, "head_dim": 32, "sliding_window": 512,
         "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}


def test_gemma3_layers_ropes_and_block_settings():
    # a Hub config of transformers 4: every 6th layer global, the local base apart, linear scaling
    g = ModelSpec.from_hf_config({**GEMMA, "sliding_window_pattern": 6, "rope_theta": 1e6,
                                  "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert g.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [g.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (g.rope.theta, g.rope.scaling, g.rope.factor) == (1e6, "linear", 8.0)
    assert (g.local_rope.theta, g.local_rope.scaling) == (1e4, None)
    assert [g.layer_rope(i) for i in (0, 5)] == [g.local_rope, g.rope] and g.ropes == (g.rope, g.local_rope)
    assert (g.norm_offset, g.sandwich_norm, g.hidden_act, g.embed_scale, g.qk_norm) == (1.0, True, "gelu_tanh",
                                                                                       True, True)
    assert g.query_scale == 256 ** -0.5 and g.tie_word_embeddings
    assert ModelSpec.from_dict(json.loads(json.dumps(g.to_dict()))) == g
    # transformers 5 writes layer_types and per-layer-type rope_parameters; the same spec
    g5 = ModelSpec.from_hf_config({**GEMMA, "layer_types": list(g.layer_types), "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert g5 == g
    # a multimodal `gemma3` checkpoint: the decoder's settings under text_config
    mm = ModelSpec.from_hf_config({"model_type": "gemma3", "text_config": {
        **GEMMA, "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "vision_config": {"model_type": "siglip_vision_model"}})
    assert mm == g
    settings = g.layer_settings()
    assert settings[0] == {"rope": g.local_rope.to_dict(), "window": 512} and settings[5]["window"] is None
    for bad, match in (({"attn_logit_softcapping": 50.0}, "soft-capping"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"hidden_activation": "relu"}, "hidden_activation")):
        with pytest.raises(UnsupportedModelError, match=match):
            ModelSpec.from_hf_config({**GEMMA, **bad})


def test_layer_settings_leave_other_families_specs_as_they_were():
    """Specs without per-layer attention or Gemma's block serialise without the new fields, so the
    fingerprints (and stores) of the families supported before them stay valid."""
    llama = ModelSpec.from_hf_config({**BASE, "model_type": "llama"})
    assert set(llama.to_dict()) == {"family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                    "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope",
                                    "max_position", "tie_word_embeddings", "qkv_bias", "qk_norm"}
    assert llama.layer_settings() is None and llama.ropes == (llama.rope,) and llama.layer_window(1) is None
    assert llama.query_scale == 16 ** -0.5


def test_rope_parameters_of_transformers_5_and_partial_rotary():
    spec = ModelSpec.from_hf_config({**BASE, "model_type": "llama", "partial_rotary_factor": 0.5,
                                     "rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}})
    assert spec.rope.theta == 1e5 and spec.rope.rotary_dim == 8 and spec.rope.scaling is None


def test_unsupported_family_lists_supported_ones():
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3, phi3"):
        ModelSpec.from_hf_config({**BASE, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelSpec.from_hf_config({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn"}})


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelSpec.from_hf_config({**BASE, "model_type": "llama", "num_key_value_heads": 3})
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelSpec.from_pretrained("/nonexistent-model-folder")


def test_spec_round_trips_through_dict():
    spec = ModelSpec.from_hf_config({**BASE, "model_type": "qwen3"})
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_fingerprint_tracks_weights_and_config(tmp_path):
    from safetensors.numpy import save_file
    import numpy as np

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
        save_file({"w": np.ones(4, np.float32)}, tmp_path / name / "model.safetensors")
    assert model_fingerprint(tmp_path / "a") == model_fingerprint(tmp_path / "b")
    save_file({"w": np.full(4, 2, np.float32)}, tmp_path / "b" / "model.safetensors")
    assert model_fingerprint(tmp_path / "a") != model_fingerprint(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        (tmp_path / "a" / "model.safetensors").unlink()
        model_fingerprint(tmp_path / "a")


def test_fingerprint_reads_the_weights_once_until_they_change(tmp_path, monkeypatch):
    from safetensors.numpy import save_file
    import builtins
    import numpy as np

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    weights = tmp_path / "model.safetensors"
    reads: list[str] = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **kw: (reads.append(str(f)), real_open(f, *a, **kw))[1])
    for value in (1, 2, 3):  # written just now: read every time (a rewrite within one clock tick keeps the time)
        save_file({"w": np.full(4, value, np.float32)}, weights)
        assert model_fingerprint(tmp_path) == model_fingerprint(tmp_path)
    assert reads.count(str(weights)) == 6
    st = weights.stat()  # an installed model: written a while ago
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns - 60_000_000_000))
    first = model_fingerprint(tmp_path)
    assert model_fingerprint(tmp_path) == first and reads.count(str(weights)) == 7  # asked again: not read again
    save_file({"w": np.full(4, 4, np.float32)}, weights)  # written again: read again, a new fingerprint
    assert model_fingerprint(tmp_path) != first and reads.count(str(weights)) == 8
