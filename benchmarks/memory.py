"""Memory-layer benchmarks: fact retrieval latency and KV bytes per fact.

Sections (each one function taking the parsed args and a rich Console; `main` runs them in turn):

* `search_latency` - single-query top-k latency over N synthetic 384-d normalised embeddings
  (seeded; `--data gaussian`, the default, is isotropic - the hard case for approximate search;
  `--data clustered` has topic structure like real embeddings) for the numpy `ExactIndex`,
  `FaissIndex` (exact flat inner product; GPU when faiss sees one) and a faiss HNSW graph
  (`IndexHNSWFlat(dim, 32)`, inner product, efSearch 64) with its recall@k against exact search.
  The methods are interleaved query by query, so machine noise hits all of them alike. Queries
  run with numpy's BLAS and faiss's OpenMP limited to `--threads` (default 1): with both pools
  multi-threaded in one process on a few cores, interleaved single queries run 10-100x slower
  because each pool's spin-waiting threads starve the other's.
* `kv_bytes` - KV bytes per token and per fact for SmolLM2-135M's shape, computed from
  2 * layers * kv_heads * head_dim * itemsize * tokens, and measured as the on-disk size of a real
  `inferscale.common.storage.local_store.Store` shard of random facts (float32, float16, bfloat16).
* `filtered_search` (`benchmarks/filtered_search.py`) - `MemoryService.search` with metadata and
  time filters of 1-50% selectivity beside unfiltered, at `--filtered-facts` facts (default 1e5)
  of one user in a real catalog (SQLite, or PostgreSQL with `--catalog`).
* `ingest_throughput` - facts/s through the memory service (embedding, Context-Window Encoding
  with the JAX engine on SmolLM2, KV shard, SQLite commit, index save), for w in {0, 5} and
  batches of 1 and 8 facts per `add`.

    python benchmarks/memory.py --quick      # N up to 1e5, a minute or two on a laptop
    python benchmarks/memory.py              # N up to 1e6 (several GB of RAM; HNSW build is slow)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from filtered_search import filtered_search
from inferscale.retrieval.vector_index import ExactIndex

from inferscale.retrieval.faiss_index import FaissIndex, faiss_available
from inferscale.common.storage.format import FactKV, StoreMeta
from inferscale.common.storage.local_store import Store

# SmolLM2-135M (the embedded default model): 30 layers, 3 KV heads of 64 channels, RoPE theta 1e5.
SMOLLM2 = {"name": "SmolLM2-135M", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "rope_theta": 100000.0}
# (dtype, bytes per element, status); fp8/int8 would also store scales, not counted here.
DATA_HELP = {
    "gaussian": "isotropic Gaussian directions (no structure: the worst case for HNSW recall)",
    "clustered": "1000 shared topic directions + equal-norm isotropic noise (cos ~0.7 to the topic)",
}
KV_DTYPES = [
    ("float32", 4, "implemented"),
    ("float16", 2, "implemented"),
    ("bfloat16", 2, "implemented"),
    ("float8_e4m3", 1, "implemented (per-channel scales)"),
    ("int8", 1, "implemented (per-channel scales)"),
]


# -- helpers -----------------------------------------------------------------------------------
def synthetic_embeddings(n: int, dim: int, seed: int, data: str = "gaussian", topics: int = 1000) -> np.ndarray:
    """[n, dim] float32 unit rows, deterministic in `seed`.

    data="gaussian": isotropic Gaussian directions (no structure; the worst case for HNSW).
    data="clustered": each row = a random one of `topics` shared topic directions (fixed seed, so
    data and queries share them) plus as much isotropic noise again (cosine ~0.7 to its topic),
    closer to real sentence embeddings, whose neighbours are meaningfully nearer than the rest.
    """
    rng = np.random.default_rng(seed)
    centres = None
    if data == "clustered":
        centres = np.random.default_rng(12345).standard_normal((topics, dim), dtype=np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((n, dim), dtype=np.float32)
    block = 1 << 16
    for lo in range(0, n, block):
        m = min(block, n - lo)
        x = rng.standard_normal((m, dim), dtype=np.float32)
        if centres is not None:
            x = centres[rng.integers(0, topics, m)] + x / np.float32(np.sqrt(dim))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[lo : lo + m] = x
    return out


def timed(fn, *a, **kw) -> tuple[float, object]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn(*a, **kw)
    return time.perf_counter() - t0, result


def pct_ms(samples_s: list[float]) -> tuple[float, float]:
    """(median, p99) in milliseconds."""
    a = np.asarray(samples_s) * 1e3
    return float(np.median(a)), float(np.percentile(a, 99))


def fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def limit_threads(n: int, console: Console) -> contextlib.AbstractContextManager:
    """Limit BLAS and OpenMP pools (numpy's and faiss's) to n threads; n == 0 leaves them alone."""
    if n == 0:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415 - optional
    except ImportError:
        console.print("[yellow]threadpoolctl is not installed: only faiss's OpenMP threads are limited[/]")
        if faiss_available():
            import faiss  # noqa: PLC0415

            faiss.omp_set_num_threads(n)
        return contextlib.nullcontext()
    return threadpool_limits(limits=n)


def make_console() -> Console:
    console = Console()
    if not console.is_terminal:  # piped / CI: do not wrap wide tables at 80 columns
        console = Console(width=160)
    return console


# -- (a) search latency ----------------------------------------------------------------------
def search_latency(args: argparse.Namespace, console: Console) -> None:
    """Median / p99 single-query latency and build time: ExactIndex vs FaissIndex vs faiss HNSW."""
    if not faiss_available():
        console.print("[yellow]search latency: faiss is not installed; timing ExactIndex only[/]")
    faiss = None
    if faiss_available():
        import faiss  # noqa: PLC0415

    sizes = args.sizes or ([10**3, 10**4, 10**5] if args.quick else [10**3, 10**4, 10**5, 10**6])
    dim, k, nq = args.dim, args.k, args.queries
    queries = synthetic_embeddings(nq + args.warmup, dim, seed=args.seed + 1, data=args.data)
    gpu = faiss is not None and faiss.get_num_gpus() > 0

    table = Table(
        title=f"Fact retrieval: single-query top-{k} latency, {dim}-d embeddings, {nq} queries per N",
        caption=(
            f"build = add() of all N vectors (s); latency = median / p99 per query (ms). "
            f"FaissIndex = IndexIDMap2(IndexFlatIP) on {'GPU' if gpu else 'CPU'}; "
            f"HNSW = IndexHNSWFlat(M={args.hnsw_m}, efSearch={args.ef_search}, inner product) on CPU. "
            f"flat==exact: fraction of queries with identical top-{k} ids. Data: {DATA_HELP[args.data]}. "
            f"{os.cpu_count()} CPUs; queries ran with "
            f"{args.threads or 'default'} BLAS/OpenMP thread(s), builds with the library defaults."
        ),
    )
    for col in ("N", "build exact", "build faiss", "build HNSW"):
        table.add_column(col, justify="right")
    for col in ("exact p50/p99", "faiss flat p50/p99", "HNSW p50/p99"):
        table.add_column(col, justify="right")
    table.add_column(f"HNSW recall@{k}", justify="right")
    table.add_column("flat==exact", justify="right")

    for n in sizes:
        console.print(f"[dim]search latency: N={n:,}: generating and building...[/]")
        x = synthetic_embeddings(n, dim, seed=args.seed, data=args.data)
        ids = np.arange(n, dtype=np.int64)
        methods: dict[str, object] = {}
        builds: dict[str, float] = {}
        builds["exact"], methods["exact"] = timed(_build_exact, dim, ids, x)
        if faiss is not None:
            builds["faiss"], methods["faiss"] = timed(_build_faiss, dim, ids, x)
            console.print(f"[dim]  exact {builds['exact']:.2f}s, faiss flat {builds['faiss']:.2f}s; HNSW...[/]")
            builds["hnsw"], methods["hnsw"] = timed(_build_hnsw, faiss, dim, x, args.hnsw_m, args.ef_search)
        del x
        gc.collect()

        search = {
            "exact": lambda q: methods["exact"].search(q, k)[1][0],
            "faiss": lambda q: methods["faiss"].search(q, k)[1][0],
            "hnsw": lambda q: methods["hnsw"].search(q[None, :], k)[1][0],
        }
        names = [m for m in ("exact", "faiss", "hnsw") if m in methods]
        lat: dict[str, list[float]] = {m: [] for m in names}
        found: dict[str, list[np.ndarray]] = {m: [] for m in names}
        with limit_threads(args.threads, console):
            for qi, q in enumerate(queries):
                order = names[qi % len(names) :] + names[: qi % len(names)]  # rotate who goes first
                for m in order:
                    t0 = time.perf_counter()
                    got = search[m](q)
                    dt = time.perf_counter() - t0
                    if qi >= args.warmup:
                        lat[m].append(dt)
                        found[m].append(got)

        def cell(m: str) -> str:
            if m not in lat:
                return "-"
            p50, p99 = pct_ms(lat[m])
            return f"{p50:.3f} / {p99:.3f}"

        recall = agree = "-"
        if "hnsw" in found:
            hits = [len(np.intersect1d(h, e)) / k for h, e in zip(found["hnsw"], found["exact"])]
            recall = f"{np.mean(hits):.3f}"
        if "faiss" in found:
            same = [np.array_equal(f, e) for f, e in zip(found["faiss"], found["exact"])]
            agree = f"{np.mean(same):.2f}"
        table.add_row(
            f"{n:,}",
            f"{builds['exact']:.2f}s",
            f"{builds['faiss']:.2f}s" if "faiss" in builds else "-",
            f"{builds['hnsw']:.2f}s" if "hnsw" in builds else "-",
            cell("exact"),
            cell("faiss"),
            cell("hnsw"),
            recall,
            agree,
        )
        del methods, search
        gc.collect()
    console.print(table)


def _build_exact(dim: int, ids: np.ndarray, x: np.ndarray) -> ExactIndex:
    idx = ExactIndex(dim)
    idx.add(ids, x)
    return idx


def _build_faiss(dim: int, ids: np.ndarray, x: np.ndarray) -> FaissIndex:
    idx = FaissIndex(dim)
    idx.add(ids, x)
    return idx


def _build_hnsw(faiss, dim: int, x: np.ndarray, m: int, ef_search: int):  # noqa: ANN001
    idx = faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    idx.hnsw.efSearch = ef_search
    idx.add(x)  # x is already normalised; ids are row numbers, as in the other indexes
    return idx


# -- (b) KV bytes per fact -------------------------------------------------------------------
def kv_bytes(args: argparse.Namespace, console: Console) -> None:
    """KV bytes per token / per fact by dtype: computed from the shape, measured from a Store shard."""
    L, H, D = SMOLLM2["num_layers"], SMOLLM2["num_kv_heads"], SMOLLM2["head_dim"]
    T, nf = args.fact_tokens, args.facts
    measured = _measure_store(L, H, D, T, nf, args.seed)

    table = Table(
        title=(
            f"KV bytes per fact, {SMOLLM2['name']} shape ({L} layers x {H} KV heads x head_dim {D}), "
            f"{T}-token facts"
        ),
        caption=(
            f"computed = 2 * {L} * {H} * {D} * itemsize * tokens. measured = on-disk size of one Store "
            f"shard holding {nf} random {T}-token facts, / {nf} (includes int32 token ids and the "
            "safetensors header; no embedding - storing a 384-d float32 embedding adds 1,536 B/fact). "
            "manifest = manifest.json bytes / fact. fp8/int8 shards also hold their scales (2 * L * H * D float32 "
            "per fact)."
        ),
    )
    for col in ("dtype", "B/elem", "KV B/token", f"KV B/fact ({T} tok)", "measured B/fact", "measured/computed",
                "manifest B/fact", "facts per GiB", "status"):
        table.add_column(col, justify="right" if col not in ("dtype", "status") else "left")
    for name, itemsize, status in KV_DTYPES:
        per_token = 2 * L * H * D * itemsize
        per_fact = per_token * T
        m = measured.get(name)
        table.add_row(
            name,
            str(itemsize),
            fmt_bytes(per_token),
            fmt_bytes(per_fact),
            fmt_bytes(m["shard"]) if m else "-",
            f"{m['shard'] / per_fact:.4f}" if m else "-",
            fmt_bytes(m["manifest"]) if m else "-",
            f"{2**30 / (m['shard'] if m else per_fact):,.0f}",
            status,
        )
    console.print(table)


def _measure_store(L: int, H: int, D: int, T: int, nf: int, seed: int) -> dict[str, dict[str, float]]:
    """{dtype: {"shard": bytes per fact, "manifest": bytes per fact}} from real Store writes."""
    rng = np.random.default_rng(seed)
    facts = []
    for i in range(nf):
        k = rng.standard_normal((L, T, H, D), dtype=np.float32)
        v = rng.standard_normal((L, T, H, D), dtype=np.float32)
        facts.append(FactKV(f"fact-{i:04d}", rng.integers(0, 49152, T), k, v, text=f"synthetic fact number {i}"))
    out = {}
    with tempfile.TemporaryDirectory(prefix="inferscale-bench-") as tmp:
        for dtype in ("float32", "float16", "bfloat16", "float8_e4m3", "int8"):
            meta = StoreMeta(
                model_fingerprint="benchmark" + "0" * 55,
                num_layers=L,
                num_kv_heads=H,
                head_dim=D,
                rope={"theta": SMOLLM2["rope_theta"], "rotary_dim": D, "style": "split"},
            ).with_dtype(dtype)
            path = Path(tmp) / dtype
            store = Store.create(path, meta)
            store.put(facts)
            shard = sum(p.stat().st_size for p in (path / "shards").iterdir())
            out[dtype] = {"shard": shard / nf, "manifest": (path / Store.MANIFEST).stat().st_size / nf}
    return out


# -- (c) ingest --------------------------------------------------------------------------------
def ingest_throughput(args: argparse.Namespace, console: Console) -> None:
    """Facts/s through the memory service with the real engine (SmolLM2 by default) and MiniLM:
    embedding, Context-Window Encoding, KV shard, SQLite commit and index save, per batch size."""
    import tempfile

    from inferscale.evaluation.datasets import load_demo
    from inferscale.default_model import default_cache_dir
    from inferscale.models import resolve_model
    from inferscale.jax.engine import Engine
    from inferscale.jax.engine_config import EngineConfig
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.memory.service import MemoryService
    from inferscale.memory.service_types import MemoryConfig

    model = resolve_model(args.model)
    engine = Engine.from_pretrained(model, EngineConfig(checkpoint_dir=str(default_cache_dir() / "orbax")))
    embedder = MiniLMEmbedder()
    conv = load_demo().conversation
    table = Table(title=f"ingest throughput ({Path(model).name}, {len(conv.facts)} demo facts, JAX engine, MiniLM)")
    for col in ("w", "batch", "facts", "wall s", "facts/s", "KV bytes/fact"):
        table.add_column(col, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up: compile the encoder's shapes once, untimed
        warm = MemoryService(MemoryConfig(root=f"{tmp}/warm", w=5), engine, embedder)
        warm.add("warm", turns=conv.turns, facts=conv.facts)
        for w in (0, 5):
            for batch in (1, 8):
                svc = MemoryService(MemoryConfig(root=f"{tmp}/w{w}b{batch}", w=w), engine, embedder)
                svc.add("u", turns=conv.turns)
                t0 = time.perf_counter()
                for i in range(0, len(conv.facts), batch):
                    svc.add("u", facts=conv.facts[i : i + batch])
                wall = time.perf_counter() - t0
                store = svc.store("u")
                kv_bytes_total = sum(s["bytes"] for s in store._manifest["shards"].values())
                table.add_row(str(w), str(batch), str(len(conv.facts)), f"{wall:.2f}",
                              f"{len(conv.facts) / wall:.1f}", fmt_bytes(kv_bytes_total / len(conv.facts)))
                svc.close()
    console.print(table)


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="N up to 1e5 instead of 1e6")
    p.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=None,
                   help="comma-separated N values for the search benchmark (overrides --quick), e.g. 1e3,1e4")
    p.add_argument("--data", choices=sorted(DATA_HELP), default="gaussian",
                   help="synthetic embeddings: " + "; ".join(f"{k} = {v}" for k, v in DATA_HELP.items()))
    p.add_argument("--dim", type=int, default=384, help="embedding dimension (default 384)")
    p.add_argument("--k", type=int, default=10, help="top-k (default 10)")
    p.add_argument("--queries", type=int, default=50, help="timed queries per N (default 50)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up queries per N (default 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="BLAS/OpenMP threads while timing queries (default 1; 0 = library defaults)")
    p.add_argument("--hnsw-m", type=int, default=32, help="HNSW graph degree M (default 32)")
    p.add_argument("--ef-search", type=int, default=64, help="HNSW efSearch (default 64)")
    p.add_argument("--fact-tokens", type=int, default=20, help="tokens per fact for the KV size table (default 20)")
    p.add_argument("--facts", type=int, default=100, help="facts written to the measured store shard (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-search", action="store_true", help="skip the search latency section")
    p.add_argument("--skip-kv", action="store_true", help="skip the KV bytes section")
    p.add_argument("--skip-ingest", action="store_true", help="skip the ingest throughput section")
    p.add_argument("--model", default=None, help="HF model folder for ingest (default: the packaged SmolLM2)")
    p.add_argument("--skip-filtered", action="store_true", help="skip the filtered search section")
    p.add_argument("--filtered-facts", type=lambda s: int(float(s)), default=100_000,
                   help="facts of the user the filtered search section searches (default 1e5)")
    p.add_argument("--catalog", default="", metavar="URL",
                   help="postgresql://... catalog for the filtered search section (default: SQLite in a temp dir)")
    args = p.parse_args(argv)
    for name in ("dim", "k", "queries", "hnsw_m", "ef_search", "fact_tokens", "facts", "filtered_facts"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.warmup < 0 or args.threads < 0:
        p.error("--warmup and --threads must be >= 0")
    if args.sizes is not None and min(args.sizes) <= 0:
        p.error("--sizes must all be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = make_console()
    t0 = time.perf_counter()
    if not args.skip_search:
        search_latency(args, console)
    if not args.skip_kv:
        kv_bytes(args, console)
    if not args.skip_ingest:
        ingest_throughput(args, console)
    if not args.skip_filtered:
        with limit_threads(args.threads, console):
            filtered_search(args, console)
    console.print(f"[dim]done in {time.perf_counter() - t0:.1f}s[/]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
