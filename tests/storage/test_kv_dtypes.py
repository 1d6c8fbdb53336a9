"""Compact KV in the store: int8 and fp8 (e4m3) with per-channel scales (RoPE pairs share one),
their error bounds per element, lossless rewrites, and version-1 stores still opening."""

import json

import numpy as np
import pytest

from inferscale.common.storage.kvquant import dequantize, pair_partner, quantize
from inferscale.common.model.rope_tables import apply_rope, cos_sin
from inferscale.common.model.spec import RopeSpec
from inferscale.common.storage.format import FORMAT_VERSION, FactKV, StoreMeta
from inferscale.common.storage.local_store import Store

L, H, D = 3, 2, 8


def meta(dtype="float32", style="split", rotary_dim=D):
    return StoreMeta("a" * 64, L, H, D, {"theta": 1e4, "rotary_dim": rotary_dim, "style": style},
                     w=2).with_dtype(dtype)


def fact(i, n=5, rng=np.random.default_rng(0)):
    k = rng.standard_normal((L, n, H, D)).astype(np.float32) * rng.uniform(0.01, 30, (1, 1, H, D))
    return FactKV(f"f{i}", np.arange(n), k.astype(np.float32), (-0.5 * k).astype(np.float32))


def bound(x, dtype, scale):
    m = scale[:, None]  # the group's max |x| / code max
    if dtype == "int8":
        return m * 127 / 254 * (1 + 1e-6)
    return np.maximum(2.0 ** -4 * np.abs(x), m * 2.0 ** -10) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("style", ["split", "interleaved"])
def test_quantised_round_trip_within_its_bound_and_rewrites_are_lossless(tmp_path, dtype, style):
    st = Store.create(tmp_path / "s", meta(dtype, style))
    facts = [fact(i) for i in range(3)]
    st.put(facts)
    got = Store.open(tmp_path / "s", expect=meta(dtype, style)).get(["f0", "f1", "f2"])
    partner = pair_partner(D, D, style)
    for a, b in zip(facts, got):
        assert b.k.dtype == np.float32
        for x, y, p in ((a.k, b.k, partner), (a.v, b.v, None)):
            _, scale = quantize(x, dtype, p)
            assert (np.abs(x - y) <= bound(x, dtype, scale)).all()
    st.delete(["f1"])  # rewrites the shard f0 and f2 shared: from what was read, to the same codes
    again = Store.open(tmp_path / "s").get(["f0", "f2"])
    for a, b in zip((got[0], got[2]), again):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
    assert st.meta.kv_scale == "channel" and json.loads((tmp_path / "s" / "manifest.json").read_text())[
        "meta"]["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3"])
def test_compact_reads_hold_the_stored_bytes_and_dequantise_to_get(tmp_path, dtype):
    """`get_compact` hands out the stored layout (codes at 1 byte, scales beside them) and its
    reference dequantisation is exactly what `get` returns."""
    st = Store.create(tmp_path / "s", meta(dtype))
    st.put([fact(i) for i in range(2)])
    compact, full = st.get_compact(["f1", "f0"]), st.get(["f1", "f0"])
    for c, f in zip(compact, full):
        assert c.fact_id == f.fact_id and c.dtype == dtype
        np.testing.assert_array_equal(c.token_ids, f.token_ids)
        d = c.dequantized()
        np.testing.assert_array_equal(np.asarray(d.k, np.float32), np.asarray(f.k, np.float32))
        np.testing.assert_array_equal(np.asarray(d.v, np.float32), np.asarray(f.v, np.float32))
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
        assert c.k.itemsize == itemsize and (c.k_scale is not None) == (dtype in ("int8", "float8_e4m3"))
        scales = 2 * L * H * D * 4 if c.k_scale is not None else 0
        assert c.nbytes == 2 * L * c.num_tokens * H * D * itemsize + scales


@pytest.mark.parametrize("style,rotary_dim", [("split", 8), ("split", 6), ("interleaved", 8)])
def test_rope_pairs_share_a_scale_so_rotation_commutes_with_dequantisation(style, rotary_dim):
    x = fact(0).k
    partner = pair_partner(D, rotary_dim, style)
    assert (partner[partner] == np.arange(D)).all() and (partner[rotary_dim:] == np.arange(rotary_dim, D)).all()
    codes, scale = quantize(x, "int8", partner)
    np.testing.assert_array_equal(scale, scale[..., partner])
    rope = RopeSpec(theta=1e4, rotary_dim=rotary_dim, style=style)
    cos, sin = cos_sin(rope, np.arange(40, 45))
    a = apply_rope(dequantize(codes, scale, "int8"), cos, sin, rope)  # dequantise, then rotate
    b = apply_rope(codes.astype(np.float32), cos, sin, rope) * scale[:, None]  # rotate the codes, scale after
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_a_version_1_store_still_opens_and_takes_new_facts(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    st.put([fact(0)])
    mf = tmp_path / "s" / "manifest.json"
    m = json.loads(mf.read_text())
    m["meta"]["format_version"] = 1  # a store written before compact KV existed
    mf.write_text(json.dumps(m))
    old = Store.open(tmp_path / "s", expect=meta())
    assert old.meta.format_version == 1 < FORMAT_VERSION
    old.put([fact(1)])
    assert [f.fact_id for f in Store.open(tmp_path / "s").get(["f0", "f1"])] == ["f0", "f1"]


def test_scale_schemes_follow_the_dtype():
    assert meta("bfloat16").kv_scale == "none" and meta("int8").kv_scale == "channel"
    with pytest.raises(ValueError, match="needs kv_scale 'channel'"):
        StoreMeta("a" * 64, L, H, D, {"theta": 1e4, "rotary_dim": D, "style": "split"}, dtype="int8")
    with pytest.raises(ValueError, match="store dtype must be one of"):
        meta("int4")
