"""Memory service with real SQLite files and a real faiss index."""

import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inferscale.common.facts import Fact, Turn
from inferscale.common.storage.format import ModelMismatchError
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig, UnknownFactError, UnknownUserError

TURNS = [Turn(f"T{i}", "Maya" if i % 2 else "Tom", f"turn number {i} about topic {i}", session=i // 4) for i in range(12)]
FACTS = [Fact("f1", "Tom moved to Leeds in January.", "T3"), Fact("f2", "Maya adopted a grey cat named Pixel.", "T5"),
         Fact("f3", "Tom runs a half marathon in May.", "T8"), Fact("f4", "Maya started a new job at a library.", "T11")]


@pytest.fixture
def svc(tmp_path, encoder, embedder, storage):
    s = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=3, index="faiss", **storage), encoder, embedder)
    s.add("alice", facts=FACTS, turns=TURNS)
    yield s
    s.close()


def test_add_search_get_list_history(svc):
    hits = svc.search("alice", "When was Tom moved to Leeds?", k=2)
    assert hits[0].fact_id == "f1" and hits[0].score >= hits[1].score
    assert [f.fact_id for f in svc.list("alice")] == ["f1", "f2", "f3", "f4"]
    assert svc.get("alice", "f2").text.startswith("Maya adopted")
    kv = svc.load_kv("alice", ["f3", "f1"])
    assert [k.fact_id for k in kv] == ["f3", "f1"] and kv[0].k.shape[1] == len("Tom runs a half marathon in May.")
    svc.update("alice", "f2", "Maya adopted two cats.")
    assert [e["event"] for e in svc.history("alice", "f2")] == ["ADD", "UPDATE"]
    assert svc.history("alice", "f2")[1]["old_text"] == "Maya adopted a grey cat named Pixel."


def test_update_and_delete_reach_search_and_kv(svc, encoder):
    v0 = svc.version("alice")
    old = svc.load_kv("alice", ["f2"])[0]
    svc.update("alice", "f2", "Maya bought a red bicycle.")
    assert svc.version("alice") == v0 + 1
    assert svc.search("alice", "red bicycle", k=1)[0].fact_id == "f2"
    new = svc.load_kv("alice", ["f2"])[0]
    assert not np.array_equal(new.k, old.k) and bytes(new.token_ids.astype(np.uint8)) == b"Maya bought a red bicycle."
    svc.delete("alice", "f2")
    assert "f2" not in [h.fact_id for h in svc.search("alice", "red bicycle", k=4)]
    with pytest.raises(UnknownFactError):
        svc.load_kv("alice", ["f2"])
    assert [e["event"] for e in svc.history("alice", "f2")] == ["ADD", "UPDATE", "DELETE"]


@pytest.mark.parametrize("change", ["update", "delete"])
def test_turn_change_reencodes_exactly_the_facts_whose_window_held_it(svc, encoder, change):
    # w=3: f1 (T3) window T0-T2, f2 (T5) T2-T4, f3 (T8) T5-T7, f4 (T11) T8-T10
    before = {f: svc.load_kv("alice", [f])[0].k.copy() for f in ("f1", "f2", "f3", "f4")}
    encoder.calls.clear()
    if change == "update":
        redone = svc.update_turn("alice", "T2", "an edited turn")
    else:
        redone = svc.delete_turn("alice", "T2")
    assert sorted(redone) == ["f1", "f2"] and encoder.calls == [["f1", "f2"]]
    after = {f: svc.load_kv("alice", [f])[0] for f in before}
    for f in ("f1", "f2"):
        assert not np.array_equal(after[f].k, before[f])
    for f in ("f3", "f4"):
        np.testing.assert_array_equal(after[f].k, before[f])
    if change == "delete":  # the window slides back over the deleted turn
        assert after["f2"].meta["ctx"].startswith("T1:") and "T2:" not in after["f2"].meta["ctx"]
    assert svc.delete_turn("alice", "T9") == ["f4"]


