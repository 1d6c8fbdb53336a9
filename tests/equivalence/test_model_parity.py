"""Model parity: the Flax model's logits equal transformers' for the same weights (fp32)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

from inferscale.common.model.spec import ModelSpec  # noqa: E402
from inferscale.jax.model import Transformer  # noqa: E402
from inferscale.jax.rope import rope_tables  # noqa: E402
from inferscale.jax.weights import load_hf_params  # noqa: E402


def _hf_logits(model_dir, tokens, offset=0):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pos = torch.arange(offset, offset + tokens.shape[1])[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        out = m(torch.tensor(tokens), position_ids=pos, use_cache=True)
    return out.logits.numpy(), out.past_key_values


def _jax_forward(model_dir, tokens, offset=0):
    spec = ModelSpec.from_pretrained(model_dir)
    params = load_hf_params(model_dir, spec)
    table = rope_tables(spec, 1024)  # [R, 2, P, r // 2]: one per distinct RoPE setting
    pos = np.arange(offset, offset + tokens.shape[1])[None].repeat(tokens.shape[0], 0)
    logits, _, kvs = Transformer(spec).apply({"params": params}, jnp.asarray(tokens), table[:, 0][:, pos],
                                             table[:, 1][:, pos])
    return spec, np.asarray(logits), kvs


def test_logits_match_transformers(tiny_model_dir):
    """40 tokens: longer than the tiny Gemma 3's sliding window (24), so the window is exercised."""
    tokens = np.random.default_rng(0).integers(0, 300, (2, 40))
    ref, _ = _hf_logits(tiny_model_dir, tokens, offset=7)
    _, got, _ = _jax_forward(tiny_model_dir, tokens, offset=7)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 1e-4, rel
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_pre_rope_keys_rotated_to_p_plus_s_equal_keys_encoded_at_offset_s(tiny_model_dir):
    """Keys stored pre-RoPE at offset 0, rotated to p + s, equal transformers' cached keys at offset s."""
    from inferscale.common.model.rope_tables import apply_rope, cos_sin

    s, n = 300, 20  # n within every sliding window: transformers' cache keeps all n keys of each layer
    tokens = np.random.default_rng(1).integers(0, 300, (1, n))
    _, hf_cache = _hf_logits(tiny_model_dir, tokens, offset=s)
    spec, _, kvs = _jax_forward(tiny_model_dir, tokens, offset=0)
    for layer, (k_pre, v) in enumerate(kvs):
        rope = spec.layer_rope(layer)  # sliding layers rotate with their own base
        cos, sin = cos_sin(rope, np.arange(s, s + n))
        rotated = apply_rope(np.asarray(k_pre[0]), cos, sin, rope)  # [T, KVH, D]
        hf_k = hf_cache.layers[layer].keys[0].transpose(0, 1).numpy()  # [T, KVH, D], post-RoPE
        hf_v = hf_cache.layers[layer].values[0].transpose(0, 1).numpy()
        np.testing.assert_allclose(rotated, hf_k, rtol=1e-4, atol=1e-4 * np.abs(hf_k).max())
        np.testing.assert_allclose(np.asarray(v[0]), hf_v, rtol=1e-4, atol=1e-4 * np.abs(hf_v).max())


def test_bf16_weights_load_and_stay_close(tmp_path):
    from tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM

    make_tiny_model(tmp_path, "qwen3")
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    spec = ModelSpec.from_pretrained(tmp_path / "bf16")
    p32 = load_hf_params(tmp_path / "bf16", spec, jnp.float32)
    assert p32["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.float32
    pbf = load_hf_params(tmp_path / "bf16", spec, jnp.bfloat16)
    assert pbf["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pbf["embed_tokens"]["embedding"], np.float32),
                                  np.asarray(p32["embed_tokens"]["embedding"]))


def test_sharded_checkpoint_and_untied_head(tmp_path):
    from tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "mistral", tie=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path).save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    tokens = np.random.default_rng(2).integers(0, 300, (1, 16))
    ref, _ = _hf_logits(tmp_path, tokens)
    _, got, _ = _jax_forward(tmp_path / "sharded", tokens)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


def test_missing_weight_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    from tiny_models import make_tiny_model

    make_tiny_model(tmp_path, "llama")
    w = load_file(tmp_path / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_hf_params(tmp_path, ModelSpec.from_pretrained(tmp_path))


def test_multimodal_gemma3_checkpoint_loads_its_text_decoder(tmp_path):
    """A `gemma3` checkpoint (text settings under text_config, decoder weights under
    model.language_model., a vision tower beside them) gives the text model's logits."""
    import json

    from safetensors.numpy import load_file, save_file

    from tiny_models import make_tiny_model

    make_tiny_model(tmp_path / "text", "gemma3_text")
    tokens = np.random.default_rng(3).integers(0, 300, (1, 40))
    _, want, _ = _jax_forward(tmp_path / "text", tokens)
    mm = tmp_path / "mm"
    mm.mkdir()
    w = {n.replace("model.", "model.language_model.", 1): t for n, t in load_file(tmp_path / "text" / "model.safetensors").items()}
    w["model.vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)  # ignored
    save_file(w, mm / "model.safetensors")
    text_cfg = json.loads((tmp_path / "text" / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text_cfg,
                                                "vision_config": {"model_type": "siglip_vision_model"}}))
    _, got, _ = _jax_forward(mm, tokens)
    np.testing.assert_array_equal(got, want)
