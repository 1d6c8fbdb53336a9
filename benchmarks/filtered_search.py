"""Filtered search latency beside unfiltered, through the memory service, at --filtered-facts facts
(default 1e5) of one user: a section of `benchmarks/memory.py`.

The user's facts are written straight into a real catalog (SQLite in a temporary root, or the
PostgreSQL of `--catalog`) with seeded random 384-d embeddings and metadata, so that 1e5 facts
take seconds, not hours of encoding: the measured path (`MemoryService.search`: query embedding,
catalog filter, faiss search, rows) is the serving one, and KV plays no part in it. Each query runs
every filter in turn (interleaved, so machine noise hits all alike); the table gives medians, p99,
the ratio to unfiltered, how many facts each filter matches, and checks every hit against it.

    python benchmarks/memory.py --skip-search --skip-kv --skip-ingest             # this section alone
"""

from __future__ import annotations

import hashlib
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from inferscale.common.facts import Fact
from inferscale.common.storage.filters import matches, parse_filter
from inferscale.memory.service import MemoryService
from inferscale.memory.service_types import MemoryConfig

T0 = 1_800_000_000.0
USER = "bench:user"


def filters_for(n: int) -> list[tuple[str, dict | None]]:
    return [("none", None),
            ("category = c3 (10%)", {"category": "c3"}),
            ("priority >= 50 (50%)", {"priority": {"gte": 50}}),
            ("tags has rare (1%)", {"tags": "rare"}),
            ("c3 and priority < 10 (1%)", {"and": [{"category": "c3"}, {"priority": {"lt": 10}}]}),
            ("created in the last 10%", {"created_at": {"gte": T0 + 0.9 * n}}),
            ("not c3, tag in (rare, x)", {"not": {"category": "c3"}, "tags": {"in": ["rare", "x"]}})]


class SeededEmbedder:
    """A text's embedding: a unit vector seeded by its hash (queries are as random as the facts)."""

    name = "seeded-random"

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def embed(self, texts):
        out = np.empty((len(texts), self.dim), np.float32)
        for i, t in enumerate(texts):
            rng = np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:15], 16))
            v = rng.standard_normal(self.dim).astype(np.float32)
            out[i] = v / np.linalg.norm(v)
        return out


class NoEncoder:
    """Store metadata only: this section encodes nothing."""

    def store_meta(self, w: int, context: str = "turns"):
        from inferscale.common.storage.format import StoreMeta

        return StoreMeta("bench-no-model", 1, 1, 4, {"theta": 1e4, "rotary_dim": 4, "style": "split"}, w=w,
                         context=context)


def fill(svc: MemoryService, n: int, dim: int, seed: int, console: Console) -> list[Fact]:
    """`n` facts with metadata (category c0..c9, priority 0..99, 1% tagged "rare"), created a second apart."""
    rng = np.random.default_rng(seed)
    facts = []
    cat = svc.catalog
    block = 10_000
    for lo in range(0, n, block):
        m = min(block, n - lo)
        vecs = rng.standard_normal((m, dim)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        with cat.transaction() as db:
            cat.ensure_user(db, USER, "bench")
            v = cat.bump_version(db, USER)
            for j in range(m):
                i = lo + j
                md = {"category": f"c{i % 10}", "priority": int(rng.integers(0, 100))}
                if i % 100 == 7:
                    md["tags"] = ["rare"]
                f = Fact(f"f{i}", f"Fact number {i}.", metadata=md)
                cat.insert_fact(db, USER, f, f"k{i}", vecs[j], v, 0, T0 + i)
                facts.append(f)
        console.print(f"  wrote {lo + m:,}/{n:,} facts", highlight=False)
    return facts


def filtered_search(args, console: Console) -> None:
    n, k = args.filtered_facts, args.k
    console.rule(f"[bold]Filtered search: {n:,} facts of one user, k={k}")
    with tempfile.TemporaryDirectory() as root:
        svc = MemoryService(MemoryConfig(root=root, index="faiss", catalog=args.catalog), NoEncoder(),
                            SeededEmbedder(args.dim))
        svc.clock = lambda: T0 + n + 1
        t0 = time.perf_counter()
        facts = fill(svc, n, args.dim, args.seed, console)
        console.print(f"  written in {time.perf_counter() - t0:.1f} s; building the index "
                      f"({svc.catalog.url if args.catalog else 'SQLite'})")
        svc.catalog.optimize()  # the planner's statistics, as the server's periodic sweep refreshes them
        svc.search(USER, "warm-up", k=k)  # builds the user's faiss index from the catalog
        cases = filters_for(n)
        by_id = {f.id: f for f in facts}
        matched = {}
        for name, spec in cases:
            node = parse_filter(spec)
            matched[name] = sum(matches(node, f.metadata, {"created_at": T0 + i}) for i, f in enumerate(facts))
        times: dict[str, list[float]] = {name: [] for name, _ in cases}
        for j in range(args.warmup + args.queries):
            for name, spec in cases:
                t = time.perf_counter()
                hits = svc.search(USER, f"query {j}", k=k, filters=spec)
                dt = time.perf_counter() - t
                node = parse_filter(spec)
                assert len(hits) == min(k, matched[name]), (name, len(hits))
                assert all(matches(node, by_id[h.fact_id].metadata, {"created_at": h.created_at}) for h in hits)
                if j >= args.warmup:
                    times[name].append(dt)
        svc.close()
    base = float(np.median(times["none"]))
    table = Table(title=f"MemoryService.search at {n:,} facts (k={k}, {args.queries} queries, interleaved)")
    for col in ("filter", "matching facts", "median ms", "p99 ms", "vs unfiltered"):
        table.add_column(col, justify="left" if col == "filter" else "right")
    for name, _ in cases:
        a = np.asarray(times[name]) * 1e3
        table.add_row(name, f"{matched[name]:,}", f"{np.median(a):.2f}", f"{np.percentile(a, 99):.2f}",
                      f"{np.median(a) / (base * 1e3):.2f}x")
    console.print(table)
