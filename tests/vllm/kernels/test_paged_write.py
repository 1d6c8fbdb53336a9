"""`compact.write_paged` (stored facts straight into vLLM's CPU paged cache, one Numba pass, in the
layout learned from the backend's own write) against the reference path it replaces: `layer_kv`
with the torch references, rounded to the cache's dtype, then the CPU attention backend's own cache
write (vLLM's `cpu_attn_reshape_and_cache`). float32 caches ("vec") and bfloat16 caches (the ISA
vLLM picks for them here: "amx" where the CPU has AMX), poisoned caches, several facts with their
own scales, a load that starts mid-fact, slots out of order over several blocks, a layer subset
(layerwise loads), whole blocks in streaming and in plain stores, and every slot the load does not
own left untouched; a layout of short rows (as "amx") written through the kernel's scatter path on
any CPU. `learn_layout` finds the "vec" layout vLLM documents, learns other layouts, and refuses
writes it cannot reproduce."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm._custom_ops")

from inferscale.common.model.spec import RopeSpec  # noqa: E402
from inferscale.common.storage.format import FactKV, StoreMeta  # noqa: E402
from inferscale.common.storage.local_store import Store
from inferscale.vllm.kernels import cpu_kernels  # noqa: E402
from inferscale.vllm.kernels.compact import gather, layer_kv, write_paged  # noqa: E402
from inferscale.vllm.kernels.paged_write import learn_layout  # noqa: E402
from inferscale.vllm.kernels.chunked_rope import RopeTable  # noqa: E402
from cache_writes import backend, isa_of, paired  # noqa: E402

if not cpu_kernels.available():
    pytest.skip("numba is not installed", allow_module_level=True)

L, H, D, BS, BLOCKS = 3, 2, 32, 32, 6
POISON = 7.0e30


def _isa(dtype: torch.dtype) -> str:
    return isa_of(dtype, BS, D)


# cache kind -> (dtype, its write): vLLM's float32 "vec", vLLM's bfloat16 (whatever ISA it picks), bfloat16
# in "vec" (the streaming stores of 16-bit elements), a short-row layout
CACHES = {"float32-vec": (torch.float32, lambda: backend("vec")),
          "bfloat16": (torch.bfloat16, lambda: backend(_isa(torch.bfloat16))),
          "bfloat16-vec": (torch.bfloat16, lambda: backend("vec")),  # long rows of 16-bit elements
          "bfloat16-paired": (torch.bfloat16, lambda: paired)}


def _learn(dtype, write):
    layout = learn_layout(write, torch.zeros(BLOCKS, H, BS, 2 * D, dtype=dtype), BS, H, D)
    assert layout is not None, f"{dtype} {write}"
    return layout


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


def test_the_vec_layout_is_learned_as_vllm_lays_it_out():
    layout = _learn(torch.float32, backend("vec"))
    count = BS * H * D
    want = np.empty(2 * count, np.int64)  # per (block, head): K channel-major [D, BS], then V [BS, D]
    for h in range(H):
        for s in range(BS):
            for c in range(D):
                n = (s * H + h) * D + c
                want[h * 2 * BS * D + c * BS + s] = n
                want[h * 2 * BS * D + BS * D + s * D + c] = count + n
    np.testing.assert_array_equal(layout.inv, want)
    np.testing.assert_array_equal(layout.slot, want % count // (H * D))
    assert len(layout.flush_runs) == 2 * H  # per head: K a channel's slots at a time, V a slot's channels


def test_layouts_are_learned_or_refused():
    like = torch.zeros(BLOCKS, H, BS, 2 * D)

    def permuted(k, v, cache, slots):  # another layout: per block [V | K], token-major, channels reversed
        flat = cache.view(cache.shape[0], 2, BS, H, D)
        flat[slots // BS, 0, slots % BS] = v.flip(-1)
        flat[slots // BS, 1, slots % BS] = k.flip(-1)

    layout = learn_layout(permuted, like, BS, H, D)
    assert layout is not None and layout.inv[0] == BS * H * D + D - 1  # block element 0: V of slot 0, channel D-1
    layout = learn_layout(paired, like, BS, H, D)  # reproduced by the kernel's scatter path
    assert layout is not None and len(layout.flush_runs) == 0 and layout.inv[1] == 1 and layout.inv[2] == H * D
    swapped = lambda k, v, cache, slots: backend("vec")(v, k, cache, slots)  # noqa: E731
    assert learn_layout(swapped, like, BS, H, D) is not None  # K where V was: a layout like another

    def scaled(k, v, cache, slots):
        backend("vec")(k * 2, v, cache, slots)

    def spills(k, v, cache, slots):
        backend("vec")(k, v, cache, slots)
        cache[0, 0, 0, 0] = 1.0

    def drops(k, v, cache, slots):  # one channel of K never written
        backend("vec")(k, v, cache, slots)
        cache.view(cache.shape[0], H, 2, D, BS)[:, :, 0, 3] = 0

    def refuses(k, v, cache, slots):
        raise RuntimeError("no scratch caches")

    for write in (scaled, spills, drops, refuses):
        assert learn_layout(write, like, BS, H, D) is None, write.__name__
    assert learn_layout(backend("vec"), like.half(), BS, H, D) is None  # float16: not a cache dtype it writes
    assert learn_layout(backend("vec"), like, BS, H, 2 * D) is None  # more than a block holds


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3"])
@pytest.mark.parametrize("ropes", [[RopeSpec(1e4, D, "split")], [RopeSpec(1e4, 16, "interleaved")],
                                   [RopeSpec(1e4, D, "split"), RopeSpec(1e6, 16, "split")]],
                         ids=["split", "interleaved-partial", "two-ropes"])
@pytest.mark.parametrize("streaming", [True, False], ids=["streaming-stores", "plain-stores"])
def test_write_paged_equals_layer_kv_then_the_backend_write(tmp_path, cache, dtype, ropes, streaming):
    cache_dtype, make_write = CACHES[cache]
    write = make_write()
    layout = _learn(cache_dtype, write)
    part = _part(tmp_path, dtype, ropes[0])
    n = len(part.positions)
    layer_rope = [i % len(ropes) for i in range(L)]
    tables = [RopeTable(r, 256)(torch.from_numpy(part.positions)) for r in ropes]
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(BLOCKS - 1, generator=g)[:3] + 1  # the request's blocks, out of order
    pos = torch.arange(n) + 56  # blocks: 8 slots, all 32 of the next (the whole-block path), 7
    slots = blocks[pos // BS - 1] * BS + pos % BS
    layers = [0, 2]  # a subset, as a layerwise load writes
    want = [torch.full((BLOCKS, H, BS, 2 * D), POISON, dtype=cache_dtype) for _ in range(L)]
    got = [c.clone() for c in want]
    for i in layers:
        r = layer_rope[i]
        k, v = layer_kv(part, i, *tables[r], ropes[r], cache_dtype, torch.device("cpu"), "reference")
        write(k, v, want[i], slots)
    write_paged(part, layers, [got[i] for i in layers], slots, tables, ropes, layer_rope, layout, streaming)
    for i in range(L):  # bit-equal; unwritten layers still poisoned
        assert torch.equal(got[i].view(torch.uint8), want[i].view(torch.uint8)), f"layer {i}"
    assert (got[1] == POISON).all()
    owned = np.zeros(BLOCKS * BS, bool)
    owned[slots.numpy()] = True
    elems = got[0].reshape(BLOCKS, -1)
    slot_of = torch.arange(BLOCKS)[:, None] * BS + torch.from_numpy(layout.slot)[None]  # [BLOCKS, block elements]
    mine = torch.from_numpy(owned)[slot_of] & torch.from_numpy(layout.slot >= 0)[None]
    assert (elems[~mine] == POISON).all() and (elems[mine] != POISON).all()


def test_a_prepared_write_split_over_threads_writes_what_one_call_writes(tmp_path):
    """The connector prepares a load once and writes its layers in one call, one layer at a time
    (layerwise, background) or split over threads (`write_threads.split_write`): the same bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from inferscale.vllm.kernels.compact import prepare_paged
    from inferscale.vllm.write_threads import split_write

    rope = RopeSpec(1e4, D, "split")
    layout = _learn(torch.float32, backend("vec"))
    part = _part(tmp_path, "int8", rope)
    n = len(part.positions)
    tables = [RopeTable(rope, 256)(torch.from_numpy(part.positions))]
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(2)) + BS
    write = prepare_paged(part, slots, tables, [rope], [0] * L, layout)
    ways = {w: [torch.full((BLOCKS, H, BS, 2 * D), POISON) for _ in range(L)] for w in ("one", "each", "split")}
    write(list(range(L)), ways["one"])
    for i in range(L):
        write([i], [ways["each"][i]])
    with ThreadPoolExecutor(2) as pool:
        split_write(write, list(range(L)), ways["split"], pool, 3)
    for w in ("each", "split"):
        assert all(torch.equal(a, b) for a, b in zip(ways[w], ways["one"])), w
    assert not all((c == POISON).all() for c in ways["one"])