def test_delete_user_leaves_nothing(svc, tmp_path, storage):
    svc.add("bob", facts=[Fact("b1", "Bob likes tea.")])
    bob_dir = svc.user_dir("bob")
    svc.delete_user("alice")
    if storage:
        import psycopg
        import redis

        db = psycopg.connect(storage["catalog"])
        keys = redis.Redis.from_url(storage["kv_store"]).keys("*")
        assert keys and not [k for k in keys if b"Pixel" in k or svc.user_dir("alice").name.encode() in k]
        assert not any(b"Leeds" in redis.Redis.from_url(storage["kv_store"]).dump(k) for k in keys)
    else:
        db = sqlite3.connect(tmp_path / "mem" / "catalog.sqlite")
    for table in ("users", "turns", "facts", "history"):
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE user_id='alice'").fetchone()[0] == 0
    assert not svc.user_dir("alice").exists() and (bob_dir.exists() or storage)  # shared: no local KV
    raw = b"".join(p.read_bytes() for p in (tmp_path / "mem").rglob("*") if p.is_file())
    assert b"Pixel" not in raw and b"Leeds" not in raw  # no text left in SQLite pages or the WAL
    with pytest.raises(UnknownUserError):
        svc.search("alice", "Tom", k=1)
    assert svc.search("bob", "tea", k=1)[0].fact_id == "b1"


@pytest.mark.parametrize("user", ["../alice", "alice/../../x", "a\x00b", "", "alice bob", "x" * 200, ".hidden"])
def test_invalid_user_ids_are_refused(svc, user):
    with pytest.raises(ValueError, match="invalid user id"):
        svc.search(user, "Tom", k=1)
    with pytest.raises(ValueError, match="invalid user id"):
        svc.add(user, facts=[Fact("z", "text")])


def test_users_cannot_reach_each_others_memory(svc):
    svc.add("bob", facts=[Fact("b1", "Bob's secret is 1234.")])
    assert all(h.fact_id.startswith("f") for h in svc.search("alice", "Bob's secret 1234", k=10))
    for call in (lambda: svc.get("alice", "b1"), lambda: svc.load_kv("alice", ["b1"]),
                 lambda: svc.update("alice", "b1", "hacked"), lambda: svc.delete("alice", "b1"),
                 lambda: svc.history("alice", "b1")):
        with pytest.raises(UnknownFactError):
            call()
    for crafted in ("b1' OR '1'='1", "../b1", "b1;DROP TABLE facts"):
        with pytest.raises(ValueError, match="invalid fact id"):
            svc.get("alice", crafted)
    assert svc.get("bob", "b1").text == "Bob's secret is 1234."
    with pytest.raises(UnknownUserError):
        svc.list("carol")


def test_bad_input_commits_nothing(svc, tmp_path):
    n = len(svc.list("alice"))
    with pytest.raises(ValueError, match="40000 characters; the limit is 32768"):
        svc.add("alice", facts=[Fact("f9", "fine"), Fact("f10", "x" * 40000)])
    with pytest.raises(ValueError, match="not valid Unicode"):
        svc.add("alice", facts=[Fact("f9", "fine"), Fact("f10", "hi \ud800 there")])
    with pytest.raises(ValueError, match="not valid Unicode"):
        svc.add("alice", turns=[Turn("T99", "Tom", "hi \ud800 there")])
    with pytest.raises(ValueError, match="already has fact"):
        svc.add("alice", facts=[Fact("f1", "duplicate")])
    with pytest.raises(ValueError, match="unknown turn"):
        svc.add("alice", facts=[Fact("f9", "ok", "T99")])
    with pytest.raises(ValueError, match="empty text"):
        svc.update("alice", "f1", "  ")
    with pytest.raises(UnknownFactError):
        svc.update("alice", "nope", "text")
    with pytest.raises(ValueError, match="k must be"):
        svc.search("alice", "x", k=0)
    assert len(svc.list("alice")) == n


def test_store_of_another_model_is_refused(svc, tmp_path, embedder, storage):
    from doubles import WindowEncoder

    other = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=3, **storage), WindowEncoder("another-model"),
                          embedder)
    with pytest.raises(ModelMismatchError):
        other.add("alice", facts=[Fact("f9", "new fact")])
    with pytest.raises(ModelMismatchError):
        other.load_kv("alice", ["f1"])
    assert len(svc.list("alice")) == 4


