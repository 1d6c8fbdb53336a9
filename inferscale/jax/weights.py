"""Load Hugging Face safetensors weights into the Flax model's params; orbax for fast reloads.

Handles sharded checkpoints (`model.safetensors.index.json`), tied embeddings (no `lm_head`),
fp32/bf16/fp16 storage (cast to the requested dtype) and the `model.` prefix. Every tensor the
model needs must be present with the right shape; extra tensors (rotary caches) are ignored.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from inferscale.common.spec import ModelSpec, weight_files

log = logging.getLogger(__name__)


def _expected(spec: ModelSpec) -> dict[str, tuple[tuple[str, ...], tuple[int, ...], bool]]:
    """HF name -> (param path, HF shape, transpose?)."""
    D, H, KVH, hd, F = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    out = {"model.embed_tokens.weight": (("embed_tokens", "embedding"), (spec.vocab_size, D), False),
           "model.norm.weight": (("norm", "weight"), (D,), False)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head", "kernel"), (spec.vocab_size, D), True)
    for i in range(spec.num_layers):
        p, L = f"model.layers.{i}.", f"layers_{i}"
        proj = {"q_proj": H * hd, "k_proj": KVH * hd, "v_proj": KVH * hd}
        for name, n in proj.items():
            out[p + f"self_attn.{name}.weight"] = ((L, "self_attn", name, "kernel"), (n, D), True)
            if spec.qkv_bias:
                out[p + f"self_attn.{name}.bias"] = ((L, "self_attn", name, "bias"), (n,), False)
        out[p + "self_attn.o_proj.weight"] = ((L, "self_attn", "o_proj", "kernel"), (D, H * hd), True)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = ((L, "self_attn", "q_norm", "weight"), (hd,), False)
            out[p + "self_attn.k_norm.weight"] = ((L, "self_attn", "k_norm", "weight"), (hd,), False)
        out[p + "mlp.gate_proj.weight"] = ((L, "mlp", "gate_proj", "kernel"), (F, D), True)
        out[p + "mlp.up_proj.weight"] = ((L, "mlp", "up_proj", "kernel"), (F, D), True)
        out[p + "mlp.down_proj.weight"] = ((L, "mlp", "down_proj", "kernel"), (D, F), True)
        out[p + "input_layernorm.weight"] = ((L, "input_layernorm", "weight"), (D,), False)
        out[p + "post_attention_layernorm.weight"] = ((L, "post_attention_layernorm", "weight"), (D,), False)
    return out


def load_hf_params(model_dir: str | Path, spec: ModelSpec, dtype=jnp.float32) -> dict:
    """Read every weight of a HF folder into a Flax params dict (norm weights stay float32)."""
    expected = _expected(spec)
    params: dict = {}
    found = set()
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="flax") as st:
            for name in st.keys():
                key = name if name in expected else f"model.{name}"
                if key not in expected:
                    continue
                path, shape, transpose = expected[key]
                t = st.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"weight {name} in {f.name} has shape {tuple(t.shape)}, expected {shape}")
                norm = path[-1] == "weight"
                t = t.astype(jnp.float32 if norm else dtype)
                node = params
                for p in path[:-1]:
                    node = node.setdefault(p, {})
                node[path[-1]] = t.T if transpose else t
                found.add(key)
    missing = sorted(set(expected) - found)
    if missing:
        raise ValueError(f"model folder {model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
    return params


def load_params(model_dir: str | Path, spec: ModelSpec, fingerprint: str, dtype=jnp.float32,
                checkpoint_dir: str | Path | None = None) -> dict:
    """Params from an orbax checkpoint of converted weights if one exists, else from safetensors.

    The checkpoint lives under `checkpoint_dir/<fingerprint>-<dtype>`, so a changed model never reuses
    a stale conversion.
    """
    if checkpoint_dir is None:
        return load_hf_params(model_dir, spec, dtype)
    import orbax.checkpoint as ocp

    ckpt = (Path(checkpoint_dir) / f"{fingerprint[:32]}-{jnp.dtype(dtype).name}").resolve()
    checkpointer = ocp.StandardCheckpointer()
    if ckpt.exists():
        try:
            return checkpointer.restore(ckpt)
        except Exception as e:  # a broken cache is rebuilt, never trusted
            log.warning("orbax checkpoint %s unreadable (%s); converting again", ckpt, e)
    params = load_hf_params(model_dir, spec, dtype)
    try:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        checkpointer.save(ckpt, params, force=True)
        checkpointer.wait_until_finished()
    except OSError as e:
        log.warning("could not write orbax checkpoint %s: %s", ckpt, e)
    return params


def params_to_numpy(params: dict) -> dict:
    """A host copy of params (for tests and conversions)."""
    return {k: params_to_numpy(v) if isinstance(v, dict) else np.asarray(v) for k, v in params.items()}