def test_write_paged_refuses_what_it_cannot_write(tmp_path):
    rope = RopeSpec(1e4, D, "split")
    part = _part(tmp_path, "float32", rope)
    layout = _learn(torch.float32, backend("vec"))
    n = len(part.positions)
    tables = [RopeTable(rope, 256)(torch.from_numpy(part.positions))]
    slots = torch.arange(n) + BS
    with pytest.raises(ValueError, match="not of the learned layout"):
        write_paged(part, [0], [torch.zeros(BLOCKS, H, BS, 2 * D, dtype=torch.bfloat16)], slots, tables, [rope],
                    [0] * L, layout)
    with pytest.raises(ValueError, match="slots"):
        write_paged(part, [0], [torch.zeros(BLOCKS, H, BS, 2 * D)], slots[:-1], tables, [rope], [0] * L, layout)
    # the kernel does not check bounds: a slot outside the cache (or vLLM's padding -1) is refused
    for bad in (BLOCKS * BS, -1):
        wild = slots.clone()
        wild[3] = bad
        cache = torch.full((BLOCKS, H, BS, 2 * D), POISON)
        with pytest.raises(ValueError, match=r"slots must lie in \[0, "):
            write_paged(part, [0], [cache], wild, tables, [rope], [0] * L, layout)
        assert (cache == POISON).all()
    with pytest.raises(ValueError, match="layers"):
        write_paged(part, [L], [torch.zeros(BLOCKS, H, BS, 2 * D)], slots, tables, [rope], [0] * L, layout)


