"""The connector's per-layer K/V (`inferscale.vllm.kernels.compact.layer_kv`) on CPU: both fast paths (the
Numba kernels of `cpu_kernels`, and `rotate_torch` with scales before rotation for int8 / fp8)
equal the torch references on the same stored layout, per stored dtype, RoPE style and cache
dtype, for a load that spans several facts (each with its own scales) and starts mid-fact."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from inferscale.common.model.spec import RopeSpec  # noqa: E402
from inferscale.common.storage.format import FactKV, StoreMeta  # noqa: E402
from inferscale.common.storage.local_store import Store
from inferscale.vllm.kernels import cpu_kernels  # noqa: E402
from inferscale.vllm.kernels.compact import gather, layer_kv  # noqa: E402
from inferscale.vllm.kernels.chunked_rope import RopeTable  # noqa: E402

L, H, D = 2, 3, 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3"])
@pytest.mark.parametrize("rope", [RopeSpec(1e4, 16, "split"), RopeSpec(1e4, 12, "interleaved")],
                         ids=lambda r: f"{r.style}-{r.rotary_dim}")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["numba", "torch"])
def test_fast_layer_kv_equals_the_references(tmp_path, dtype, rope, cache_dtype, path):
    if path == "numba" and not cpu_kernels.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(0)
    meta = StoreMeta("a" * 64, L, H, D, {"theta": rope.theta, "rotary_dim": rope.rotary_dim, "style": rope.style},
                     w=2).with_dtype(dtype)
    st = Store.create(tmp_path / "s", meta)
    facts = []
    for i, n in enumerate((7, 4, 9)):
        k = rng.standard_normal((L, n, H, D)).astype(np.float32) * rng.uniform(0.1, 20, (1, 1, H, D))
        facts.append(FactKV(f"f{i}", np.arange(n), k, (0.5 * k).astype(np.float32)))
    st.put(facts)
    compact = st.get_compact(["f0", "f1", "f2"])
    (part,) = gather([(compact[0], 3, 7, 40), (compact[1], 0, 4, 44), (compact[2], 0, 9, 48)])  # [3, 20) mid-fact
    cos, sin = RopeTable(rope, 256)(torch.from_numpy(part.positions))
    cpu = torch.device("cpu")
    for layer in range(L):
        k_fast, v_fast = layer_kv(part, layer, cos, sin, rope, cache_dtype, cpu, path)
        k_ref, v_ref = layer_kv(part, layer, cos, sin, rope, cache_dtype, cpu, "reference")
        assert k_fast.dtype == v_fast.dtype == cache_dtype and k_fast.shape == (17, H, D)
        tol = 1e-6 if cache_dtype == torch.float32 else 8e-3  # bf16: one rounding apart at most
        scale = float(k_ref.float().abs().max())
        torch.testing.assert_close(k_fast.float(), k_ref.float(), atol=tol * scale, rtol=tol)
        assert torch.equal(v_fast, v_ref)  # values: the same float32 products, rounded once
        if path == "numba":  # the same float32 operations in the same order as the reference
            assert torch.equal(k_fast, k_ref)


def test_auto_path_on_cpu_is_numba_where_installed(tmp_path):
    """The connector's default on CPU is the Numba kernel (bit-equal to the reference above)."""
    if not cpu_kernels.available():
        pytest.skip("numba is not installed")
    rope = RopeSpec(1e4, 16, "split")
    part = gather([(_one_fact(tmp_path, "bfloat16", rope), 0, 5, 7)])[0]
    cos, sin = RopeTable(rope, 64)(torch.from_numpy(part.positions))
    cpu = torch.device("cpu")
    auto = layer_kv(part, 0, cos, sin, rope, torch.float32, cpu)
    numba = layer_kv(part, 0, cos, sin, rope, torch.float32, cpu, "numba")
    assert all(torch.equal(a, b) for a, b in zip(auto, numba))


def _one_fact(tmp_path, dtype, rope):
    meta = StoreMeta("b" * 64, L, H, D, {"theta": rope.theta, "rotary_dim": rope.rotary_dim, "style": rope.style},
                     w=2).with_dtype(dtype)
    st = Store.create(tmp_path / "one", meta)
    k = np.random.default_rng(1).standard_normal((L, 5, H, D)).astype(np.float32)
    st.put([FactKV("f", np.arange(5), k, k)])
    return st.get_compact(["f"])[0]


def test_unknown_path_is_refused(tmp_path):
    rope = RopeSpec(1e4, 16, "split")
    part = gather([(_one_fact(tmp_path, "float32", rope), 0, 5, 0)])[0]
    cos, sin = RopeTable(rope, 64)(torch.from_numpy(part.positions))
    with pytest.raises(ValueError, match="path must be one of"):
        layer_kv(part, 0, cos, sin, rope, torch.float32, torch.device("cpu"), "fast")


def test_numba_leaves_vllms_worker_start_scan_working():
    """vLLM's CPU worker start calls `vars(x).get(...)` on module attributes with a `__dict__`;
    after the kernels' Numba import, llvmlite's library wrapper must still answer it (else every
    later engine in this process fails to start)."""
    if not cpu_kernels.available():
        pytest.skip("numba is not installed")
    from llvmlite.binding import ffi

    assert vars(ffi.lib).get("kernel") is None


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_every_code_decodes_to_torchs_value(kv_dtype):
    """All 256 byte codes (int8 converted, e4m3 looked up) equal torch's own conversion bit for bit;
    e4m3's NaN codes stay NaN. int8 keys also through the rotating kernel, by an angle of 0 (e4m3's
    NaN and -0 codes would mix into their RoPE pairs there)."""
    if not cpu_kernels.available():
        pytest.skip("numba is not installed")
    codes = torch.arange(256, dtype=torch.uint8).view(4, 1, 64)  # [n, KVH, D]
    x = codes.view(torch.int8) if kv_dtype == "int8" else codes
    want = x.float() if kv_dtype == "int8" else codes.view(torch.float8_e4m3fn).float()
    scale, fact = torch.ones(4, 1, 64), torch.arange(4)
    got = cpu_kernels.dequantize_cpu(x, scale, fact, kv_dtype)
    rope = RopeSpec(1e4, 64, "split")
    one, zero = torch.ones(4, 32), torch.zeros(4, 32)  # a rotation by 0
    outs = [got]
    if kv_dtype == "int8":
        outs.append(cpu_kernels.dequantize_rotate_cpu(x, scale, fact, one, zero, rope, kv_dtype))
    nan = want.isnan()
    for out in outs:
        assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))
        assert out[nan].isnan().all()
