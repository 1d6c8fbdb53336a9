"""`compact.write_paged` (stored facts straight into vLLM's CPU paged cache, one Numba pass) against
the reference path it replaces: `layer_kv` with the torch references, then the CPU attention
backend's own cache write (vLLM's `cpu_attn_reshape_and_cache`). Poisoned caches, several facts
with their own scales, a load that starts mid-fact, slots out of order over several blocks, a
layer subset (layerwise loads), and every slot the load does not own left untouched."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm._custom_ops")

from inferscale.common.spec import RopeSpec  # noqa: E402
from inferscale.common.store import FactKV, Store, StoreMeta  # noqa: E402
from inferscale.vllm import cpu_kernels  # noqa: E402
from inferscale.vllm.compact import gather, layer_kv, write_paged  # noqa: E402
from inferscale.vllm.rope import RopeTable  # noqa: E402

if not cpu_kernels.available():
    pytest.skip("numba is not installed", allow_module_level=True)

L, H, D, BS, BLOCKS = 3, 2, 32, 32, 6
POISON = 7.0e30


def backend_write(k, v, cache, slots):
    """vLLM's CPU backend cache write (what `do_kv_cache_update` calls on the "vec" ISA)."""
    import vllm._custom_ops as ops

    nb, heads, bs, _ = cache.shape
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def _part(tmp_path, dtype, rope):
    rng = np.random.default_rng(0)
    meta = StoreMeta("c" * 64, L, H, D, {"theta": rope.theta, "rotary_dim": rope.rotary_dim, "style": rope.style},
                     w=2).with_dtype(dtype)
    st = Store.create(tmp_path / "s", meta)
    facts = []
    for i, n in enumerate((9, 30, 12)):
        k = rng.standard_normal((L, n, H, D)).astype(np.float32) * rng.uniform(0.1, 20, (1, 1, H, D))
        facts.append(FactKV(f"f{i}", np.arange(n), k, (0.5 * k).astype(np.float32)))
    st.put(facts)
    c = st.get_compact(["f0", "f1", "f2"])
    (part,) = gather([(c[0], 4, 9, 40), (c[1], 0, 30, 45), (c[2], 0, 12, 75)])  # [4, 51) mid-fact
    return part


def test_the_backend_layout_is_the_one_the_kernel_writes():
    assert cpu_kernels.paged_layout_matches(backend_write, torch.zeros(BLOCKS, H, BS, 2 * D), BS)
    swapped = lambda k, v, cache, slots: backend_write(v, k, cache, slots)  # noqa: E731
    assert not cpu_kernels.paged_layout_matches(swapped, torch.zeros(BLOCKS, H, BS, 2 * D), BS)
    assert not cpu_kernels.paged_layout_matches(backend_write, torch.zeros(BLOCKS, H, BS, 2 * D,
                                                                           dtype=torch.bfloat16), BS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3"])
@pytest.mark.parametrize("ropes", [[RopeSpec(1e4, D, "split")], [RopeSpec(1e4, 16, "interleaved")],
                                   [RopeSpec(1e4, D, "split"), RopeSpec(1e6, 16, "split")]],
                         ids=["split", "interleaved-partial", "two-ropes"])
def test_write_paged_equals_layer_kv_then_the_backend_write(tmp_path, dtype, ropes):
    part = _part(tmp_path, dtype, ropes[0])
    n = len(part.positions)
    layer_rope = [i % len(ropes) for i in range(L)]
    tables = [RopeTable(r, 256)(torch.from_numpy(part.positions)) for r in ropes]
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(BLOCKS - 1, generator=g)[:3] + 1  # the request's blocks, out of order
    pos = torch.arange(n) + 40
    slots = blocks[pos // BS - 1] * BS + pos % BS
    layers = [0, 2]  # a subset, as a layerwise load writes
    want = [torch.full((BLOCKS, H, BS, 2 * D), POISON) for _ in range(L)]
    got = [c.clone() for c in want]
    for i in layers:
        r = layer_rope[i]
        k, v = layer_kv(part, i, *tables[r], ropes[r], torch.float32, torch.device("cpu"), "reference")
        backend_write(k, v, want[i], slots)
    write_paged(part, layers, [got[i] for i in layers], slots, tables, ropes, layer_rope, BS)
    for i in range(L):
        assert torch.equal(got[i], want[i]), f"layer {i}"  # bit-equal; unwritten layers still poisoned
    untouched = torch.ones(BLOCKS * BS, dtype=torch.bool)
    untouched[slots] = False
    assert (got[1] == POISON).all()
    flat = got[0].view(BLOCKS, H, 2, BS * D)  # per (block, head): K channel-major, then V token-major
    k_region = flat[:, :, 0].reshape(BLOCKS, H, D, BS).permute(0, 3, 1, 2).reshape(BLOCKS * BS, H, D)
    v_region = flat[:, :, 1].reshape(BLOCKS, H, BS, D).permute(0, 2, 1, 3).reshape(BLOCKS * BS, H, D)
    assert (k_region[untouched] == POISON).all() and (v_region[untouched] == POISON).all()
    assert (k_region[~untouched] != POISON).all() and (v_region[~untouched] != POISON).all()


def test_write_paged_refuses_what_it_cannot_write(tmp_path):
    rope = RopeSpec(1e4, D, "split")
    part = _part(tmp_path, "float32", rope)
    n = len(part.positions)
    tables = [RopeTable(rope, 256)(torch.from_numpy(part.positions))]
    slots = torch.arange(n) + BS
    with pytest.raises(ValueError, match="not of the layout"):
        write_paged(part, [0], [torch.zeros(BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16)], slots, tables, [rope],
                    [0] * L, BS)
    with pytest.raises(ValueError, match="slots"):
        write_paged(part, [0], [torch.zeros(BLOCKS, H, BS, 2 * D)], slots[:-1], tables, [rope], [0] * L, BS)
    # the kernel does not check bounds: a slot outside the cache (or vLLM's padding -1) is refused
    for bad in (BLOCKS * BS, -1):
        wild = slots.clone()
        wild[3] = bad
        cache = torch.full((BLOCKS, H, BS, 2 * D), POISON)
        with pytest.raises(ValueError, match=r"slots must lie in \[0, "):
            write_paged(part, [0], [cache], wild, tables, [rope], [0] * L, BS)
        assert (cache == POISON).all()
    with pytest.raises(ValueError, match="layers"):
        write_paged(part, [L], [torch.zeros(BLOCKS, H, BS, 2 * D)], slots, tables, [rope], [0] * L, BS)
