"""Store format v2 (and v1 stores): exact round trips, refusals, and what a crash can leave behind."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from inferscale.common.storage.format import ChecksumError, FactKV, FormatVersionError, ModelMismatchError, StoreMeta, UnknownFactError

from inferscale.common.storage.local_store import ManifestCache, Store

L, H, D = 3, 2, 8


def meta(**kw):
    base = dict(model_fingerprint="a" * 64, num_layers=L, num_kv_heads=H, head_dim=D,
                rope={"theta": 1e4, "rotary_dim": D, "style": "split"}, w=5)
    return StoreMeta(**{**base, **kw})


def fact(i, n=None, rng=np.random.default_rng(0)):
    n = n or 3 + i
    k = rng.standard_normal((L, n, H, D)).astype(np.float32)
    return FactKV(f"f{i}", rng.integers(0, 1000, n), k, -k * 1.5, text=f"fact {i}",
                  embedding=rng.standard_normal(16).astype(np.float32), source_turn=f"D1:{i}", meta={"i": i})


def test_round_trip_is_bit_exact(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    facts = [fact(i) for i in range(5)]
    st.put(facts[:3])
    st.put(facts[3:])
    st2 = Store.open(tmp_path / "s", expect=meta())
    assert len(st2) == 5
    for a, b in zip(facts[::-1], st2.get([f.fact_id for f in facts[::-1]])):
        assert a.fact_id == b.fact_id and a.text == b.text and a.meta == b.meta and a.source_turn == b.source_turn
        for x in ("token_ids", "k", "v", "embedding"):
            np.testing.assert_array_equal(getattr(a, x), getattr(b, x))
            assert getattr(a, x).dtype == getattr(b, x).dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_stores_round_trip(tmp_path, dtype):
    import ml_dtypes

    st = Store.create(tmp_path / "s", meta(dtype=dtype))
    f = fact(0)
    st.put([f])
    got = Store.open(tmp_path / "s").get(["f0"])[0]
    want = f.k.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    np.testing.assert_array_equal(got.k, want)
    again = Store.create(tmp_path / "t", meta(dtype=dtype))
    again.put([got])  # re-writing what was read is lossless
    np.testing.assert_array_equal(Store.open(tmp_path / "t").get(["f0"])[0].k, want)


def test_refuses_another_model(tmp_path):
    Store.create(tmp_path / "s", meta()).put([fact(0)])
    with pytest.raises(ModelMismatchError, match="another model"):
        Store.open(tmp_path / "s", expect=meta(model_fingerprint="b" * 64))
    with pytest.raises(ModelMismatchError, match="rope"):
        Store.open(tmp_path / "s", expect=meta(rope={"theta": 1e4, "rotary_dim": D, "style": "interleaved"}))
    with pytest.raises(ModelMismatchError, match="w is 5, expected 0"):
        Store.open(tmp_path / "s", expect=meta(w=0))


def test_refuses_another_format_version(tmp_path):
    Store.create(tmp_path / "s", meta()).put([fact(0)])
    mf = tmp_path / "s" / "manifest.json"
    m = json.loads(mf.read_text())
    m["meta"]["format_version"] = 99
    mf.write_text(json.dumps(m))
    with pytest.raises(FormatVersionError, match="99"):
        Store.open(tmp_path / "s")


def test_refuses_a_corrupted_shard_and_names_it(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    (name,) = st.put([fact(0), fact(1)])
    shard = tmp_path / "s" / "shards" / name
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=name):
        Store.open(tmp_path / "s").get(["f1"])
    shard.unlink()
    with pytest.raises(ChecksumError, match="missing"):
        Store.open(tmp_path / "s").get(["f0"])


def test_replace_and_delete_leave_no_bytes_of_the_old_fact(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    f0, f1, f2 = fact(0), fact(1), fact(2)
    (first,) = st.put([f0, f1, f2])
    st.put([fact(0, n=9)])  # replacing f0 rewrites the shard it shared with f1 and f2
    assert st.get(["f0"])[0].num_tokens == 9
    assert not (tmp_path / "s" / "shards" / first).exists()
    st.delete(["f1"])  # deleting f1 rewrites the shard it shares with f2
    blob = b"".join(p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file())
    for gone in (f0, f1):  # the old f0 and the deleted f1: no K, V or token bytes anywhere
        assert gone.k.tobytes()[:64] not in blob and gone.v.tobytes()[:64] not in blob
    assert f1.token_ids.astype(np.int32).tobytes() not in blob and b"fact 1" not in blob
    (got,) = Store.open(tmp_path / "s").get(["f2"])  # the survivor is bit-for-bit what was put
    assert np.array_equal(got.k, f2.k) and np.array_equal(got.v, f2.v) and got.text == "fact 2"
    with pytest.raises(UnknownFactError, match="f1"):
        st.get(["f1"])
    with pytest.raises(UnknownFactError):
        st.delete(["nope"])


def test_shards_hold_a_bounded_number_of_facts(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    n = Store.MAX_FACTS_PER_SHARD * 2 + 1
    names = st.put([fact(i, n=2) for i in range(n)])
    assert len(names) == 3 and len(st) == n
    assert max(len(s["facts"]) for s in st._manifest["shards"].values()) == Store.MAX_FACTS_PER_SHARD


def test_bad_input(tmp_path):
    st = Store.create(tmp_path / "s", meta())
    with pytest.raises(ValueError, match="KV shape"):
        st.put([FactKV("x", [1, 2], np.zeros((L + 1, 2, H, D)), np.zeros((L + 1, 2, H, D)))])
    with pytest.raises(ValueError, match="non-empty"):
        FactKV("x", [], np.zeros((L, 0, H, D)), np.zeros((L, 0, H, D)))
    with pytest.raises(ValueError, match="dtype"):
        meta(dtype="int3")
    with pytest.raises(FileExistsError):
        Store.create(tmp_path / "s", meta())
    with pytest.raises(FileNotFoundError, match="no InferScale store"):
        Store.open(tmp_path / "nothing")


def test_a_killed_writer_loses_only_the_write_in_flight(tmp_path):
    """SIGKILL a writer mid-stream: what it committed reads back and verifies, nothing else shows."""
    path = tmp_path / "s"
    Store.create(path, meta())
    script = f"""
