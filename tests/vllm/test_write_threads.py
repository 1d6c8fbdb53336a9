"""The connector's write threads (`inferscale.vllm.write_threads`): the background writer runs its tasks
in the order they were queued, on one thread bound to the CPUs asked for, each layer's result
waited for by layer, `drain` leaving nothing running; `split_write` gives each thread disjoint
layers and returns only when all have run; `WritePool`'s helpers run on the forward pass's other
cores. (Serving through them is compared with the synchronous load in `test_layerwise_load.py`;
a prepared kernel write split over threads with one call in `test_paged_write.py`.)"""

import os
import threading
import time

import pytest

from inferscale.vllm.write_threads import LayerWriter, WritePool, free_cpus, team_cpus

from inferscale.common.modes import LOAD_MODES


def test_tasks_run_in_order_on_one_thread_and_are_waited_for_by_layer():
    w = LayerWriter(None)
    ran, threads = [], set()

    def task(i):
        def run():
            time.sleep(0.002 * (3 - i % 3))  # later tasks would overtake earlier ones on a second thread
            ran.append(i)
            threads.add(threading.get_ident())
            return {"layer": i}
        return run

    try:
        for i in range(6):
            w.submit(i, task(i))
        assert w.wait(2) == {"layer": 2} and ran[:3] == [0, 1, 2]  # 2 ran, and every layer queued before it
        assert not w.has(2) and w.has(5)
        assert w.drain() == {i: {"layer": i} for i in (0, 1, 3, 4, 5)}
        assert ran == list(range(6)) and len(threads) == 1 and threading.get_ident() not in threads
        assert not any(w.has(i) for i in range(6))
        with pytest.raises(RuntimeError, match="already has a write in flight"):
            w.submit(7, task(7))
            w.submit(7, task(7))
    finally:
        w.close()


def test_a_task_that_raises_reaches_the_waiter():
    w = LayerWriter(None)
    try:
        w.submit(0, lambda: 1 / 0)
        w.submit(1, lambda: "next")
        with pytest.raises(ZeroDivisionError):
            w.wait(0)
        assert w.wait(1) == "next"  # the thread goes on after a failed task
        w.submit(0, lambda: 1 / 0)
        w.submit(1, lambda: "after")
        out = w.drain()  # waits for every task, raising for none, and leaves nothing queued
        assert isinstance(out[0], ZeroDivisionError) and out[1] == "after" and not w.has(0)
        w.submit(0, lambda: "again")
        assert w.wait(0) == "again"
    finally:
        w.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_the_writer_thread_runs_on_the_cpus_it_was_given_and_the_caller_stays_put():
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    w = LayerWriter({cpu})
    try:
        w.submit(0, lambda: os.sched_getaffinity(0))
        assert w.wait(0) == {cpu}
        assert os.sched_getaffinity(0) == mine
    finally:
        w.close()


def test_free_cpus_are_those_the_caller_is_not_bound_to():
    assert free_cpus(None) is None
    assert free_cpus([3, 1]) == {1, 3}
    for bad in ([], [-1], ["0"], "all", 2):
        with pytest.raises(ValueError, match="load_cpus"):
            free_cpus(bad)
    if hasattr(os, "sched_getaffinity"):
        auto = free_cpus("auto")
        assert auto is None or not auto & team_cpus()
        assert os.sched_getaffinity(0) <= team_cpus()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_write_pool_helpers_run_on_the_team_s_other_cores_not_the_caller_s():
    """As in vLLM's CPU worker: the forward's thread bound to one core, its OpenMP team's others
    to the rest. A helper started from the bound thread would share its core; the pool's do not."""
    first, *rest = sorted(os.sched_getaffinity(0))
    out = {}

    def forward_thread():  # stands for vLLM's worker thread (bound to one core)
        os.sched_setaffinity(0, {first})
        pool = WritePool(2)
        try:
            out["threads"] = pool.threads
            out["helper"] = pool.pool.submit(os.sched_getaffinity, 0).result()
            out["team"] = team_cpus()
        finally:
            pool.close()

    t = threading.Thread(target=forward_thread)
    t.start()
    t.join()
    assert out["threads"] == 2 and first not in out["helper"] and out["helper"] <= out["team"]
    assert set(rest) <= out["helper"]
    assert LOAD_MODES == ("sync", "layerwise", "background")


def test_split_write_gives_each_thread_disjoint_layers_and_waits_for_all_before_raising():
    from concurrent.futures import ThreadPoolExecutor

    from inferscale.vllm.write_threads import split_write

    calls, done = [], []

    def write(layers, caches):
        calls.append((tuple(layers), tuple(caches), threading.get_ident()))
        time.sleep(0.01)
        done.append(tuple(layers))

    with ThreadPoolExecutor(2) as pool:
        split_write(write, [0, 1, 2, 3, 4, 5, 6], list("abcdefg"), pool, 3)
        assert sorted(c[0] for c in calls) == [(0, 3, 6), (1, 4), (2, 5)]
        assert all(c[1] == tuple("abcdefg"[i] for i in c[0]) for c in calls)  # each layer with its cache
        assert len({c[2] for c in calls}) == 3 and len(done) == 3
        calls.clear()
        split_write(write, [0, 1], ["a", "b"], None, 4)  # no pool: one call on this thread
        assert calls == [((0, 1), ("a", "b"), threading.get_ident())]

        done.clear()

        def fails_on_0(layers, caches):
            if 0 in layers:
                raise OSError("disk")
            write(layers, caches)

        with pytest.raises(OSError, match="disk"):
            split_write(fails_on_0, list(range(6)), list(range(6)), pool, 3)
        assert sorted(done) == [(1, 4), (2, 5)]  # the other parts had finished when it raised
