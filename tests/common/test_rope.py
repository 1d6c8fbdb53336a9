"""RoPE tables and the numpy rotation against independent formulations."""

import numpy as np
import pytest

from inferscale.common.model.rope_tables import apply_rope, cos_sin, inv_freq
from inferscale.common.model.spec import RopeSpec

STYLES = [RopeSpec(10000.0, 16, "split"), RopeSpec(10000.0, 16, "interleaved"),
          RopeSpec(1e5, 8, "split"), RopeSpec(1e5, 8, "interleaved")]  # last two: partial (head 16)


def _complex_reference(x, positions, rope):
    """Rotation as complex multiplication (Meta's original formulation)."""
    r = rope.rotary_dim
    ang = positions[:, None] * inv_freq(rope)[None]  # [T, r/2]
    rot = x[..., :r].astype(np.float64)
    if rope.style == "interleaved":
        z = rot[..., 0::2] + 1j * rot[..., 1::2]
    else:
        z = rot[..., : r // 2] + 1j * rot[..., r // 2 :]
    z = z * np.exp(1j * ang)[:, None, :]
    out = np.empty_like(rot)
    if rope.style == "interleaved":
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : r // 2], out[..., r // 2 :] = z.real, z.imag
    return np.concatenate([out, x[..., r:]], axis=-1)


@pytest.mark.parametrize("rope", STYLES, ids=lambda r: f"{r.style}-{r.rotary_dim}")
def test_rotation_matches_complex_reference(rope):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 4000, 7)
    got = apply_rope(x, *cos_sin(rope, pos), rope)
    np.testing.assert_allclose(got, _complex_reference(x, pos.astype(np.float64), rope), atol=2e-5)
    np.testing.assert_array_equal(got[..., rope.rotary_dim:], x[..., rope.rotary_dim:])


@pytest.mark.parametrize("rope", STYLES, ids=lambda r: f"{r.style}-{r.rotary_dim}")
def test_rotations_compose_and_scores_are_relative(rope):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2, 16)).astype(np.float32)
    p, s = rng.integers(0, 500, 5), 123
    twice = apply_rope(apply_rope(x, *cos_sin(rope, p), rope), *cos_sin(rope, np.full(5, s)), rope)
    np.testing.assert_allclose(twice, apply_rope(x, *cos_sin(rope, p + s), rope), atol=1e-4)
    q, k = x[0:1], x[1:2]
    dot = lambda a, b: float((apply_rope(q, *cos_sin(rope, [a]), rope) * apply_rope(k, *cos_sin(rope, [b]), rope)).sum())
    assert dot(10, 3) == pytest.approx(dot(510, 503), abs=1e-4)


def test_llama3_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_scaling=params, rope_theta=500000.0)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_freq(RopeSpec(500000.0, 128, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position=8192))
    np.testing.assert_allclose(ours, ref.double().numpy(), rtol=1e-6)
    assert transformers


def test_bad_rope_input():
    with pytest.raises(ValueError, match="style"):
        RopeSpec(10000.0, 16, "zigzag")
    with pytest.raises(ValueError, match="positions"):
        cos_sin(STYLES[0], [-1])
