"""Load Hugging Face safetensors weights into the Flax model's params; orbax for fast reloads.

Which tensor fills which parameter is the family's (`Family.hf_weights`, incl. rows of fused
projections). Handles sharded checkpoints (`model.safetensors.index.json`), tied embeddings (no
`lm_head`), fp32/bf16/fp16 storage (cast to the requested dtype) and the `model.` prefix. Every tensor the
model needs must be present with the right shape; extra tensors (rotary caches) are ignored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from inferscale.common.model.families import family
from inferscale.common.model.spec import ModelSpec, weight_files

log = logging.getLogger(__name__)


def load_hf_params(model_dir: str | Path, spec: ModelSpec, dtype=jnp.float32) -> dict:
    """Read every weight of a HF folder into a Flax params dict (norm weights stay float32)."""
    fam = family(spec.family)
    expected = fam.hf_weights(spec)
    params: dict = {}
    found = set()
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="flax") as st:
            for name in st.keys():
                key = fam.canonical_weight_name(name)
                if key not in expected:
                    continue
                want = expected[key]
                t = st.get_tensor(name)
                if tuple(t.shape) != want.shape:
                    raise ValueError(f"weight {name} in {f.name} has shape {tuple(t.shape)}, expected {want.shape}")
                for target in want.targets:  # a fused tensor (qkv_proj, gate_up_proj) fills several
                    part = t if target.rows is None else t[target.rows]
                    norm = target.path[-1] == "weight"
                    part = part.astype(jnp.float32 if norm else dtype)
                    node = params
                    for p in target.path[:-1]:
                        node = node.setdefault(p, {})
                    node[target.path[-1]] = part.T if target.transpose else part
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


def eos_token_ids(tokenizer, model_dir: str | Path) -> set[int]:
    """The ids that end an answer: the tokenizer's end of sequence and the model's
    `generation_config.json` ones."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(int(x) for x in (e if isinstance(e, list) else [e]) if x is not None)
    return ids
