"""Stored facts straight into vLLM's CPU paged KV cache, whatever layout the attention backend
keeps: the layout is **learned from the backend's own cache write** (`learn_layout`), then one
Numba pass per load dequantises and rotates the stored keys, dequantises the values, rounds both to
the cache's dtype and writes every layer's slots (`write_paged`). No joined part, no per-layer
float32 K / V, no second pass through the backend's write.

vLLM's CPU backends lay a block out differently per ISA: "vec" (float32) stores each (block,
head) as K channel-major [D, block_size] then V token-major [block_size, D]; "amx" (bfloat16)
packs channel pairs of 16-token groups for its tiles; others differ again. Rather than hard-code
them, `learn_layout` writes numbered K / V through the backend into a scratch cache and reads
back where each (slot, head, channel) landed:

    layout.inv[q]   int64 [block elements]: what the backend puts at element q of a block, as an
                    index into [2 (K, V), block_size, KVH, D], or -1 (an element it never writes)
    layout.slot[q]  int64 [block elements]: that element's slot in the block (-1 likewise)

and accepts the map only if it is block-local, one-to-one, and a random write through the kernel
equals the backend's write bit for bit (else the connector keeps the backend's write).

The kernel fills one block's slots of one layer into a scratch [2, block_size, KVH, D] (in the
cache's element bits: float32, or bfloat16 rounded to nearest even as torch rounds). Where the
layout has long rows (`layout.runs`: "vec" is one K run and one V run per head) it then copies a
block out run by run in the block's own order, so the stores into the cache are sequential, and
streaming (`nontemporal.py`: a plain store first reads the cache line it fills, which for a
bandwidth-bound write of ~92 MB is half the traffic; `PreparedWrite(streaming=False)` keeps plain
stores; `benchmarks/cpu_paths.py --parts write` times both and the backend's path); where rows are
short ("amx": pairs) it scatters each token's elements as soon as they are ready (`layout.where`).
Slots of a block that the load does not own are never written.

The reference is the path it replaces: `compact.layer_kv` (the torch references), rounded to the
cache's dtype, then the backend's write. `tests/vllm/test_paged_write.py` checks the caches are
bit-equal, for every stored dtype, float32 and bfloat16 caches, and layouts of other shapes.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from inferscale.common.model.spec import RopeSpec
from inferscale.vllm.kernels.cache_layout import CACHE_DTYPES, PagedLayout, probe_layout
from inferscale.vllm.kernels.cpu_kernels import (
    _BF16,
    _INT8,
    _KINDS,
    _QUANTIZED,
    _TABLE,
    _numba,
    _table,
)

def learn_layout(write: Callable, like: torch.Tensor, block_size: int, heads: int, head_dim: int
                 ) -> PagedLayout | None:
    """The layout `write(k, v, cache, slots)` (the backend's own cache write; k, v [n, heads,
    head_dim] in the cache's dtype, int64 slots) gives caches shaped like `like` ([num_blocks,
    ...]), or None where the kernel cannot reproduce it: another dtype, a write that touches other
    blocks or scales the values, a map that is not one-to-one, or a backend that refuses the
    scratch cache."""
    if like.dtype not in CACHE_DTYPES or like.dim() < 2 or like.device.type != "cpu":
        return None
    per_block = like[0].numel()
    count = block_size * heads * head_dim  # of K (and of V) in one block
    if 2 * count > per_block:
        return None
    try:
        inv, slot = probe_layout(write, like, block_size, heads, head_dim)
        if inv is None:
            return None
        layout = PagedLayout(like.dtype, block_size, heads, head_dim, inv, slot)
        return layout if _reproduces(write, like, layout) else None
    except Exception:  # noqa: BLE001 - a backend that cannot write a scratch cache keeps its own write
        return None


def _reproduces(write, like, layout: PagedLayout) -> bool:
    """Random K / V written by the backend and by the kernel: every slot of block 1 (the kernel's
    whole-block path) and some of blocks 2 and 3 (its partial-block path), each out of order."""
    bs, heads, d = layout.block_size, layout.heads, layout.head_dim
    g = torch.Generator().manual_seed(1)
    slots = torch.cat([torch.randperm(bs, generator=g) + bs,
                       torch.randperm(2 * bs, generator=g)[:bs // 2 + 3] + 2 * bs])
    n = len(slots)
    k, v = torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)
    theirs, ours = (torch.zeros((5, *like.shape[1:]), dtype=like.dtype) for _ in range(2))
    write(k.to(like.dtype), v.to(like.dtype), theirs, slots)
    rope = RopeSpec(theta=1e4, rotary_dim=d, style="split")
    one, zero = torch.ones(n, d // 2), torch.zeros(n, d // 2)  # a rotation by 0: the keys unchanged
    write_paged([k.numpy()[None]], [v.numpy()[None]], [(0, n)], None, None, "float32", [one], [zero], [rope],
                [0], [0], [ours], slots, layout)
    return torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8))


@functools.cache
def _kernels():
    numba = _numba()
    from inferscale.vllm.kernels import (
        nontemporal as nt,  # (a module: the kernel's disk-cache key pickles it by name)
    )
    jit = numba.njit(cache=True, fastmath=False, nogil=True, boundscheck=False)

    # The row decode is written out for K and for V: a helper taking arrays costs reference
    # counting per call (measured 3x slower), and each branch stays a plain loop over the channels.
    # The kernel calls no other jitted function: Numba caches on disk only functions that reach no
    # other dispatcher through a closure (else every engine start compiles it again, ~14 s). The
    # streaming stores are intrinsics (inlined IR, no call), reached through their module, which
    # the cache key pickles by name (intrinsic objects themselves would pickle differently per process).
    @jit
    def write_paged(ks, vs, ranges, k_scales, v_scales, scaled, kind, lut, cos, sin, halves, interleaved,
                    layer_rope, layer_ids, caches, slots, bs, runs, inv, slot, where, to_bf16, streaming):
        """Every listed layer of every piece, dequantised, rotated, rounded to the cache's type and
        written into its slots through `buf`: a block at a time along `runs` (after a block's last
        token in a row of the load's), or (no runs: a layout of short rows, as "amx") each token's
        elements scattered as soon as they are ready. bfloat16 caches get float32 rounded to
        nearest even, as torch rounds (NaN -> 0x7FC0). Arrays are indexed flat with unsigned
        offsets (signed indices cost a negative-index check per element)."""
        u = np.uint64
        heads, d = ks[0].shape[2], ks[0].shape[3]
        hd, ud, uhmax = u(heads * d), u(d), u(cos.shape[2])
        v_at = u(bs) * hd  # V's half of the scratch
        per_block, n = u(inv.shape[0]), slots.shape[0]
        scatter = runs.shape[0] == 0
        buf = np.empty(2 * bs * heads * d, np.uint32)  # [2, bs, KVH, D] one block's elements, as stored
        present = np.zeros(bs, np.bool_)
        bits = np.empty(d, np.uint32)
        row = bits.view(np.float32)
        obits = np.empty(d, np.uint32)
        orow = obits.view(np.float32)
        for j in range(len(layer_ids)):
            layer, cache = layer_ids[j], caches[j].reshape(-1)
            address = u(cache.ctypes.data)
            r = layer_rope[layer]
            half, inter = halves[r], interleaved[r]
            uhalf = u(half)
            cr, sr = cos[r].reshape(-1), sin[r].reshape(-1)  # [n, hmax]
            t, current, owned = 0, -1, 0
            for p in range(len(ks)):
                # (taken out of the lists once per piece: each take is counted)
                k, v = ks[p][layer].reshape(-1), vs[p][layer].reshape(-1)  # [n_p, KVH, D]
                if scaled:
                    ksc, vsc = k_scales[p][layer].reshape(-1), v_scales[p][layer].reshape(-1)  # [KVH, D]
                else:
                    ksc, vsc = k_scales[0].reshape(-1), v_scales[0].reshape(-1)
                for i in range(ranges[p, 0], ranges[p, 1]):
                    blk, s_ = slots[t] // bs, slots[t] % bs
                    if not scatter:  # which slots of the block this row of the load owns
                        if blk != current:
                            current, owned = blk, 0
                        if not present[s_]:
                            present[s_] = True
                            owned += 1
                    cs = u(t) * uhmax
                    for h in range(heads):
                        src, out = u(i) * hd + u(h) * ud, u(s_) * hd + u(h) * ud
                        # K: decoded and scaled into `row`, rotated into `orow`
                        if kind == _BF16:
                            for c in range(d):
                                bits[c] = np.uint32(k[src + u(c)]) << np.uint32(16)
                        elif kind == _INT8:
                            for c in range(d):
                                row[c] = np.float32(np.int8(k[src + u(c)]))
                        elif kind == _TABLE:
                            for c in range(d):
                                row[c] = lut[k[src + u(c)]]
                        else:
                            for c in range(d):
                                bits[c] = k[src + u(c)]
                        if scaled:
                            for c in range(d):
                                row[c] *= ksc[u(h) * ud + u(c)]
                        if inter:  # pairs (2c, 2c + 1)
                            for c in range(half):
                                a, b, co, si = row[2 * c], row[2 * c + 1], cr[cs + u(c)], sr[cs + u(c)]
                                orow[2 * c] = a * co - b * si
                                orow[2 * c + 1] = b * co + a * si
                        else:  # pairs (c, c + half)
                            for c in range(half):
                                a, b, co, si = row[c], row[c + half], cr[cs + u(c)], sr[cs + u(c)]
                                orow[c] = a * co - b * si
                                orow[u(c) + uhalf] = b * co + a * si
                        for c in range(2 * half, d):
                            orow[c] = row[c]
                        if to_bf16:
                            for c in range(d):
                                x = obits[c]
                                rne = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                                buf[out + u(c)] = np.uint32(0x7FC0) if (x & np.uint32(0x7FFFFFFF)) > np.uint32(
                                    0x7F800000) else rne
                        else:
                            for c in range(d):
                                buf[out + u(c)] = obits[c]
                        # V: decoded and scaled into `row`
                        if kind == _BF16:
                            for c in range(d):
                                bits[c] = np.uint32(v[src + u(c)]) << np.uint32(16)
                        elif kind == _INT8:
                            for c in range(d):
                                row[c] = np.float32(np.int8(v[src + u(c)]))
                        elif kind == _TABLE:
                            for c in range(d):
                                row[c] = lut[v[src + u(c)]]
                        else:
                            for c in range(d):
                                bits[c] = v[src + u(c)]
                        if scaled:
                            for c in range(d):
                                row[c] *= vsc[u(h) * ud + u(c)]
                        if to_bf16:
                            for c in range(d):
                                x = bits[c]
                                rne = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                                buf[v_at + out + u(c)] = np.uint32(0x7FC0) if (x & np.uint32(0x7FFFFFFF)) > np.uint32(
                                    0x7F800000) else rne
                        else:
                            for c in range(d):
                                buf[v_at + out + u(c)] = bits[c]
                    base = u(blk) * per_block
                    if scatter:
                        first = u(s_) * hd
                        for e in range(first, first + hd):
                            cache[base + u(where[e])] = buf[e]
                            cache[base + u(where[v_at + e])] = buf[v_at + e]
                    elif t + 1 == n or slots[t + 1] // bs != blk:  # the block's last token here: copy it out
                        if owned == bs:  # run by run, in the block's order
                            for r in range(runs.shape[0]):
                                dst, outer, inner, src0 = base + u(runs[r, 0]), runs[r, 1], runs[r, 2], runs[r, 3]
                                for o in range(outer):
                                    at, ro, step = src0 + o * runs[r, 4], dst + u(o * inner), runs[r, 5]
                                    if not streaming:
                                        for q in range(inner):
                                            cache[ro + u(q)] = buf[u(at + q * step)]
                                    elif to_bf16:
                                        for q in range(inner):
                                            nt.store_nt(address, ro + u(q), np.uint16(buf[u(at + q * step)]))
                                    else:
                                        for q in range(inner):
                                            nt.store_nt(address, ro + u(q), buf[u(at + q * step)])
                        else:  # element by element, the owned slots only
                            for q in range(inv.shape[0]):
                                sq = slot[q]
                                if sq >= 0 and present[sq]:
                                    cache[base + u(q)] = buf[u(inv[q])]
                        present[:] = False
                        current = -1
                    t += 1
        if streaming:
            nt.fence()

    return write_paged


def _bits(x: np.ndarray) -> np.ndarray:
    """A stored array as the unsigned integers of its elements (no copy when contiguous)."""
    x = np.ascontiguousarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.itemsize])


class PreparedWrite:
    """One load's pieces checked and laid out for the kernel once (the constructor), then written
    into any group of layers (`__call__`): all layers in one call, one layer at a time (the
    layerwise and background loads), or disjoint layers on several threads at once
    (`write_threads.split_write`, from `cpu_pipeline`), without paying the set-up per call.

        ks[p], vs[p]:          [L, n_p, KVH, D] a fact's K / V as stored; its tokens ranges[p] = [a, b)
        k_scales[p], v_scales[p]: [L, KVH, D] float32 (quantised dtypes; else None)
        cos[r], sin[r]:        [n, ropes[r].rotary_dim // 2] at the n = sum(b - a) serving positions
        layer_rope[l]:         which of `ropes` layer l uses
        slots:                 [n] int64 cache slots of the n tokens, in piece order
        streaming:             full blocks go out in streaming (non-temporal) stores (default), or
                               in plain stores (the two write the same bits)
    """

    def __init__(self, ks: list[np.ndarray], vs: list[np.ndarray], ranges: list[tuple[int, int]],
                 k_scales: list[np.ndarray] | None, v_scales: list[np.ndarray] | None, kv_dtype: str,
                 cos: list[torch.Tensor], sin: list[torch.Tensor], ropes: list[RopeSpec], layer_rope: list[int],
                 slots: torch.Tensor, layout: PagedLayout, streaming: bool = True) -> None:
        if kv_dtype not in _KINDS:
            raise ValueError(f"the CPU kernels read float32, bfloat16, int8 or float8_e4m3 KV, not {kv_dtype!r}")
        _numba()
        from numba.typed import List

        self.layout = layout
        self.streaming = bool(streaming)
        self.n = n = sum(b - a for a, b in ranges)
        if slots.shape != (n,):
            raise ValueError(f"{n} tokens in the pieces but {tuple(slots.shape)} slots")
        heads, d = layout.heads, layout.head_dim
        if len(ranges) != len(ks) or len(vs) != len(ks):
            raise ValueError(f"{len(ks)} K pieces, {len(vs)} V pieces and {len(ranges)} token ranges")
        for p, (k, v, (a, b)) in enumerate(zip(ks, vs, ranges)):
            if k.ndim != 4 or k.shape[2:] != (heads, d) or v.shape != k.shape:
                raise ValueError(f"piece {p}: K {k.shape} and V {v.shape} are not both [L, n, {heads}, {d}]")
            if not 0 <= a <= b <= k.shape[1]:
                raise ValueError(f"piece {p}: token range [{a}, {b}) outside its {k.shape[1]} tokens")
        # the layers every piece holds (and layer_rope names a rope for)
        self.num_layers = min([k.shape[0] for k in ks] + [len(layer_rope)]) if ks else 0
        if not all(0 <= r < len(ropes) for r in layer_rope):
            raise ValueError(f"layer_rope {layer_rope} names a rope outside the {len(ropes)} given")
        kind = _KINDS[kv_dtype]
        scaled = kind in _QUANTIZED
        if scaled and (k_scales is None or v_scales is None):
            raise ValueError(f"{kv_dtype} KV needs its scales")
        if scaled and (len(k_scales) != len(ks) or len(v_scales) != len(ks) or any(
                np.shape(x)[0] < k.shape[0] or tuple(np.shape(x)[1:]) != (heads, d)
                for k, ks_, vs_ in zip(ks, k_scales, v_scales) for x in (ks_, vs_))):
            raise ValueError(f"scales must be [L, {heads}, {d}] per piece, one K and one V per piece")
        hmax = max(r.rotary_dim // 2 for r in ropes)
        cs = np.zeros((2, len(ropes), n, hmax), np.float32)
        for r, rope in enumerate(ropes):
            half = rope.rotary_dim // 2
            if cos[r].shape != (n, half) or sin[r].shape != (n, half):
                raise ValueError(f"cos/sin of RoPE {r} must be [{n}, {half}]")
            cs[0, r, :, :half], cs[1, r, :, :half] = cos[r].float().numpy(), sin[r].float().numpy()
        self.slots = slots.to(torch.int64).numpy()
        self._slot_range = (int(self.slots.min()), int(self.slots.max())) if n else (0, -1)
        dummy = [np.ones((1, 1, 1), np.float32)]
        self._pieces = (List(_bits(k) for k in ks), List(_bits(v) for v in vs),
                        np.asarray(ranges, np.int64).reshape(-1, 2),
                        List(np.ascontiguousarray(x, np.float32) for x in (k_scales if scaled else dummy)),
                        List(np.ascontiguousarray(x, np.float32) for x in (v_scales if scaled else dummy)),
                        scaled, kind, _table(kv_dtype) if kind == _TABLE else np.zeros(1, np.float32), cs[0], cs[1],
                        np.array([r.rotary_dim // 2 for r in ropes], np.int64),
                        np.array([r.style == "interleaved" for r in ropes]), np.asarray(layer_rope, np.int64))
        self._empty = not ks

    def __call__(self, layers: list[int], caches: list[torch.Tensor]) -> None:
        """Write layers `layers` into their caches (caches[j]: layer layers[j]'s, [num_blocks, ...]
        of the layout's dtype). Safe to call from another thread than the one that prepared it (the
        kernel releases the GIL)."""
        from numba.typed import List

        if len(caches) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(caches)} caches")
        if self._empty or not layers:
            return
        layout = self.layout
        per_block, bs = layout.inv.shape[0], layout.block_size
        for c in caches:
            if c.dtype != layout.dtype or c.dim() < 2 or c[0].numel() != per_block or not c.is_contiguous():
                raise ValueError(f"a cache of {tuple(c.shape)} {c.dtype} is not of the learned layout "
                                 f"({layout.dtype}, {per_block} elements per block)")
        # The kernel indexes without bounds checks: every index it will use is checked here.
        capacity = min(c.shape[0] for c in caches) * bs
        lo, hi = self._slot_range
        if self.n and (lo < 0 or hi >= capacity):
            raise ValueError(f"slots must lie in [0, {capacity}) (the caches' blocks x block_size), got [{lo}, {hi}]")
        if not all(0 <= layer < self.num_layers for layer in layers):
            raise ValueError(f"layers {layers} do not fit the pieces' (or layer_rope's) {self.num_layers} layers")
        elem = torch.int32 if layout.dtype == torch.float32 else torch.int16  # the cache's element bits
        flat = [_bits(c.view(elem).reshape(c.shape[0], -1).numpy()) for c in caches]  # [blocks, block elements]
        _kernels()(*self._pieces, np.asarray(layers, np.int64), List(flat), self.slots, bs, layout.flush_runs,
                   layout.inv, layout.slot, layout.where, layout.dtype == torch.bfloat16, self.streaming)


def write_paged(ks: list[np.ndarray], vs: list[np.ndarray], ranges: list[tuple[int, int]],
                k_scales: list[np.ndarray] | None, v_scales: list[np.ndarray] | None, kv_dtype: str,
                cos: list[torch.Tensor], sin: list[torch.Tensor], ropes: list[RopeSpec], layer_rope: list[int],
                layers: list[int], caches: list[torch.Tensor], slots: torch.Tensor, layout: PagedLayout,
                streaming: bool = True) -> None:
    """Write pieces of stored facts straight into paged caches of `layout` (from `learn_layout`):
    keys dequantised and rotated, values dequantised, rounded to the cache's dtype, in one pass
    (arguments as `PreparedWrite`'s; caches[j] is layer layers[j]'s)."""
    PreparedWrite(ks, vs, ranges, k_scales, v_scales, kv_dtype, cos, sin, ropes, layer_rope, slots,
                  layout, streaming)(layers, caches)


def warm_up() -> None:
    """Compile (or load from Numba's disk cache) the kernel for every stored dtype and both cache
    dtypes (a one-slot layout: K then V)."""
    rope = RopeSpec(theta=1e4, rotary_dim=2, style="split")
    one = torch.ones(1, 1)
    for cache_dtype in CACHE_DTYPES:
        layout = PagedLayout(cache_dtype, 1, 1, 2, np.arange(4, dtype=np.int64), np.zeros(4, np.int64))
        cache = torch.zeros(1, 4, dtype=cache_dtype)
        for kv_dtype in _KINDS:
            stored = np.zeros((1, 1, 1, 2), {"float32": np.uint32, "bfloat16": np.uint16}.get(kv_dtype, np.uint8))
            scales = [np.ones((1, 1, 2), np.float32)] if _KINDS[kv_dtype] in _QUANTIZED else None
            write_paged([stored], [stored], [(0, 1)], scales, scales, kv_dtype, [one], [one], [rope], [0], [0],
                        [cache], torch.zeros(1, dtype=torch.int64), layout)
