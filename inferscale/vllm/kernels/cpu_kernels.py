"""CPU kernels (Numba) for the connector's work: stored K dequantised and rotated to its serving
positions in one pass over the keys, stored V dequantised, both into float32 (`dequantize_rotate_cpu`,
`dequantize_cpu`: one layer of a joined load). `paged_write.py` does the same for every layer of a
load straight into vLLM's CPU paged cache, with the element decoding defined here.

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

from inferscale.common.model.spec import RopeSpec

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

    return dequantize_rotate, dequantize


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
    kernel, _ = _kernels()
    kernel(arr, kind, lut, scaled, sc, tf, cos.float().contiguous().numpy(), sin.float().contiguous().numpy(),
           half, rope.style == "interleaved", out.numpy())
    return out


def dequantize_cpu(x: torch.Tensor, scale: torch.Tensor | None, token_fact: torch.Tensor | None,
                   kv_dtype: str) -> torch.Tensor:
    """Stored values -> float32 [n, KVH, D] (codes times their fact's scales)."""
    arr, kind, lut, scaled, sc, tf = _operands(x, kv_dtype, scale, token_fact)
    out = torch.empty(arr.shape, dtype=torch.float32)
    _, kernel = _kernels()
    values = out.numpy()
    kernel(arr, kind, lut, scaled, sc, tf, values, values.view(np.uint32))
    return out


def warm_up() -> None:
    """Compile (or load from Numba's disk cache) every kernel for every stored dtype."""
    rope = RopeSpec(theta=1e4, rotary_dim=2, style="split")
    one = torch.ones(1, 1)
    for kv_dtype in _KINDS:
        x = torch.zeros(1, 1, 2, dtype=_STORED.get(kv_dtype, torch.uint8))
        scale, fact = (torch.ones(1, 1, 2), torch.zeros(1, dtype=torch.int64)) if _KINDS[kv_dtype] in _QUANTIZED else (None, None)
        dequantize_rotate_cpu(x, scale, fact, one, one, rope, kv_dtype)
        dequantize_cpu(x, scale, fact, kv_dtype)