def test_the_kernels_come_from_numba_s_disk_cache_in_a_second_process():
    """Every vLLM worker warms the kernels up when its caches are registered: from Numba's disk
    cache that takes about a second; a kernel Numba cannot cache (one that reaches another jitted
    function through a closure, say) compiles again in every worker, some 14 s."""
    import subprocess
    import sys

    code = ("from inferscale.vllm.kernels import cpu_kernels, paged_write\n"
            "cpu_kernels.warm_up(); paged_write.warm_up()\n"
            "ks = [*cpu_kernels._kernels(), paged_write._kernels()]\n"
            "print(sum(sum(k.stats.cache_misses.values()) for k in ks), min(len(k.stats.cache_hits) for k in ks))")
    for _ in range(2):  # the first may compile (a fresh checkout); the second must not
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
    misses, hits = map(int, out.stdout.split()[-2:])
    assert misses == 0 and hits > 0


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_read_paged_returns_what_the_backend_wrote(cache):
    """`read_paged` (a request's cached positions, read back through the learned layout) is the
    inverse of the backend's own write: random K / V written at positions [0, n) of blocks out of
    order, in the cache's dtype, come back as written, the other blocks' poison never read."""
    from inferscale.vllm.kernels.cache_layout import read_paged

    dtype, make = CACHES[cache]
    write = make()
    layout = _learn(dtype, write)
    rng = np.random.default_rng(1)
    for n in (1, BS - 1, BS, 2 * BS + 5):
        blocks = [int(b) for b in rng.permutation(BLOCKS)[: -(-n // BS)]]
        kv = torch.full((BLOCKS, H, BS, 2 * D), POISON, dtype=dtype)
        k = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)).to(dtype)
        v = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)).to(dtype)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.int64)[pos // BS] * BS + pos % BS
        write(k, v, kv, slots)
        got_k, got_v = read_paged(kv, layout, blocks, n)
        assert got_k.dtype == torch.float32 and got_k.shape == (n, H, D)
        torch.testing.assert_close(got_k, k.float(), rtol=0, atol=0)
        torch.testing.assert_close(got_v, v.float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="blocks"):
        read_paged(kv, layout, [0], BS + 1)