import numpy as np, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_store import fact
from inferscale.common.storage.local_store import Store
st = Store.open({str(path)!r})
for i in range(100000):
    st.put([fact(i % 50)])
    print(i, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    committed = -1
    for line in proc.stdout:
        committed = int(line)
        if committed >= 30:
            break
    proc.kill()
    proc.wait()
    st = Store.open(path, expect=meta())
    assert len(st) >= min(committed + 1, 50)
    for f in st.get(st.fact_ids()):  # every shard named by the manifest verifies
        assert f.k.shape[1] == f.num_tokens
    live = {st.info(f)["shard"] for f in st.fact_ids()}
    on_disk = {p.name for p in (path / "shards").glob("*.safetensors")}
    assert live <= on_disk


def test_check_model_accepts_any_dtype_and_w_of_the_same_model():
    from inferscale.common.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config({"model_type": "llama", "vocab_size": 10, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                                     "num_key_value_heads": 2})
    m = StoreMeta.for_model(spec, "f" * 64, dtype="bfloat16", w=5)
    m.check_model(spec, "f" * 64)
    with pytest.raises(ModelMismatchError, match="another model"):
        m.check_model(spec, "e" * 64)
    other = ModelSpec.from_dict({**spec.to_dict(), "num_kv_heads": 4})
    with pytest.raises(ModelMismatchError, match="KV shape or RoPE"):
        m.check_model(other, "f" * 64)


def test_per_layer_attention_settings_are_part_of_the_meta(tmp_path):
    """A Gemma 3 store records each layer's RoPE and window; a store of other layer settings is
    refused by name, and the meta survives the manifest's JSON round trip."""
    from dataclasses import replace

    from inferscale.common.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config({"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 16,
                                     "intermediate_size": 32, "num_hidden_layers": L, "num_attention_heads": 4,
                                     "num_key_value_heads": H, "head_dim": D, "sliding_window": 64,
                                     "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})
    m = StoreMeta.for_model(spec, "a" * 64, w=5)
    assert [x["window"] for x in m.layers] == [64, 64, None]
    assert [x["rope"]["theta"] for x in m.layers] == [1e4, 1e4, 1e6]
    Store.create(tmp_path / "s", m).put([fact(0)])
    assert Store.open(tmp_path / "s", expect=m).meta == m
    m.check_model(spec, "a" * 64)
    wider = replace(m, layers=[dict(x, window=128 if x["window"] else None) for x in m.layers])
    with pytest.raises(ModelMismatchError, match="store layers is"):
        Store.open(tmp_path / "s", expect=wider)
    assert meta().layers is None  # families whose layers all match `rope` record nothing more


def test_manifest_cache_reparses_only_a_changed_manifest(tmp_path, monkeypatch):
    path = tmp_path / "s"
    writer = Store.create(path, meta())
    writer.put([fact(0)])
    cache = ManifestCache(capacity=2)
    parsed = []
    real = Store.open.__func__
    monkeypatch.setattr(Store, "open", classmethod(lambda cls, p, *a: parsed.append(p) or real(cls, p, *a)))
    a = cache.open(path, expect=meta())
    b = cache.open(path, expect=meta())
    assert len(parsed) == 1 and a.fact_ids() == b.fact_ids() == ["f0"]
    for step in range(3):  # every commit is seen by the next open, however fast they follow
        writer.put([fact(10 + step)])
        assert f"f{10 + step}" in cache.open(path)
    assert len(parsed) == 4
    writer.delete(["f0"])
    c = cache.open(path)
    assert "f0" not in c and c.missing(["f0", "f10"]) == ["f0"]
    assert "f0" in a  # a store handed out earlier keeps the manifest it was opened with
    c.put([fact(1)])  # a store from the cache writes as any other, and the cache sees its commit
    assert "f1" in cache.open(path) and "f1" in Store.open(path)
    with pytest.raises(ModelMismatchError):
        cache.open(path, expect=meta(model_fingerprint="b" * 64))  # a cached hit is still checked
    for name in ("t", "u"):  # least recently opened paths are dropped beyond the capacity
        Store.create(tmp_path / name, meta())
        cache.open(tmp_path / name)
    n = len(parsed)
    cache.open(path)
    assert len(parsed) == n + 1
    with pytest.raises(FileNotFoundError, match="no InferScale store"):
        cache.open(tmp_path / "nothing")
    with pytest.raises(ValueError, match="capacity"):
        ManifestCache(capacity=0)


def test_an_existing_store_keeps_its_dtype_whatever_new_stores_get(tmp_path):
    Store.create(tmp_path / "s", meta()).put([fact(0)])  # float32
    st = Store.open_or_create(tmp_path / "s", meta(dtype="int8", kv_scale="channel"))
    assert st.meta.dtype == "float32"
    f1 = fact(1)
    st.put([f1])  # written as the store keeps KV
    np.testing.assert_array_equal(Store.open(tmp_path / "s").get(["f1"])[0].k, f1.k)
    assert ManifestCache().open(tmp_path / "s", meta(dtype="bfloat16"), any_dtype=True).meta.dtype == "float32"
    with pytest.raises(ModelMismatchError, match="dtype"):  # asked for exactly one dtype
        Store.open(tmp_path / "s", expect=meta(dtype="bfloat16"))
    with pytest.raises(ModelMismatchError, match="head_dim"):  # any dtype, not any layout
        Store.open_or_create(tmp_path / "s", meta(head_dim=4, rope={"theta": 1e4, "rotary_dim": 4, "style": "split"}))
