"""CPU kernels (Numba) for the connector's work: stored K dequantised and rotated to its serving
positions in one pass over the keys, stored V dequantised, both into float32 (`dequantize_rotate_cpu`,
`dequantize_cpu`: one layer of a joined load); and `write_paged`, the same for every layer of a
load straight from the facts as stored into vLLM's CPU paged cache (`PAGED_LAYOUT`, which
`paged_layout_matches` checks against the attention backend's own write).

    x:          [n, KVH, D]   as stored: float32, bfloat16 (read as its uint16 bits), int8, or
                              float8_e4m3 codes (uint8 bytes)
    scale:      [F, KVH, D]   float32 per-channel scales of the load's F facts (quantised only)
    token_fact: [n] int64     each token's fact (its row of `scale`)
    cos, sin:   [n, r // 2]   float32 at the serving positions
    -> out      [n, KVH, D]   float32

Each element is widened, scaled, and (keys) rotated in registers and written once: no float copy
of the stored keys is made on the way, which is what makes torch's version (`rope.rotate_torch`:
several passes, each writing a full float32 tensor) slow on one core. The references are
`rope.rotate_reference` / `rope.dequantize_rotate_reference` / `rope.dequantize_reference` (the
same float32 operations in the same order): the results are bit-equal to them
(`tests/vllm/test_compact_layers.py`, and `tests/vllm/test_paged_write.py` through the cache).

Numba is a dependency of vLLM's CPU build; without it `available()` is False and the connector
uses the torch fast path. Kernels compile on first use (cached on disk by Numba).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from inferscale.common.spec import RopeSpec

# How a stored element becomes float32. Every dtype arrives as unsigned bits so one compiled
# kernel per element width types all four ways: float32 bits viewed as float, bfloat16 bits shifted
# into the upper half of a float32, e4m3 bytes looked up in a 256-entry table of values, int8 bytes
# reinterpreted as signed and converted (exact, as the table would give; it vectorises, a lookup
# does not). Quantised kinds (e4m3, int8) carry scales.
_FLOAT, _BF16, _TABLE, _INT8 = 0, 1, 2, 3
_KINDS = {"float32": _FLOAT, "bfloat16": _BF16, "int8": _INT8, "float8_e4m3": _TABLE}
_QUANTIZED = (_TABLE, _INT8)
_STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # e4m3: uint8 bytes
_BITS = {"float32": torch.int32, "bfloat16": torch.int16, "int8": torch.uint8, "float8_e4m3": torch.uint8}


@functools.cache
def available() -> bool:
    """Whether Numba imports (then the kernels below can run)."""
    try:
        _numba()
    except ImportError:
        return False
    return True


def _numba():
    import numba
    from llvmlite.binding import ffi

    # vLLM 0.32's CPU platform, at every worker start, calls `vars(x).get(...)` on each module
    # attribute that has a `__dict__` (`vllm.triton_utils.dispatcher._rebind_kernels`). llvmlite's
    # `ffi.lib` wraps whatever attribute is asked of it, `__dict__` included, so in a process that
    # imported Numba before, the next engine fails to start. An empty `__dict__` entry in its
    # function table answers that scan (llvmlite looks functions up by their names only).
    table = getattr(ffi.lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})
    return numba


def supports(kv_dtype: str) -> bool:
    """Whether the kernels read this stored dtype (float16 keys take the torch path)."""
    return kv_dtype in _KINDS and available()


@functools.cache
def _kernels():
    numba = _numba()

    jit = numba.njit(cache=True, fastmath=False, nogil=True, boundscheck=False)

    # The row decode is written out in both kernels: a helper taking arrays costs reference
    # counting per call (measured 3x slower), and each branch stays a plain loop over the channels.
    @jit
    def dequantize_rotate(x, kind, lut, scaled, scale, token_fact, cos, sin, half, interleaved, out):
        n, heads, d = x.shape
        bits = np.empty(d, np.uint32)  # one token and head, as float32 `row`
        row = bits.view(np.float32)
        for t in range(n):
            f = token_fact[t] if scaled else 0
            for h in range(heads):
                if kind == _BF16:
                    for i in range(d):
                        bits[i] = np.uint32(x[t, h, i]) << np.uint32(16)
                elif kind == _INT8:
                    for i in range(d):
                        row[i] = np.float32(np.int8(x[t, h, i]))
                elif kind == _TABLE:
                    for i in range(d):
                        row[i] = lut[x[t, h, i]]
                else:
                    for i in range(d):
                        bits[i] = x[t, h, i]
                if scaled:  # a RoPE pair shares its scale
                    for i in range(d):
                        row[i] *= scale[f, h, i]
                if interleaved:  # pairs (2i, 2i + 1)
                    for i in range(half):
                        a, b, c, s = row[2 * i], row[2 * i + 1], cos[t, i], sin[t, i]
                        out[t, h, 2 * i] = a * c - b * s
                        out[t, h, 2 * i + 1] = b * c + a * s
                else:  # pairs (i, i + half)
                    for i in range(half):
                        a, b, c, s = row[i], row[i + half], cos[t, i], sin[t, i]
                        out[t, h, i] = a * c - b * s
                        out[t, h, i + half] = b * c + a * s
                for i in range(2 * half, d):  # channels past rotary_dim pass through
                    out[t, h, i] = row[i]
        return out

    @jit
    def dequantize(x, kind, lut, scaled, scale, token_fact, out, bits):
        """`bits` is `out` viewed as uint32."""
        n, heads, d = x.shape
        for t in range(n):
            f = token_fact[t] if scaled else 0
            for h in range(heads):
                if kind == _BF16:
                    for i in range(d):
                        bits[t, h, i] = np.uint32(x[t, h, i]) << np.uint32(16)
                elif kind == _INT8:
                    for i in range(d):
                        out[t, h, i] = np.float32(np.int8(x[t, h, i]))
                elif kind == _TABLE:
                    for i in range(d):
                        out[t, h, i] = lut[x[t, h, i]]
                else:
                    for i in range(d):
                        bits[t, h, i] = x[t, h, i]
                if scaled:
                    for i in range(d):
                        out[t, h, i] *= scale[f, h, i]
        return out

    @jit
    def write_paged(ks, vs, ranges, k_scales, v_scales, scaled, kind, lut, cos, sin, halves, interleaved,
                    layer_rope, layer_ids, caches, slots, bs):
        """Every listed layer of every piece, dequantised, rotated and written into its cache's
        slots (the layout of `PAGED_LAYOUT`); reads each stored element once. Per layer, rotated
        keys go to a scratch [n, KVH, D] first and then into the channel-major K region a run of
        consecutive slots at a time, so those stores are contiguous too. Arrays are indexed flat
        with unsigned offsets: signed indices cost a negative-index check per element (2x slower)."""
        u = np.uint64
        heads, d = ks[0].shape[2], ks[0].shape[3]
        n, hmax = slots.shape[0], cos.shape[2]
        hd, ud, ubs, uhmax = u(heads * d), u(d), u(bs), u(hmax)
        per_head = u(2 * bs * d)  # one (block, head) of a cache: K [D, bs] then V [bs, D]
        per_block = u(heads) * per_head
        bits = np.empty(d, np.uint32)
        row = bits.view(np.float32)
        rot = np.empty(n * heads * d, np.float32)  # [n, KVH, D] rotated keys of one layer
        for j in range(len(layer_ids)):
            layer, cache = layer_ids[j], caches[j].reshape(-1)
            r = layer_rope[layer]
            half, inter = halves[r], interleaved[r]
            uhalf = u(half)
            cr, sr = cos[r].reshape(-1), sin[r].reshape(-1)  # [n, hmax]
            t = 0
            for p in range(len(ks)):
                # (taken out of the lists once per piece: each take is counted)
                k, v = ks[p][layer].reshape(-1), vs[p][layer].reshape(-1)  # [n_p, KVH, D]
                if scaled:
                    ksc, vsc = k_scales[p][layer].reshape(-1), v_scales[p][layer].reshape(-1)  # [KVH, D]
                else:
                    ksc, vsc = k_scales[0].reshape(-1), v_scales[0].reshape(-1)
                for i in range(ranges[p, 0], ranges[p, 1]):
                    ut = u(t)
                    blk, s_ = u(slots[t] // bs), u(slots[t] % bs)
                    cs = ut * uhmax
                    for h in range(heads):
                        src, out, sc = u(i) * hd + u(h) * ud, ut * hd + u(h) * ud, u(h) * ud
                        # K: decoded and scaled into `row`, rotated into `rot` (K and V each write
                        # the decode out: a helper taking arrays would cost reference counting)
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
                                row[c] *= ksc[sc + u(c)]
                        if inter:  # pairs (2c, 2c + 1)
                            for c in range(half):
                                a, b, co, si = row[2 * c], row[2 * c + 1], cr[cs + u(c)], sr[cs + u(c)]
                                rot[out + u(2 * c)] = a * co - b * si
                                rot[out + u(2 * c + 1)] = b * co + a * si
                        else:  # pairs (c, c + half)
                            for c in range(half):
                                a, b, co, si = row[c], row[c + half], cr[cs + u(c)], sr[cs + u(c)]
                                rot[out + u(c)] = a * co - b * si
                                rot[out + u(c) + uhalf] = b * co + a * si
                        for c in range(2 * half, d):
                            rot[out + u(c)] = row[c]
                        # V: decoded and scaled into `row`, copied into the token-major V region
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
                                row[c] *= vsc[sc + u(c)]
                        base = blk * per_block + u(h) * per_head + ubs * ud + s_ * ud
                        for c in range(d):
                            cache[base + u(c)] = row[c]
                    t += 1
            t = 0
            while t < n:  # K: runs of consecutive slots in one block, channel by channel
                blk, s0 = slots[t] // bs, slots[t] % bs
                m = 1
                while t + m < n and slots[t + m] == slots[t] + m and s0 + m < bs:
                    m += 1
                for h in range(heads):
                    dst, src = u(blk) * per_block + u(h) * per_head + u(s0), u(t) * hd + u(h) * ud
                    for c in range(d):
                        o, i = dst + u(c) * ubs, src + u(c)
                        for q in range(m):
                            cache[o + u(q)] = rot[i + u(q) * hd]
                t += m

    return dequantize_rotate, dequantize, write_paged


@functools.cache
def _table(kv_dtype: str) -> np.ndarray:
    """[256] float32: the value of each int8 / e4m3 byte."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.int8) if kv_dtype == "int8" else codes.view(torch.float8_e4m3fn)
    return values.float().numpy()


