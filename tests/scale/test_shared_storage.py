"""Memory services on different roots (replicas) over one real PostgreSQL catalog and Redis tier."""

import threading

import numpy as np
import psycopg
import pytest
import redis

from doubles import HashEmbedder, WindowEncoder

from inferscale.common.facts import Fact, Turn
from inferscale.common.storage.catalog import CatalogError
from inferscale.common.storage.catalogs import open_catalog
from inferscale.common.storage.catalog_sqlite import SQLiteCatalog
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

TURNS = [Turn(f"T{i}", "Maya" if i % 2 else "Tom", f"turn number {i} about topic {i}") for i in range(8)]
FACTS = [Fact("f1", "Tom moved to Leeds in January.", "T3"), Fact("f2", "Maya adopted a cat named Pixel.", "T5")]


def _replica(root, shared, **kw):
    catalog, kv = shared
    return MemoryService(MemoryConfig(root=str(root), w=2, catalog=catalog, kv_store=kv, **kw), WindowEncoder(),
                         HashEmbedder())


def test_kv_missing_from_the_shared_tier_is_encoded_again_never_served_partially(tmp_path, shared_storage):
    a, b = _replica(tmp_path / "a", shared_storage), _replica(tmp_path / "b", shared_storage)
    a.add("u", turns=TURNS, facts=FACTS)
    before = a.load_kv("u", ["f1", "f2"])
    client = redis.Redis.from_url(shared_storage[1])
    for key in client.keys("*:kv:*"):  # as Redis evicting under maxmemory
        client.delete(key)
    plan = b.fact_plan("u", ["f1", "f2"])
    assert b.stats["reencoded_missing"] == 2 and [k for _, k, _ in plan.facts] == [
        a.catalog.fact("u", f).kv_key for f in ("f1", "f2")]  # same keys: the same catalog state
    for x, y in zip(before, b.load_kv("u", ["f1", "f2"])):
        np.testing.assert_array_equal(x.k, y.k)
        np.testing.assert_array_equal(x.v, y.v)


def test_delete_user_leaves_nothing_in_postgres_redis_or_on_disk(tmp_path, shared_storage):
    a, b = _replica(tmp_path / "a", shared_storage), _replica(tmp_path / "b", shared_storage)
    a.add("t:alice", turns=TURNS, facts=FACTS)
    a.add("t:bob", facts=[Fact("b1", "Bob likes tea.")])
    assert b.search("t:alice", "Pixel cat", k=1)[0].fact_id == "f2"
    b.delete_user("t:alice")  # deleted through the other replica
    db = psycopg.connect(shared_storage[0])
    for table in ("users", "turns", "facts", "history"):
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE user_id='t:alice'").fetchone()[0] == 0
    client = redis.Redis.from_url(shared_storage[1])
    alice = a.user_dir("t:alice").name.encode()
    keys = client.keys("*")
    assert keys and not [k for k in keys if alice in k]
    assert not any(b"Pixel" in client.dump(k) or b"Leeds" in client.dump(k) for k in keys)
    for root in (tmp_path / "a", tmp_path / "b"):
        raw = b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())
        assert b"Pixel" not in raw and b"Leeds" not in raw
    assert a.search("t:bob", "tea", k=1)[0].fact_id == "b1"
    with pytest.raises(Exception, match="unknown user"):
        a.search("t:alice", "Pixel", k=1)


def test_writers_on_two_replicas_serialise_per_user(tmp_path, shared_storage):
    a, b = _replica(tmp_path / "a", shared_storage), _replica(tmp_path / "b", shared_storage)
    errors = []

    def write(svc, prefix):
        try:
            for i in range(6):
                svc.add("u", facts=[Fact(f"{prefix}{i}", f"fact {prefix} {i}")])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write, args=(s, p)) for s, p in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    facts = a.list("u")
    assert len(facts) == 12 and a.version("u") == 12
    assert sorted(f.version for f in facts) == list(range(1, 13))  # one version per write, none shared
    assert len(b.load_kv("u", [f.fact_id for f in facts])) == 12


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_catalog_of_a_newer_schema_is_refused(tmp_path, backend, shared_storage):
    url = "" if backend == "sqlite" else shared_storage[0]
    cat = open_catalog(url, tmp_path)
    with cat.transaction() as db:
        cat.execute(db, "UPDATE meta SET value='99' WHERE key='schema_version'")
    cat.close()
    with pytest.raises(CatalogError, match="schema version 99"):
        open_catalog(url, tmp_path)


def test_bad_storage_urls_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="catalog must be"):
        MemoryConfig(root=str(tmp_path), catalog="mysql://x")
    with pytest.raises(ValueError, match="kv_store must be"):
        MemoryConfig(root=str(tmp_path), kv_store="memcached://x")
    assert isinstance(open_catalog("", tmp_path), SQLiteCatalog)


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_verify_finds_corrupted_or_missing_kv(tmp_path, backend, shared_storage):
    kv_url = "" if backend == "local" else shared_storage[1]
    svc = MemoryService(MemoryConfig(root=str(tmp_path), w=2, kv_store=kv_url), WindowEncoder(), HashEmbedder())
    svc.add("u", turns=TURNS, facts=FACTS)
    store = svc.store("u")
    assert store.verify() == []
    key = svc.catalog.fact("u", "f1").kv_key
    if backend == "local":
        shard = tmp_path / "users" / svc.user_dir("u").name / "kv" / "shards" / store.info(key)["shard"]
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        redis.Redis.from_url(kv_url).delete(next(k for k in redis.Redis.from_url(kv_url).keys("*:kv:*")
                                                 if k.decode().endswith(key)))
    problems = svc.store("u").verify()
    assert len(problems) == 1 and ("corrupted" in problems[0] or "no KV" in problems[0])
