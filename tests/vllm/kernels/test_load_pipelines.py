"""The connector's two load pipelines write the same bytes into a CPU paged cache for the same
staged load wherever both apply: the CPU pipeline (`kernels/cpu_pipeline.py`: the Numba kernel
straight into the cache, in the layout learned from the backend's own write) and the backend
pipeline (`kernels/backend_pipeline.py`: `layer_kv`, then the backend's `do_kv_cache_update`).

A property over staged loads as the worker stages them (`ConnectorWorker._stage`): one or two
stored dtypes (the header's store and the user's: two parts), facts of any length, a load that
starts mid-fact at any position, the request's blocks out of order, one or two RoPE settings,
float32 and bfloat16 caches in vLLM's own CPU layout and in a layout of short rows (the kernel's
scatter path), streaming or plain stores, any subset of layers written in one call (the CPU
pipeline's write split over its helper threads) or one at a time (layerwise, background). Layers
not written stay poisoned, as do the slots of a block the load does not own. (Each kernel against
its torch reference: `test_paged_write.py`, `test_compact_layers.py`.)"""

import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm._custom_ops")
pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from inferscale.common.model.spec import ModelSpec, RopeSpec  # noqa: E402
from inferscale.common.storage.format import FactKV, StoreMeta  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.vllm.cache_layouts import CacheLayouts  # noqa: E402
from inferscale.vllm.kernels import cpu_kernels  # noqa: E402
from inferscale.vllm.kernels.backend_pipeline import BackendPipeline  # noqa: E402
from inferscale.vllm.kernels.chunked_rope import RopeTable  # noqa: E402
from inferscale.vllm.kernels.compact import gather  # noqa: E402
from inferscale.vllm.kernels.cpu_pipeline import CpuPagedPipeline  # noqa: E402
from inferscale.vllm.kernels.load_pipeline import LoadPipeline  # noqa: E402
from cache_writes import backend, isa_of, paired  # noqa: E402

if not cpu_kernels.available():
    pytest.skip("numba is not installed", allow_module_level=True)

L, H, D, BS, BLOCKS = 3, 2, 32, 16, 8
POISON = 7.0e30
DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3")
ROPES = {"split": [RopeSpec(1e4, D, "split")], "interleaved-partial": [RopeSpec(1e4, 16, "interleaved")],
         "two-ropes": [RopeSpec(1e4, D, "split"), RopeSpec(1e6, D, "split")]}


CACHES = {"float32": (torch.float32, lambda: backend(isa_of(torch.float32, BS, D))),
          "bfloat16": (torch.bfloat16, lambda: backend(isa_of(torch.bfloat16, BS, D))),
          "bfloat16-paired": (torch.bfloat16, lambda: paired)}
_LAYOUTS: dict[str, CacheLayouts] = {}  # per cache kind: learned once for the module, as the worker does


class Layer:
    """What the pipelines read of a vLLM attention layer: its cache and its backend's write."""

    def __init__(self, cache: torch.Tensor, write) -> None:
        self.kv_cache, self._write = cache, write
        self.impl = self

    def do_kv_cache_update(self, layer, k, v, kv_cache, slots):
        assert layer is self  # (kv_cache: its own, or a scratch cache while its layout is learned)
        self._write(k, v, kv_cache, slots)


def _spec(ropes: list[RopeSpec]) -> ModelSpec:
    two = len(ropes) == 2  # the second: sliding layers' own RoPE (as Gemma 3's)
    return ModelSpec(family="llama", vocab_size=64, hidden_size=2 * H * D, intermediate_size=64, num_layers=L,
                     num_heads=2 * H, num_kv_heads=H, head_dim=D, rms_norm_eps=1e-6, rope=ropes[0], max_position=512,
                     layer_types=("full_attention", "sliding_attention", "full_attention") if two else None,
                     sliding_window=8 if two else None, local_rope=ropes[1] if two else None)


