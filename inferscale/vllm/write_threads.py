"""Threads that write memory KV into vLLM's CPU paged cache for the connector.

Not kernels: the threads the connector's load pipelines run on. A load's write through the CPU
pipeline (`kernels/cpu_pipeline.py`) is one Numba kernel call per group of layers, and the kernel
releases the GIL, so it can run on several threads at once, each on its own layers
(`split_write`): the synchronous
load (`"load": "sync"`, the default) splits its layers over as many threads as torch's intra-op
pool has. vLLM's CPU worker binds that OpenMP team one thread per core, its own thread to the
first, and the team sits idle while the connector writes before the forward pass, so the helpers
(`WritePool`) are bound to the team's other cores (a helper started from the worker's thread would
inherit its single core). Layers are independent caches, so the result is the same bytes.

On a GPU, layerwise loading overlaps copies with compute through the device's queues: the
connector launches layer l's write just before layer l's attention and the host moves on. On CPU
a write is work for a core, so `"load": "background"` hands every layer's write to one
`LayerWriter` thread when the step starts (`start_load_kv`), in layer order, and
`wait_for_layer_load(l)` only waits for layer l's. That pays where the writer has a core the
forward pass does not use (`free_cpus`: vLLM's CPU worker leaves cores to the engine's scheduler
and server on machines with more than a few); where the forward pass has every core, the writer
competes with it and `sync` is faster (`benchmarks/ttft.py --kv-load`).

Contract (the connector keeps it): tasks of one step are submitted by the forward pass's thread,
each returns what failed rather than raising; `wait(l)` returns layer l's result; `drain()` waits
for every task submitted (after the forward pass, so nothing is still writing into blocks vLLM may
hand to another request).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from inferscale.config import check_cpus

log = logging.getLogger("inferscale.connector")


def team_cpus() -> set[int] | None:
    """The CPUs this process's threads are bound to, together (vLLM's CPU worker binds torch's
    OpenMP team one thread per core: this is those cores), or None where affinity is unknown."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = set(os.sched_getaffinity(0))
    try:
        tids = os.listdir("/proc/self/task")  # Linux: one entry per thread; a thread id works as a pid here
    except OSError:
        return cpus
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread has exited meanwhile
            pass
    return cpus


def free_cpus(requested: list[int] | str | None = "auto") -> set[int] | None:
    """The CPUs the background writer thread may run on: `requested` as given (a list of CPU ids),
    or with "auto" the machine's CPUs that no thread of this process is bound to (none of the
    forward pass's cores); None (unbound) where that leaves none or affinity is unknown."""
    if requested is None:
        return None
    if requested != "auto":
        return set(check_cpus(requested, "kv_load_cpus"))
    team = team_cpus()
    if team is None:
        return None
    return set(range(os.cpu_count() or 1)) - team or None


def _bind(cpus: set[int] | None, what: str) -> None:
    """Bind the calling thread (only: on Linux 0 is the calling thread) to `cpus`."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # CPUs outside this process's set: stay where the thread started
        log.warning("%s: cannot bind to CPUs %s (%s)", what, sorted(cpus), e)


class WritePool:
    """Helper threads for `split_write` on the forward pass's other cores: the calling thread's
    cores are its own, and a helper started from it would inherit them (vLLM's CPU worker binds
    its main thread to one core), so the helpers are bound to the rest of the OpenMP team's
    cores, idle while the connector writes before the forward pass."""

    def __init__(self, threads: int) -> None:
        mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        team = team_cpus()
        if mine is None or team is None:  # affinity unknown: helpers go where the OS puts them
            others, cores = None, threads
        elif team == mine:  # no thread bound elsewhere: helpers share (inherit) the caller's cores
            others, cores = None, len(mine)
        else:
            others, cores = team - mine, len(team)
        # never more threads than cores to run them (a one-core team would only interleave)
        self.threads = max(1, min(threads, cores))
        self.cpus = others
        self.pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="inferscale-kv-write",
                                       initializer=_bind, initargs=(others, "memory KV write helper")
                                       ) if self.threads > 1 else None
        log.info("memory KV writes split over %d thread(s)%s", self.threads,
                 f", helpers on CPUs {sorted(others)}" if others and self.threads > 1 else "")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class LayerWriter:
    """One writer thread (optionally bound to `cpus`) and the tasks of the current step, by layer."""

    def __init__(self, cpus: set[int] | None) -> None:
        self.cpus = cpus
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferscale-kv-writer", initializer=_bind,
                                        initargs=(cpus, "memory KV writer thread"))
        self._pending: dict[int, Future] = {}
        log.info("memory KV writer thread on %s", f"CPUs {sorted(cpus)}" if cpus else "any CPU")

    def submit(self, layer: int, task: Callable[[], Any]) -> None:
        """Queue `task` (layer `layer`'s writes; it returns its failures, never raises) after those
        already queued."""
        if layer in self._pending:
            raise RuntimeError(f"layer {layer} already has a write in flight")
        self._pending[layer] = self._pool.submit(task)

    def has(self, layer: int) -> bool:
        return layer in self._pending

    def wait(self, layer: int) -> Any:
        """Layer `layer`'s task's result, once it has run."""
        return self._pending.pop(layer).result()

    def drain(self) -> dict[int, Any]:
        """Wait for every queued task: their results by layer (a task that raised: its exception).
        Nothing is queued afterwards."""
        pending, self._pending = self._pending, {}
        return {layer: f.exception() or f.result() for layer, f in pending.items()}

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


def split_write(write: Callable[[list[int], list[Any]], None], layers: Sequence[int], caches: Sequence[Any],
                pool: ThreadPoolExecutor | None, threads: int) -> None:
    """`write(layers, caches)` split into up to `threads` calls on disjoint layers (every
    `threads`-th layer, so each call has early and late ones), one on the calling thread and the
    others on `pool`; returns once all have run, raising the first failure."""
    n = min(threads, len(layers)) if pool is not None else 1
    if n <= 1:
        write(list(layers), list(caches))
        return
    parts = [(list(layers[j::n]), list(caches[j::n])) for j in range(n)]
    futures = [pool.submit(write, *part) for part in parts[1:]]
    try:
        write(*parts[0])
    finally:
        for f in futures:  # every part has finished before this returns, failed or not
            f.exception()
    for f in futures:
        f.result()