def _operands(x: torch.Tensor, kv_dtype: str, scale, token_fact):
    if kv_dtype not in _KINDS:
        raise ValueError(f"the CPU kernels read float32, bfloat16, int8 or float8_e4m3 KV, not {kv_dtype!r}")
    if x.device.type != "cpu" or x.dim() != 3:
        raise ValueError(f"expected a CPU tensor [n, kv_heads, head_dim], got {tuple(x.shape)} on {x.device}")
    stored = _STORED.get(kv_dtype, torch.uint8)
    if x.dtype != stored:
        raise ValueError(f"{kv_dtype} KV arrives as {x.dtype}, not as its stored element type {stored}")
    kind = _KINDS[kv_dtype]
    bits = x.contiguous().view(_BITS[kv_dtype]).numpy()
    arr = bits.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[bits.itemsize])
    scaled = kind in _QUANTIZED
    if scaled and (scale is None or token_fact is None):
        raise ValueError(f"{kv_dtype} KV needs its scales and each token's fact")
    if scaled:
        sc = scale.float().contiguous().numpy()
        tf = token_fact.to(torch.int64).contiguous().numpy()
    else:
        sc, tf = np.ones((1, 1, 1), np.float32), np.zeros(0, np.int64)
    lut = _table(kv_dtype) if kind == _TABLE else np.zeros(1, np.float32)
    return arr, kind, lut, scaled, sc, tf