def _staged(root: Path, stored: list[str], lengths: list[int], cut: int, start: int, ropes: list[RopeSpec],
            block_ids: list[int], seed: int):
    """A staged load's parts as `ConnectorWorker._stage` builds them: facts `lengths` long, fact j
    kept as `stored[j % len(stored)]`, the load from token `cut` of the first fact on, served from
    position `start`: per stored dtype (part, slots [n], RoPE tables at its positions)."""
    rng = np.random.default_rng(seed)
    rope = ropes[0]
    stores = {d: Store.create(root / d, StoreMeta("c" * 64, L, H, D, {"theta": rope.theta, "rotary_dim": rope.rotary_dim,
                                                                      "style": rope.style}, w=2).with_dtype(d))
              for d in stored}
    pieces, pos = [], start
    for j, n in enumerate(lengths):
        k = rng.standard_normal((L, n, H, D)).astype(np.float32) * rng.uniform(0.1, 20, (1, 1, H, D))
        store = stores[stored[j % len(stored)]]
        store.put([FactKV(f"f{j}", np.arange(n), k, (0.5 * k).astype(np.float32))])
        (c,) = store.get_compact([f"f{j}"])
        a = cut if j == 0 else 0
        pieces.append((c, a, n, pos))
        pos += n - a
    blocks = torch.tensor(block_ids, dtype=torch.int64)
    tables = [RopeTable(r, 512) for r in ropes]
    out = []
    for part in gather(pieces):
        p = torch.from_numpy(part.positions)
        out.append((part, blocks[p // BS] * BS + p % BS, [t(p) for t in tables]))
    return out


def _write(pipeline: LoadPipeline, parts, cache_kind: str, ids: list[int], one_call: bool) -> list[torch.Tensor]:
    dtype, make = CACHES[cache_kind]
    write = make()
    layers = {i: Layer(torch.full((BLOCKS, H, BS, 2 * D), POISON, dtype=dtype), write) for i in range(L)}
    prepared = pipeline.prepare(parts, layers)
    if one_call:
        pipeline.write(prepared, ids)
    else:
        for i in ids:
            pipeline.write(prepared, [i])
    return [layers[i].kv_cache for i in range(L)]


@settings(max_examples=30, deadline=None)
@given(cache=st.sampled_from(sorted(CACHES)), stored=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=2, unique=True),
       lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), cut=st.integers(0, 19),
       start=st.integers(0, 2 * BS), rope=st.sampled_from(sorted(ROPES)), streaming=st.booleans(),
       ids=st.lists(st.integers(0, L - 1), min_size=1, max_size=L, unique=True), cpu_one_call=st.booleans(),
       blocks=st.permutations(range(BLOCKS)), seed=st.integers(0, 2**16))
def test_both_pipelines_write_the_same_bytes_into_a_cpu_paged_cache(cache, stored, lengths, cut, start, rope, streaming,
                                                                    ids, cpu_one_call, blocks, seed):
    cut = min(cut, lengths[0] - 1)
    ropes = ROPES[rope]
    spec = _spec(ropes)
    with tempfile.TemporaryDirectory() as tmp:
        parts = _staged(Path(tmp), stored, lengths, cut, start, ropes, list(blocks), seed)
    if cache not in _LAYOUTS:
        _LAYOUTS[cache] = CacheLayouts(spec, BS)  # (the layout depends on heads, head_dim and the cache only)
    cpu = CpuPagedPipeline(spec, _LAYOUTS[cache], streaming=streaming, threads=3)
    try:
        direct = _write(cpu, parts, cache, ids, cpu_one_call)
    finally:
        cpu.close()
    assert cpu.paged and not BackendPipeline.paged
    through_backend = _write(BackendPipeline(spec), parts, cache, ids, one_call=True)
    for i in range(L):
        assert torch.equal(direct[i].view(torch.uint8), through_backend[i].view(torch.uint8)), f"layer {i}"
        assert (direct[i] == POISON).all() == (i not in ids)
    owned = np.zeros(BLOCKS * BS, bool)
    for _, slots, _ in parts:
        owned[slots.numpy()] = True
    layout = _LAYOUTS[cache].of({0: Layer(direct[0], None)})[0]
    slot_of = torch.arange(BLOCKS)[:, None] * BS + torch.from_numpy(layout.slot)[None]  # [BLOCKS, block elements]
    mine = torch.from_numpy(owned)[slot_of] & torch.from_numpy(layout.slot >= 0)[None]
    elems = direct[ids[0]].reshape(BLOCKS, -1)
    assert (elems[~mine] == POISON).all() and (elems[mine] != POISON).all()


def test_the_cpu_pipeline_needs_every_layer_s_layout():
    """The worker picks it only where every layout is known; a layout it cannot learn (a backend
    that refuses the scratch cache) is an error rather than a silent backend write."""
    spec = _spec(ROPES["split"])

    def refuses(k, v, cache, slots):
        raise RuntimeError("no scratch caches")

    layers = {i: Layer(torch.zeros(BLOCKS, H, BS, 2 * D), refuses) for i in range(L)}
    with pytest.raises(RuntimeError, match="layout"):
        CpuPagedPipeline(spec, CacheLayouts(spec, BS)).prepare([], layers)
