"""Defects found by attacking the memory service (issue 14): KV keys that repeat after a delete,
incomplete forgetting, residue of an interrupted delete-user, unbounded adds, one lock for every
user, ids with a trailing newline, and realistic text lengths."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from doubles import HashEmbedder, WindowEncoder, all_bytes
from inferscale.common.facts import Fact, Turn, validate_id
from inferscale.common.storage.paths import user_dir
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import AddInterrupted, MemoryConfig, UnknownUserError

TURNS = [Turn(f"T{i}", "Tom" if i % 2 else "Maya", f"turn {i} about topic {i}") for i in range(6)]


def service(root, encoder=None, **config):
    return MemoryService(MemoryConfig(root=str(root), w=2, index="faiss", **config), encoder or WindowEncoder(),
                         HashEmbedder())


# -- 1: keys never repeat across a delete ------------------------------------------------------------
def test_a_recreated_user_gets_new_kv_keys_and_never_the_old_kv(tmp_path):
    svc = service(tmp_path / "mem")
    svc.add("stale2", facts=[Fact("code", "The secret code word is GOLDEN ELEPHANT.")])
    old_plan = svc.fact_plan("stale2", ["code"])
    old_kv = svc.load_kv("stale2", ["code"])[0]
    svc.delete_user("stale2")
    svc.add("stale2", facts=[Fact("code", "The secret code word is GREEN GIRAFFE!!")])
    new_plan = svc.fact_plan("stale2", ["code"])
    assert new_plan.version == old_plan.version  # the version restarts ...
    assert new_plan.incarnation != old_plan.incarnation  # ... the incarnation does not
    assert new_plan.facts[0][1] != old_plan.facts[0][1]  # so neither does the KV key
    new_kv = svc.load_kv("stale2", ["code"])[0]
    assert bytes(new_kv.token_ids.astype(np.uint8)) == b"The secret code word is GREEN GIRAFFE!!"
    assert not np.array_equal(new_kv.k, old_kv.k)


# -- 3: forgetting one fact ---------------------------------------------------------------------------
@pytest.mark.parametrize("keep_history", [False, True])
def test_forgetting_a_fact_removes_its_bytes_from_every_file(tmp_path, keep_history):
    root = tmp_path / "mem"
    svc = service(root)
    secret = "Maya's locker code is QUOKKA-7731."
    facts = [Fact(f"f{i}", f"Ordinary fact number {i} about the garden.", f"T{i}") for i in range(5)]
    svc.add("maya", facts=facts[:2] + [Fact("gone", "Maya's locker code is ZEBRA-0000.", "T2")] + facts[2:],
            turns=TURNS)
    svc.update("maya", "gone", secret)  # history now holds both texts
    kv = svc.load_kv("maya", ["f0", "gone"])[1]
    svc.delete("maya", "gone", keep_history=keep_history)
    blob = all_bytes(root)
    assert kv.k.tobytes()[:64] not in blob and kv.v.tobytes()[:64] not in blob  # KV
    assert kv.token_ids.astype(np.int32).tobytes() not in blob  # token ids as the store keeps them
    events = svc.history("maya", "gone")
    assert [e["event"] for e in events] == ["ADD", "UPDATE", "DELETE"]
    if keep_history:
        assert secret.encode() in blob and events[1]["new_text"] == secret
    else:
        assert secret.encode() not in blob and b"ZEBRA-0000" not in blob  # catalog, WAL, manifest, shards
        assert all(e["old_text"] is None and e["new_text"] is None for e in events)
    assert not (root / "catalog.sqlite-wal").exists() or (root / "catalog.sqlite-wal").stat().st_size == 0
    # the facts that shared its shard are intact
    assert [f.fact_id for f in svc.list("maya")] == [f.id for f in facts]
    again = service(root).load_kv("maya", [f.id for f in facts])
    assert [bytes(k.token_ids.astype(np.uint8)).decode() for k in again] == [f.text for f in facts]
    keys = svc.store("maya").fact_ids()
    assert svc.catalog.fact("maya", "f0").kv_key in keys
    assert all(key.split("~")[0] != "gone" for key in keys)  # and the store no longer names it


def test_deleting_a_turn_forgets_the_kv_that_saw_it(tmp_path):
    root = tmp_path / "mem"
    svc = service(root)
    turns = TURNS[:3] + [Turn("T3", "Tom", "my PIN is 4242")] + TURNS[4:]
    svc.add("tom", facts=[Fact("f", "Tom likes tea.", "T4")], turns=turns)
    before = svc.load_kv("tom", ["f"])[0]
    svc.delete_turn("tom", "T3")
    assert b"my PIN is 4242" not in all_bytes(root)
    assert before.k.tobytes()[:64] not in all_bytes(root)


# -- 4: an interrupted delete-user ----------------------------------------------------------------
CRASH_AFTER_COMMIT = """
import os, shutil, sys
sys.path.insert(0, {tests!r})
from doubles import HashEmbedder, WindowEncoder, all_bytes
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig
svc = MemoryService(MemoryConfig(root={root!r}, w=2, index="faiss"), WindowEncoder(), HashEmbedder())
shutil.rmtree = lambda *a, **k: os._exit(9)   # die right after the catalog rows went
svc.delete_user("maya")
"""


@pytest.mark.parametrize("finish_by", ["delete-again", "reopen", "re-add"])
def test_a_delete_user_killed_after_its_commit_is_finished(tmp_path, monkeypatch, finish_by):
    root = tmp_path / "mem"
    svc = service(root)
    svc.add("maya", facts=[Fact("f1", "Maya's passport number is X1234567.")])
    svc.add("tom", facts=[Fact("t1", "Tom likes tea.")])
    svc.close()
    code = CRASH_AFTER_COMMIT.format(tests=str(Path(__file__).parents[1]), root=str(root))
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    udir = user_dir(root, "maya")
    assert udir.exists() and b"X1234567" in all_bytes(udir)  # the residue the crash left
    if finish_by == "reopen":
        svc = service(root)  # opening the memory finishes it
    else:
        with monkeypatch.context() as m:  # without the sweep at open, the next write of that id finishes it
            from inferscale.memory.crash_recovery import CrashRecovery

            m.setattr(CrashRecovery, "remove_orphan_dirs", lambda self: None)
            svc = service(root)
        assert udir.exists()
        if finish_by == "delete-again":
            svc.delete_user("maya")  # succeeds: the catalog no longer knows maya, but her files remain
            with pytest.raises(UnknownUserError):
                svc.delete_user("maya")  # now nothing is left
        else:
            svc.add("maya", facts=[Fact("f2", "Maya sails.")])  # a new maya starts clean
            assert [f.fact_id for f in svc.list("maya")] == ["f2"]
    assert b"X1234567" not in all_bytes(root)
    assert [f.fact_id for f in svc.list("tom")] == ["t1"]  # other users untouched
    assert bytes(svc.load_kv("tom", ["t1"])[0].token_ids.astype(np.uint8)) == b"Tom likes tea."


# -- 5: large adds ---------------------------------------------------------------------------------
class FailingEncoder(WindowEncoder):
    def __init__(self, fail_on_call: int) -> None:
        super().__init__()
        self.fail_on_call = fail_on_call

    def encode_windowed(self, facts, windows, w):
        if len(self.calls) + 1 == self.fail_on_call:
            self.calls.append(["<failed>"])
            raise RuntimeError("encoder out of memory")
        return super().encode_windowed(facts, windows, w)


def test_a_large_add_is_encoded_and_committed_in_bounded_batches(tmp_path):
    enc = FailingEncoder(fail_on_call=3)
    svc = service(tmp_path / "mem", enc, ingest_batch=4)
    facts = [Fact(f"f{i}", f"fact number {i}") for i in range(10)]
    with pytest.raises(AddInterrupted) as e:
        svc.add("u", facts=facts)
    assert e.value.added == [f"f{i}" for i in range(8)]
    assert [len(c) for c in enc.calls[:2]] == [4, 4]  # never more than a batch in memory
    assert [f.fact_id for f in svc.list("u")] == e.value.added  # committed as they went
    assert svc.search("u", "fact number 7", k=1)[0].fact_id == "f7"
    assert svc.add("u", facts=facts[8:]) == ["f8", "f9"]  # the rest can be added again


def test_bad_input_anywhere_in_a_large_add_commits_nothing(tmp_path):
    svc = service(tmp_path / "mem", ingest_batch=2)
    facts = [Fact(f"f{i}", f"fact {i}") for i in range(7)] + [Fact("bad", "x" * 40000)]
    with pytest.raises(ValueError, match="characters"):
        svc.add("u", facts=facts)
    with pytest.raises(UnknownUserError):
        svc.list("u")


# -- 6: one writer per user, reads never wait ---------------------------------------------------------
class GatedEncoder(WindowEncoder):
    """Blocks while encoding any fact whose text contains 'SLOW' until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def encode_windowed(self, facts, windows, w):
        if any("SLOW" in f.text for f in facts):
            self.entered.set()
            assert self.release.wait(30)
        return super().encode_windowed(facts, windows, w)