def dequantize_rotate_cpu(x: torch.Tensor, scale: torch.Tensor | None, token_fact: torch.Tensor | None,
                          cos: torch.Tensor, sin: torch.Tensor, rope: RopeSpec, kv_dtype: str) -> torch.Tensor:
    """Stored keys -> keys rotated at the positions of `cos`/`sin`, float32 [n, KVH, D]."""
    arr, kind, lut, scaled, sc, tf = _operands(x, kv_dtype, scale, token_fact)
    n, heads, d = arr.shape
    half = rope.rotary_dim // 2
    if cos.shape != (n, half) or sin.shape != (n, half):
        raise ValueError(f"cos/sin must be [{n}, {half}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    out = torch.empty((n, heads, d), dtype=torch.float32)
    kernel, _, _ = _kernels()
    kernel(arr, kind, lut, scaled, sc, tf, cos.float().contiguous().numpy(), sin.float().contiguous().numpy(),
           half, rope.style == "interleaved", out.numpy())
    return out


def dequantize_cpu(x: torch.Tensor, scale: torch.Tensor | None, token_fact: torch.Tensor | None,
                   kv_dtype: str) -> torch.Tensor:
    """Stored values -> float32 [n, KVH, D] (codes times their fact's scales)."""
    arr, kind, lut, scaled, sc, tf = _operands(x, kv_dtype, scale, token_fact)
    out = torch.empty(arr.shape, dtype=torch.float32)
    _, kernel, _ = _kernels()
    values = out.numpy()
    kernel(arr, kind, lut, scaled, sc, tf, values, values.view(np.uint32))
    return out


PAGED_LAYOUT = ("one float32 tensor per layer, [num_blocks, kv_heads, block_size, 2 * head_dim]; inside one "
                "(block, head) K channel-major [head_dim, block_size], then V token-major [block_size, head_dim]")


def _bits(x: np.ndarray) -> np.ndarray:
    """A stored array as the unsigned integers of its elements (no copy when contiguous)."""
    x = np.ascontiguousarray(x)
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.itemsize])


