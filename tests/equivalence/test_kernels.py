"""Pallas kernels vs their jax.numpy references (and a plain numpy oracle), on fresh random inputs,
random slot maps and a poisoned cache: every target slot is written, every other slot untouched."""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from inferscale.common.model.rope_tables import apply_rope, cos_sin  # noqa: E402
from inferscale.common.model.spec import RopeSpec  # noqa: E402
from inferscale.common.storage.kvquant import dequantize, pair_partner, quantize  # noqa: E402
from inferscale.jax.inject import (  # noqa: E402
    inject_compact_pallas, inject_compact_reference, inject_pallas, inject_reference,
)
from inferscale.jax.paged_attention import paged_attention_pallas, paged_attention_reference  # noqa: E402

POISON = 7.0e4  # finite, so a wrongly attended slot shows up as a wrong value, not a NaN everywhere
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
ROPES = [RopeSpec(1e4, 32, "split"), RopeSpec(1e4, 32, "interleaved"), RopeSpec(1e5, 16, "split")]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.style}-{r.rotary_dim}")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_inject_kernel(seed, rope, dtype):
    rng = np.random.default_rng(seed)
    num_slots, kvh, d = 96, 2, 32
    n = int(rng.integers(1, 40))
    slots = rng.permutation(num_slots)[:n].astype(np.int32)
    slots[rng.random(n) < 0.15] = -1  # padding entries write nothing
    positions = rng.integers(0, 2000, n)
    k = rng.standard_normal((n, kvh, d)).astype(np.float32)
    v = rng.standard_normal((n, kvh, d)).astype(np.float32)
    cos, sin = cos_sin(rope, positions)
    poison = jnp.full((num_slots, kvh, d), POISON, dtype)
    args = (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(cos), jnp.asarray(sin), jnp.asarray(slots))
    kr, vr = inject_reference(poison, poison, *args, rope)
    kp, vp = jax.jit(lambda *a: inject_pallas(poison, poison, *a, rope, chunk=8))(*args)

    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(num_slots), written)
    want_k = apply_rope(np.asarray(args[0], np.float32), cos, sin, rope)  # numpy oracle
    for ref, got, want in ((kr, kp, want_k), (vr, vp, np.asarray(args[1], np.float32))):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(got, ref, **TOL[dtype])
        np.testing.assert_allclose(got[written], want[slots >= 0], **TOL[dtype])
        assert (got[untouched] == np.asarray(poison, np.float32)[untouched]).all()  # bit-for-bit untouched


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rope", ROPES, ids=lambda r: f"{r.style}-{r.rotary_dim}")
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("cache_dtype", [np.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_compact_inject_kernel(seed, rope, kv_dtype, cache_dtype):
    """Dequantise-rotate-write in one pass equals the float32 reference dequantisation (the store's),
    then rotation, then the write; tokens of three facts with their own scales, a poisoned cache."""
    import ml_dtypes

    rng = np.random.default_rng(10 + seed)
    num_slots, kvh, d = 96, 2, 32
    lengths = rng.integers(1, 14, 3)
    n = int(lengths.sum())
    token_fact = np.repeat(np.arange(3), lengths).astype(np.int32)
    partner = pair_partner(d, rope.rotary_dim, rope.style)
    codes, scales, want = {}, {}, {}
    for which in ("k", "v"):
        parts = [quantize(rng.standard_normal((1, m, kvh, d)).astype(np.float32) * rng.uniform(0.1, 5.0),
                          kv_dtype, partner if which == "k" else None) for m in lengths]
        codes[which] = np.concatenate([c[0] for c, _ in parts])  # [n, kvh, d]
        scales[which] = np.stack([sc[0] for _, sc in parts])  # [3, kvh, d]
        want[which] = np.concatenate([dequantize(c, sc, kv_dtype)[0] for c, sc in parts])
    to_jax = (lambda c: jnp.asarray(c)) if kv_dtype == "int8" else (lambda c: jnp.asarray(c.view(ml_dtypes.float8_e4m3fn)))
    slots = rng.permutation(num_slots)[:n].astype(np.int32)
    slots[rng.random(n) < 0.15] = -1
    cos, sin = cos_sin(rope, rng.integers(0, 2000, n))
    poison = jnp.full((num_slots, kvh, d), POISON, cache_dtype)
    args = (to_jax(codes["k"]), to_jax(codes["v"]), jnp.asarray(scales["k"]), jnp.asarray(scales["v"]),
            jnp.asarray(token_fact), jnp.asarray(cos), jnp.asarray(sin), jnp.asarray(slots))
    kr, vr = inject_compact_reference(poison, poison, *args, rope)
    kp, vp = jax.jit(lambda *a: inject_compact_pallas(poison, poison, *a, rope, chunk=8))(*args)
    written = slots[slots >= 0]
    untouched = np.setdiff1d(np.arange(num_slots), written)
    want_k = apply_rope(want["k"], cos, sin, rope)
    for ref, got, oracle in ((kr, kp, want_k), (vr, vp, want["v"])):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(got, ref, **TOL[cache_dtype])
        np.testing.assert_allclose(got[written], oracle[slots >= 0], **TOL[cache_dtype])
        assert (got[untouched] == np.float32(jnp.asarray(POISON, cache_dtype))).all()


def _numpy_attention(q, k, v, scale=None, window=None):
    """Causal attention of the last T of S positions (fp64 oracle). q [T,H,D], k/v [S,KVH,D];
    with a window, position p sees the `window` positions ending at p."""
    T, H, D = q.shape
    S, KVH, _ = k.shape
    scale = D ** -0.5 if scale is None else scale
    out = np.zeros((T, H, D))
    for t in range(T):
        p = S - T + t
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(H):
            s = k[lo: p + 1, h // (H // KVH)] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[lo: p + 1, h // (H // KVH)]
    return out


def _paged_sequence(rng, nb, bs, kvh, h, d, S, T, table_len, fill):
    """A sequence of S random K/V in shuffled cache blocks (every other slot `fill`: -fill for V),
    and T queries at its last positions: (table, k_cache, v_cache, k, v, q, q_positions)."""
    blocks = rng.permutation(np.arange(1, nb))[: -(-S // bs)]
    table = np.zeros(table_len, np.int32)
    table[: len(blocks)] = blocks
    kc = np.full((nb, bs, kvh, d), fill, np.float32)
    vc = np.full((nb, bs, kvh, d), -fill, np.float32)
    k = rng.standard_normal((S, kvh, d)).astype(np.float32)
    v = rng.standard_normal((S, kvh, d)).astype(np.float32)
    kc[blocks[np.arange(S) // bs], np.arange(S) % bs] = k
    vc[blocks[np.arange(S) // bs], np.arange(S) % bs] = v
    q = rng.standard_normal((T, h, d)).astype(np.float32)
    return table, kc, vc, k, v, q, np.arange(S - T, S, dtype=np.int32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 1, 13], ids=["full", "w1", "w13"])
def test_paged_attention_kernel(seed, dtype, window):
    """Full and sliding-window attention (a window cuts through blocks of 8), query scale 0.3."""
    rng = np.random.default_rng(100 + seed)
    nb, bs, kvh, h, d = 24, 8, 2, 6, 32
    S = int(rng.integers(5, 90))  # tokens in the sequence
    T = int(rng.integers(1, min(S, 12) + 1))  # the last T are the new queries
    table, kc, vc, k, v, q, qpos = _paged_sequence(rng, nb, bs, kvh, h, d, S, T, 12, POISON)
    args = [jnp.asarray(x, dtype) for x in (q, kc, vc)] + [jnp.asarray(table), jnp.asarray(qpos)]
    scale = 0.3 if window else None
    ref = np.asarray(paged_attention_reference(*args, scale=scale, window=window), np.float32)
    got = np.asarray(jax.jit(functools.partial(paged_attention_pallas, scale=scale, window=window))(*args),
                     np.float32)
    cast = lambda x: np.asarray(jnp.asarray(x, dtype), np.float64)
    want = _numpy_attention(cast(q), cast(k), cast(v), scale, window)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(got, ref, **tol)
    np.testing.assert_allclose(got, want, **tol)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mass", [1.0, 0.72, 1.3])
def test_ape_grouped_attention(seed, mass):
    """APE's grouped attention against a numpy reading of its definition (each group's softmax,
    merged with the memory group's log-sum-exp times `mass`); mass 1 is plain attention."""
    from inferscale.jax.paged_attention import paged_attention_grouped

    rng = np.random.default_rng(200 + seed)
    nb, bs, kvh, h, d, S, T = 12, 8, 2, 4, 16, 40, 5
    table, kc, vc, k, v, q, qpos = _paged_sequence(rng, nb, bs, kvh, h, d, S, T, 6, 0.0)
    memory = np.zeros(len(table) * bs, bool)
    memory[3:30] = True  # the facts: after a header, before the question
    got = np.asarray(paged_attention_grouped(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(table),
                                             jnp.asarray(qpos), jnp.asarray(memory), jnp.float32(mass), scale=0.3))
    want = np.zeros((T, h, d))
    for t in range(T):
        p = qpos[t]
        for hh in range(h):
            s = k[: p + 1, hh // (h // kvh)] @ q[t, hh] * 0.3
            mem = memory[: p + 1]
            lm, lo = np.logaddexp.reduce(s[mem]), np.logaddexp.reduce(s[~mem])
            logw = np.where(mem, s - lm + mass * lm, s)
            w = np.exp(logw - np.logaddexp(mass * lm, lo))
            want[t, hh] = w @ v[: p + 1, hh // (h // kvh)]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if mass == 1.0:
        plain = paged_attention_reference(jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(table),
                                          jnp.asarray(qpos), scale=0.3)
        np.testing.assert_allclose(got, np.asarray(plain), rtol=1e-5, atol=1e-5)