def test_a_long_write_blocks_only_its_own_user(tmp_path):
    enc = GatedEncoder()
    svc = service(tmp_path / "mem", enc)
    svc.add("alice", facts=[Fact("a0", "Alice plays chess.")])
    svc.add("bob", facts=[Fact("b0", "Bob grows tomatoes.")])
    done = {}

    def run(name, fn):
        fn()
        done[name] = time.monotonic()

    slow = threading.Thread(target=run, args=("slow", lambda: svc.add("alice", facts=[Fact("a1", "SLOW fact")])))
    slow.start()
    assert enc.entered.wait(10)
    second = threading.Thread(target=run, args=("alice2", lambda: svc.add("alice", facts=[Fact("a2", "more")])))
    second.start()
    t = time.monotonic()
    assert svc.add("bob", facts=[Fact("b1", "Bob bought a bike.")]) == ["b1"]  # another user's write
    svc.update("bob", "b1", "Bob bought a red bike.")
    assert [h.fact_id for h in svc.search("alice", "chess", k=1)] == ["a0"]  # reads of the busy user
    assert [f.fact_id for f in svc.list("alice")] == ["a0"]
    assert svc.fact_plan("alice", ["a0"]).version == 1
    assert time.monotonic() - t < 5
    time.sleep(0.2)
    assert "alice2" not in done  # the same user's second write waits for the first
    enc.release.set()
    slow.join(10)
    second.join(10)
    assert done["slow"] <= done["alice2"]
    assert [f.fact_id for f in svc.list("alice")] == ["a0", "a1", "a2"]