def test_repeat_reads_return_the_same_kv_under_the_asked_ids(svc):
    """The service keeps no KV in memory (the serving tiers are `HostTier`s: tests/storage/test_tiers.py):
    every read comes from the store, named by fact id, in the order asked, repeats included."""
    first = svc.load_kv("alice", ["f1", "f2"])
    again = svc.load_kv("alice", ["f2", "f1", "f2"])
    assert [k.fact_id for k in again] == ["f2", "f1", "f2"]
    for a, b in zip(first, again[1::-1]):
        np.testing.assert_array_equal(a.k, b.k)
        np.testing.assert_array_equal(a.v, b.v)
    assert not hasattr(svc, "tiers") and not hasattr(svc, "pin")


def test_a_writer_killed_mid_ingest_loses_only_the_write_in_flight(tmp_path, storage):
    """Shared storage: the survivor opens another root, as a replica on another machine would."""
    root = tmp_path / "mem"
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from doubles import HashEmbedder, WindowEncoder
from inferscale.common.facts import Fact
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig
svc = MemoryService(MemoryConfig(root={str(root)!r}, w=2, index="faiss", **{storage!r}), WindowEncoder(),
                    HashEmbedder())
for i in range(100000):
    svc.add("u1", facts=[Fact(f"f{{i}}", f"fact number {{i}} about item {{i % 7}}")])
    print(i, flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    last = -1
    for line in proc.stdout:
        last = int(line)
        if last >= 25:
            break
    proc.kill()  # SIGKILL, at whatever point the writer is
    proc.wait()
    from doubles import HashEmbedder, WindowEncoder

    survivor = tmp_path / "replica-b" if storage else root
    svc = MemoryService(MemoryConfig(root=str(survivor), w=2, index="faiss", **storage), WindowEncoder(), HashEmbedder())
    facts = svc.list("u1")
    ids = {f.fact_id for f in facts}
    assert {f"f{i}" for i in range(last + 1)} <= ids  # every acknowledged write survived
    assert ids <= {f"f{i}" for i in range(last + 3)}
    kvs = svc.load_kv("u1", sorted(ids))  # every committed fact's KV verifies (checksums)
    for f, kv in zip(sorted(ids), kvs):
        assert bytes(kv.token_ids.astype(np.uint8)).decode() == svc.get("u1", f).text
    assert {h.fact_id for h in svc.search("u1", "fact number", k=len(ids) + 5)} == ids
    svc.add("u1", facts=[Fact("after", "written after the crash")])  # and it is writable again
    assert len(svc.store("u1")) == len(ids) + 1  # orphaned KV was dropped


def test_a_second_process_sees_committed_changes(svc, tmp_path, encoder, embedder, storage):
    # shared storage: the other service has its own root, as a replica on another machine
    root = tmp_path / ("replica-b" if storage else "mem")
    other = MemoryService(MemoryConfig(root=str(root), w=3, index="faiss", **storage), encoder, embedder)
    assert other.search("alice", "grey cat Pixel", k=1)[0].fact_id == "f2"
    svc.update("alice", "f2", "Maya sold her piano.")
    assert other.search("alice", "piano sold", k=1)[0].fact_id == "f2"
    assert other.get("alice", "f2").text == "Maya sold her piano."


def test_users_keep_their_store_dtype_when_the_config_changes(svc, tmp_path, encoder, embedder, storage):
    """kv_dtype is how new stores keep KV: a service configured otherwise (a new default, a replica
    set up later) serves and updates the users it finds in their own dtype."""
    root = tmp_path / ("replica-b" if storage else "mem")
    kept = svc.store("alice").meta.dtype
    other = MemoryService(MemoryConfig(root=str(root), w=3, index="faiss", kv_dtype="int8", **storage), encoder,
                          embedder)
    assert kept != "int8"
    before = svc.load_kv("alice", ["f1"])[0]
    assert other.fact_plan("alice", ["f1"]).facts[0][0] == "f1"
    np.testing.assert_array_equal(other.load_kv("alice", ["f1"])[0].k, before.k)  # as stored
    other.update("alice", "f2", "Maya adopted a black cat.")
    assert other.store("alice").meta.dtype == kept
    assert svc.get("alice", "f2").text == "Maya adopted a black cat."
    other.add("bob", facts=[Fact("b1", "Bob plays chess.")])
    assert other.store("bob").meta.dtype == "int8" and svc.fact_plan("bob", ["b1"]).facts[0][0] == "b1"
    other.close()


def test_reads_follow_another_writers_commits(svc, tmp_path, encoder, embedder, storage):
    """A reader's store opens skip an unchanged manifest; each commit of another service (its
    update, add, delete) reaches the reader's next plan and KV read, and nothing is re-encoded."""
    root = tmp_path / ("replica-b" if storage else "mem")
    reader = MemoryService(MemoryConfig(root=str(root), w=3, index="faiss", **storage), encoder, embedder)
    plan = reader.fact_plan("alice", ["f2", "f1"])
    assert [f for f, _, _ in plan.facts] == ["f2", "f1"]
    for step in range(3):  # commits in quick succession
        svc.update("alice", "f2", f"Maya painted fence number {step}.")
        (_, key, tokens), = reader.fact_plan("alice", ["f2"]).facts
        assert bytes(tokens) == f"Maya painted fence number {step}.".encode()
        assert bytes(reader.load_kv("alice", ["f2"])[0].token_ids.astype(np.uint8)) == bytes(tokens)
    svc.add("alice", facts=[Fact("f5", "Tom learnt the cello.", "T11")])
    assert [f for f, _, _ in reader.fact_plan("alice", ["f5", "f1"]).facts] == ["f5", "f1"]
    svc.delete("alice", "f1")
    with pytest.raises(UnknownFactError, match="f1"):
        reader.fact_plan("alice", ["f5", "f1"])
    assert reader.stats["reencoded_missing"] == 0
    reader.close()


def test_a_stale_index_file_is_rebuilt_from_the_catalog(svc, tmp_path, encoder, embedder, storage):
    """As after a crash between an update's commit and its index save: same ids, old vectors."""
    if storage:
        pytest.skip("with shared storage no replica keeps an index file (each builds it from the catalog)")
    path = svc.user_dir("alice") / "index.bin"
    before = path.read_bytes()
    svc.update("alice", "f2", "Maya sold her piano.")
    path.write_bytes(before)
    fresh = MemoryService(MemoryConfig(root=str(tmp_path / "mem"), w=3, index="faiss", **storage), encoder, embedder)
    assert fresh.search("alice", "piano sold", k=1)[0].fact_id == "f2"


def test_a_long_add_reports_progress_while_a_batch_encodes(tmp_path):
    """An encoder that reports its rows (the torch encoder does) lets `add(progress=...)` speak
    during a batch, not only at its commit; an encoder that does not still gets one call per batch."""
    from doubles import HashEmbedder, WindowEncoder

    class RowsEncoder(WindowEncoder):
        def encode_windowed(self, facts, windows, w, progress=None):
            for i in range(1, 5):
                progress(i, 4)
            return super().encode_windowed(facts, windows, w)

    facts = [Fact(f"f{i}", f"Fact number {i}.") for i in range(6)]
    calls = []
    svc = MemoryService(MemoryConfig(root=str(tmp_path / "rows"), w=0, ingest_batch=4), RowsEncoder(), HashEmbedder())
    svc.writes.PROGRESS_EVERY_S = 0.0
    svc.add("alice", facts=facts, progress=lambda done, n: calls.append((done, n)))
    # batch 1 (4 facts): rows 1-3 of 4 while encoding, then its commit; batch 2 (2 facts) likewise
    assert calls == [(1, 6), (2, 6), (3, 6), (4, 6), (4, 6), (5, 6), (5, 6), (6, 6)]
    plain = []
    svc = MemoryService(MemoryConfig(root=str(tmp_path / "plain"), w=0, ingest_batch=4), WindowEncoder(),
                        HashEmbedder())
    svc.writes.PROGRESS_EVERY_S = 0.0
    svc.add("alice", facts=facts, progress=lambda done, n: plain.append((done, n)))
    assert plain == [(4, 6), (6, 6)]
