"""The Triton RoPE kernel (Triton's interpreter on CPU) and the CPU fast path against the torch
reference, and the torch reference against the numpy reference in common, under dtype-based
tolerances."""

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from inferscale.common.model.rope_tables import apply_rope, cos_sin  # noqa: E402
from inferscale.common.model.spec import RopeSpec  # noqa: E402
from inferscale.vllm.kernels.chunked_rope import RopeTable, rotate_reference, rotate_torch  # noqa: E402

ROPES = [RopeSpec(1e4, 64, "split"), RopeSpec(1e4, 64, "interleaved"), RopeSpec(1e5, 32, "split"),
         RopeSpec(5e5, 48, "interleaved", scaling="llama3", factor=8.0, original_max_position=512)]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.style}-{r.rotary_dim}-{r.scaling}")
def test_torch_reference_matches_numpy(rope):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((9, 3, 64)).astype(np.float32)
    pos = rng.integers(0, 4000, 9)
    cos, sin = RopeTable(rope, 4096)(torch.from_numpy(pos))
    got = rotate_reference(torch.from_numpy(k), cos, sin, rope).numpy()
    np.testing.assert_allclose(got, apply_rope(k, *cos_sin(rope, pos), rope), atol=1e-5)
    with pytest.raises(ValueError, match="beyond"):
        RopeTable(rope, 128)(torch.tensor([128]))


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.style}-{r.rotary_dim}-{r.scaling}")
@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16])
def test_fast_path_matches_reference(rope, stored, out):
    """`rotate_torch` (stored keys widened on the way, rounded once to the cache's dtype) equals the
    reference run on the same keys in float32, rounded the same way."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(41, 3, 64, generator=g).to(stored)
    pos = torch.randint(0, 4000, (41,), generator=g)
    cos, sin = RopeTable(rope, 4096)(pos)
    ref = rotate_reference(k.float(), cos, sin, rope)
    got = rotate_torch(k, cos, sin, rope, out)
    assert got.dtype == out and got.shape == k.shape
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[out]
    torch.testing.assert_close(got.float(), ref.to(out).float(), atol=tol * 4, rtol=tol)
    assert torch.equal(got[..., rope.rotary_dim:].float(), k[..., rope.rotary_dim:].float().to(out).float())


KERNEL_CHECK = """
import torch
from inferscale.common.model.spec import RopeSpec
from inferscale.vllm.kernels.chunked_rope import RopeTable, rotate_reference, rotate_triton
torch.manual_seed(0)
ropes = [RopeSpec(1e4, 64, "split"), RopeSpec(1e4, 64, "interleaved"), RopeSpec(1e5, 32, "split"),
         RopeSpec(5e5, 48, "interleaved")]
for rope in ropes:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k = torch.randn(37, 3, 64).to(dtype)
        pos = torch.randint(0, 4000, (37,))
        cos, sin = RopeTable(rope, 4096)(pos)
        ref, got = rotate_reference(k, cos, sin, rope), rotate_triton(k, cos, sin, rope)
        assert got.dtype == dtype
        err = (ref.float() - got.float()).abs().max().item()
        assert err <= tol * max(1.0, ref.float().abs().max().item()), (rope, dtype, err)
# compact keys: int8 / e4m3 codes of three facts with their own scales, dequantised and rotated in one pass
import numpy as np
from inferscale.common.storage.kvquant import pair_partner, quantize
from inferscale.vllm.kernels.chunked_rope import dequantize_rotate_reference, dequantize_rotate_triton
rng = np.random.default_rng(0)
lengths = [5, 9, 3]
for rope in ropes:
    for kv_dtype in ("int8", "float8_e4m3"):
        parts = [quantize(rng.standard_normal((1, m, 3, 64)).astype(np.float32) * rng.uniform(0.1, 5), kv_dtype,
                          pair_partner(64, rope.rotary_dim, rope.style)) for m in lengths]
        codes = torch.from_numpy(np.concatenate([c[0] for c, _ in parts]))
        scale = torch.from_numpy(np.stack([sc[0] for _, sc in parts]))
        token_fact = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
        cos, sin = RopeTable(rope, 4096)(torch.randint(0, 4000, (17,)))
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
            ref = dequantize_rotate_reference(codes, scale, token_fact, cos, sin, rope, kv_dtype, dtype)
            got = dequantize_rotate_triton(codes, scale, token_fact, cos, sin, rope, kv_dtype, dtype)
            assert got.dtype == dtype
            err = (ref.float() - got.float()).abs().max().item()
            assert err <= tol * max(1.0, ref.float().abs().max().item()), (rope, kv_dtype, dtype, err)
print("ok")
"""


def test_triton_kernels_match_torch_references():
    """rotate_triton, and dequantize_rotate_triton on int8 and e4m3 codes."""
    pytest.importorskip("triton")  # only the kernels need it; the torch paths above run without
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