def test_writers_in_two_processes_serialise_per_user(tmp_path):
    root = tmp_path / "mem"
    service(root).add("alice", facts=[Fact("a0", "Alice plays chess.")])
    code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from doubles import HashEmbedder, WindowEncoder, all_bytes
from inferscale.common.facts import Fact
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig
svc = MemoryService(MemoryConfig(root={str(root)!r}, w=2, index="faiss"), WindowEncoder(), HashEmbedder())
for i in range(20):
    svc.add(sys.argv[1], facts=[Fact(f"{{sys.argv[2]}}{{i}}", f"fact {{i}} of {{sys.argv[2]}}")])
"""
    procs = [subprocess.Popen([sys.executable, "-c", code, "alice", p]) for p in ("x", "y")]
    assert [p.wait(120) for p in procs] == [0, 0]
    svc = service(root)
    assert len(svc.list("alice")) == 41 and svc.version("alice") == 41
    assert len(svc.load_kv("alice", [f.fact_id for f in svc.list("alice")])) == 41


# -- 10: ids --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["alice\n", "alice\n\n", "\nalice", "al ice", "alice\x00"])
def test_ids_with_control_characters_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="invalid user id"):
        validate_id("user", bad)
    svc = service(tmp_path / "mem")
    with pytest.raises(ValueError, match="invalid"):
        svc.add(bad, facts=[Fact("f", "text")])
    with pytest.raises(ValueError, match="invalid fact id"):
        Fact("f\n", "text")


# -- realistic lengths ----------------------------------------------------------------------------
class Builder:
    def fact_ids(self, text, date):
        return list(range(len(text.split())))  # one token per word


def test_long_turns_are_accepted_and_facts_are_limited_in_tokens(tmp_path):
    enc = WindowEncoder()
    enc.builder = Builder()
    svc = service(tmp_path / "mem", enc, max_fact_tokens=50)
    long_turn = Turn("D7:53", "Caroline", "word " * 240 + "end")  # 1,203 characters, like a real chat turn
    svc.add("c", turns=[long_turn], facts=[Fact("f", "Caroline talked at length.", "D7:53")])
    assert svc.list("c")[0].fact_id == "f"
    with pytest.raises(ValueError, match="51 tokens; the limit is 50"):
        svc.add("c", facts=[Fact("g", " ".join(["w"] * 51))])
    with pytest.raises(ValueError, match="session"):
        Turn("t", "Tom", "hi", session=2**70)


def test_a_slow_store_read_blocks_no_other_user_and_no_writer(tmp_path):
    """A read holds no lock while it reads the store: other users' reads and this user's writers go on."""
    svc = service(tmp_path / "mem")
    for user in ("ann", "ben"):
        svc.add(user, facts=[Fact("f", f"{user} drinks tea.")])
    started, release, out = threading.Event(), threading.Event(), []
    real = svc.core.store

    def store(user, reader=False):
        s = real(user, reader)
        if user == "ann" and reader:
            get = s.get

            def slow(keys):
                started.set()
                release.wait(10)
                return get(keys)

            s.get = slow
        return s

    svc.core.store = store  # what every part of the service opens stores through
    reader = threading.Thread(target=lambda: out.append(svc.load_kv("ann", ["f"])))
    reader.start()
    assert started.wait(10)
    assert svc.load_kv("ben", ["f"])[0].fact_id == "f"  # not blocked
    svc.add("ann", facts=[Fact("g", "ann drinks coffee.")])  # ann's writer is not blocked either
    release.set()
    reader.join(10)
    assert bytes(out[0][0].token_ids.astype(np.uint8)) == b"ann drinks tea."