def write_paged(ks: list[np.ndarray], vs: list[np.ndarray], ranges: list[tuple[int, int]],
                k_scales: list[np.ndarray] | None, v_scales: list[np.ndarray] | None, kv_dtype: str,
                cos: list[torch.Tensor], sin: list[torch.Tensor], ropes: list[RopeSpec], layer_rope: list[int],
                layers: list[int], caches: list[torch.Tensor], slots: torch.Tensor, block_size: int) -> None:
    """Write pieces of stored facts straight into paged caches of `PAGED_LAYOUT`: keys dequantised
    and rotated, values dequantised, in one pass, with no gathered or float copy in between.

        ks[p], vs[p]:          [L, n_p, KVH, D] a fact's K / V as stored; its tokens ranges[p] = [a, b)
        k_scales[p], v_scales[p]: [L, KVH, D] float32 (quantised dtypes; else None)
        cos[r], sin[r]:        [n, ropes[r].rotary_dim // 2] at the n = sum(b - a) serving positions
        layer_rope[l]:         which of `ropes` layer l uses
        caches[j]:             layer layers[j]'s cache, float32 [num_blocks, KVH, block_size, 2 * D]
        slots:                 [n] int64 cache slots of the n tokens, in piece order
    """
    if kv_dtype not in _KINDS:
        raise ValueError(f"the CPU kernels read float32, bfloat16, int8 or float8_e4m3 KV, not {kv_dtype!r}")
    if len(caches) != len(layers):
        raise ValueError(f"{len(layers)} layers but {len(caches)} caches")
    _numba()
    from numba.typed import List

    if not ks or not layers:
        return
    n = sum(b - a for a, b in ranges)
    if slots.shape != (n,):
        raise ValueError(f"{n} tokens in the pieces but {tuple(slots.shape)} slots")
    heads, d = ks[0].shape[2], ks[0].shape[3]
    for c in caches:
        if c.dtype != torch.float32 or c.dim() != 4 or c.shape[1] != heads or c.shape[2] != block_size \
                or c.shape[3] != 2 * d or not c.is_contiguous():
            raise ValueError(f"a cache of {tuple(c.shape)} {c.dtype} is not of the layout {PAGED_LAYOUT}")
    # The kernel indexes without bounds checks: every index it will use is checked here.
    capacity = min(c.shape[0] for c in caches) * block_size
    if n and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"slots must lie in [0, {capacity}) (the caches' blocks x block_size), "
                         f"got [{int(slots.min())}, {int(slots.max())}]")
    if len(ranges) != len(ks) or len(vs) != len(ks):
        raise ValueError(f"{len(ks)} K pieces, {len(vs)} V pieces and {len(ranges)} token ranges")
    for p, (k, v, (a, b)) in enumerate(zip(ks, vs, ranges)):
        if k.ndim != 4 or k.shape[2:] != (heads, d) or v.shape != k.shape:
            raise ValueError(f"piece {p}: K {k.shape} and V {v.shape} are not both [L, n, {heads}, {d}]")
        if not 0 <= a <= b <= k.shape[1]:
            raise ValueError(f"piece {p}: token range [{a}, {b}) outside its {k.shape[1]} tokens")
        if not all(0 <= layer < k.shape[0] for layer in layers) or len(layer_rope) < k.shape[0]:
            raise ValueError(f"piece {p}: layers {layers} or layer_rope ({len(layer_rope)}) do not fit its "
                             f"{k.shape[0]} layers")
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
    dummy = [np.ones((1, 1, 1), np.float32)]
    flat = [c.view(c.shape[0], heads, -1).numpy() for c in caches]  # [blocks, KVH, 2 * block_size * D]
    _, _, kernel = _kernels()
    kernel(List(_bits(k) for k in ks), List(_bits(v) for v in vs), np.asarray(ranges, np.int64).reshape(-1, 2),
           List(np.ascontiguousarray(x, np.float32) for x in (k_scales if scaled else dummy)),
           List(np.ascontiguousarray(x, np.float32) for x in (v_scales if scaled else dummy)),
           scaled, kind, _table(kv_dtype) if kind == _TABLE else np.zeros(1, np.float32), cs[0], cs[1],
           np.array([r.rotary_dim // 2 for r in ropes], np.int64), np.array([r.style == "interleaved" for r in ropes]),
           np.asarray(layer_rope, np.int64), np.asarray(layers, np.int64),
           List(flat), slots.to(torch.int64).numpy(), block_size)


def paged_layout_matches(write, like: torch.Tensor, block_size: int) -> bool:
    """Whether `write(k, v, cache, slots)` (an attention backend's own cache write) lays a cache
    shaped like `like` out as `PAGED_LAYOUT`: both write the same random K/V into two fresh
    two-block caches, over both blocks and out of order; True only if the caches are equal (False
    too if the backend's write refuses the scratch cache)."""
    if like.dtype != torch.float32 or like.dim() != 4 or like.shape[2] != block_size or like.shape[3] % 2:
        return False
    heads, d = like.shape[1], like.shape[3] // 2
    n = block_size + 3
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)
    slots = torch.randperm(2 * block_size, generator=g)[:n] + block_size  # blocks 1 and 2
    theirs, ours = (torch.zeros((3, heads, block_size, 2 * d)) for _ in range(2))
    try:
        write(k, v, theirs, slots)
    except Exception:  # noqa: BLE001 - a backend that cannot write a scratch cache keeps its own write
        return False
    rope = RopeSpec(theta=1e4, rotary_dim=d, style="split")
    one, zero = torch.ones(n, d // 2), torch.zeros(n, d // 2)  # a rotation by 0: the keys unchanged
    write_paged([k.numpy()[None]], [v.numpy()[None]], [(0, n)], None, None, "float32", [one], [zero], [rope],
                [0], [0], [ours], slots, block_size)
    return torch.equal(theirs, ours)


def warm_up() -> None:
    """Compile (or load from Numba's disk cache) every kernel for every stored dtype."""
    rope = RopeSpec(theta=1e4, rotary_dim=2, style="split")
    one = torch.ones(1, 1)
    cache = torch.zeros(1, 1, 1, 4)  # one block of one slot, head_dim 2
    for kv_dtype in _KINDS:
        x = torch.zeros(1, 1, 2, dtype=_STORED.get(kv_dtype, torch.uint8))
        scale, fact = (torch.ones(1, 1, 2), torch.zeros(1, dtype=torch.int64)) if _KINDS[kv_dtype] in _QUANTIZED else (None, None)
        dequantize_rotate_cpu(x, scale, fact, one, one, rope, kv_dtype)
        dequantize_cpu(x, scale, fact, kv_dtype)
        stored = x.view(_BITS[kv_dtype]).numpy()[None]  # [L=1, n=1, KVH=1, D=2], as the bits the kernel reads
        scales = [np.ones((1, 1, 2), np.float32)] if scale is not None else None
        write_paged([stored], [stored], [(0, 1)], scales, scales, kv_dtype, [one], [one], [rope], [0], [0], [cache],
                    torch.zeros(1, dtype=torch.int64), 1)
