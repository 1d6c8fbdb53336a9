"""The CPU fast paths against their references, side by side in one run (the CPU counterpart of
`gpu_check.py`): `--parts attention,rotation` (default both).

attention: the torch encoder's masked rows, tiled attention (each query tile over only the keys it
sees, `inferscale.encoders.tiled_attention`) vs dense masked SDPA (its reference). The same LoCoMo facts as `benchmarks/ingest.py` (`--facts` in a row from `--offset`), encoded with
the two encodings whose rows carry a mask: one-pass (prefix trees of the turn-window items) and the
conversation encoding (spans with turn windows). Two encoders on one model differ only in
`attention`; for each (w, encoding) they alternate which goes first in each of `--repeats` rounds,
after one untimed warm-up each. Reported: medians, the speed-up of tiled over dense, and the max
|K, V difference| between them (the same attention up to float summation order).

rotation: the connector's per-layer work for one load on CPU (`inferscale.vllm.kernels.compact.layer_kv`:
stored K and V to the cache's float32, keys rotated to their serving positions), the two fast paths
(the Numba kernels of `inferscale.vllm.kernels.cpu_kernels`, the connector's default, and `rotate_torch`)
vs the torch references, for `--tokens` positions (k=50 LoCoMo facts: about 2,000) in
`--load-facts` facts of the model's shape, per stored dtype, on one thread (as vLLM's CPU worker
runs), `--rounds` rounds of every layer in rotating order, medians; max |dK| from the reference.

write: the same load, all the way into vLLM's CPU paged cache (per `--cache-dtypes`: float32, the
"vec" layout; bfloat16, "amx" on CPUs with AMX), per stored dtype: the part joined, `layer_kv`
(Numba, rounded to the cache's dtype) and the attention backend's own cache write per layer
(`cpu_attn_reshape_and_cache`, what `do_kv_cache_update` runs), vs `compact.write_paged` (the
connector's CPU path: one Numba pass from the facts as stored into the slots, in the layout
learned from the backend's write, full blocks in streaming stores), the same kernel with plain
stores ("plain": each store first reads the cache line it fills), and the same split over
`--write-threads` threads by layer
(`write_threads.split_write`, as the connector splits a load over the cores vLLM's worker computes on;
default 2); alternating rounds, medians, and whether the caches are all bit-equal.

embedding: the retrieval query's embedding (all-MiniLM-L6-v2) on one thread, ONNX Runtime (the
default on CPU) vs sentence-transformers on torch vs ONNX with int8 query weights
(`MiniLMEmbedder(query_weights="int8")`), for each of `--queries` LoCoMo questions, alternating,
`--rounds` rounds; medians and the max |difference| of the ONNX vectors from torch's; then both ONNX
networks again with 600 MiB streamed through the CPU caches before each query (as the engine's
forward pass does between two requests: the embedder's weights are no longer cached). Then what
int8 query weights change in retrieval, over every LoCoMo question (facts embedded in float32 as
stored): the share of each top-k (`--retrieval-k`) found by both, and evidence recall of each.

    python benchmarks/cpu_paths.py                       # attention at w=20 (24 facts from 40), rotation, write
    python benchmarks/cpu_paths.py --parts attention --w 5,20,50 --repeats 2
    python benchmarks/cpu_paths.py --parts attention --encodings conversation --repeats 7
    python benchmarks/cpu_paths.py --parts rotation,write   # seconds
    python benchmarks/cpu_paths.py --parts embedding
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import int_list, positive, print_rows  # benchmarks/ is the script's folder

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

ENCODINGS = ("one-pass", "conversation")
PARTS = ("attention", "rotation", "write", "embedding")
ROTATION_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3")
ROTATION_WAYS = ("reference", "torch", "numba")
WRITE_WAYS = ("backend", "plain", "write_paged", "split")
CACHE_DTYPES = ("float32", "bfloat16")
EVICT_BYTES = 600 << 20  # embedding: streamed through the CPU caches before each "cold" query


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The CPU fast paths (tiled encoder attention, the connector's "
                                            "rotation, the paged-cache write, the query embedding) against their references.")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversation", default="conv-26", help="LoCoMo conversation id (default conv-26)")
    p.add_argument("--offset", type=int, default=40, help="first fact (default 40)")
    p.add_argument("--facts", type=positive, default=24, help="facts in a row from --offset (default 24)")
    p.add_argument("--w", type=int_list(0), default=(20,), help="windows in turns (default 20)")
    p.add_argument("--encodings", default=",".join(ENCODINGS),
                   help=f"attention: comma-separated, of {', '.join(ENCODINGS)} (default both)")
    p.add_argument("--repeats", type=positive, default=3, help="attention: timed rounds per way (default 3)")
    p.add_argument("--batch-size", type=positive, default=8, help="rows per forward (default 8)")
    p.add_argument("--tokens", type=positive, default=2000, help="rotation, write: positions in one load (default 2000)")
    p.add_argument("--load-facts", type=positive, default=50, help="rotation, write: facts they come from (default 50)")
    p.add_argument("--rounds", type=positive, default=7,
                   help="rotation, write, embedding: timed rounds per way (default 7)")
    p.add_argument("--write-threads", type=positive, default=2,
                   help="write: threads the split write uses (default 2)")
    p.add_argument("--queries", type=positive, default=20, help="embedding: LoCoMo questions timed (default 20)")
    p.add_argument("--retrieval-k", type=int_list(1), default=(10, 50),
                   help="embedding: k of the int8-vs-float32 retrieval comparison (default 10,50)")
    p.add_argument("--retrieval-conversations", type=positive, default=None,
                   help="embedding: the first N LoCoMo conversations in that comparison (default all 10)")
    p.add_argument("--cache-dtypes", default="float32,bfloat16",
                   help="write: vLLM cache dtypes, comma-separated (default float32,bfloat16; each in the layout "
                        "vLLM's CPU backend picks for it here, learned as the connector learns it)")
    args = p.parse_args(argv)
    for name, allowed in (("parts", PARTS), ("encodings", ENCODINGS), ("cache_dtypes", CACHE_DTYPES)):
        got = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            p.error(f"--{name.replace('_', '-')} must name {' and/or '.join(allowed)}; got {','.join(bad) or 'nothing'}")
        setattr(args, name, got)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from inferscale.models import resolve_model

    model = str(resolve_model(args.model))
    out = {}
    if "attention" in args.parts:
        out["attention"] = bench_attention(args, model)
    if "rotation" in args.parts:
        out["rotation"] = bench_rotation(args, model)
    if "write" in args.parts:
        out["write"] = bench_write(args, model)
    if "embedding" in args.parts:
        out["embedding"] = bench_embedding(args)
    return out


def bench_attention(args, model: str) -> list[dict]:
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo
    from inferscale.encoders.tiled_attention import ATTENTION_IMPLS
    from inferscale.encoders.torch_encoder import TorchFactEncoder

    sample = next((s for s in load_locomo(REPO_ROOT / DEFAULT_LOCOMO_PATH) if s.conversation.id == args.conversation),
                  None)
    if sample is None:
        raise SystemExit(f"no conversation {args.conversation!r}")
    conv = sample.conversation
    facts = conv.facts[args.offset: args.offset + args.facts]
    if len(facts) < args.facts:
        raise SystemExit(f"--offset {args.offset}: {conv.id} has {len(conv.facts)} facts")
    encs = {a: TorchFactEncoder(model, batch_size=args.batch_size, attention=a) for a in ATTENTION_IMPLS}
    print(f"{conv.id}: facts {args.offset}..{args.offset + len(facts) - 1}, w={list(args.w)}, "
          f"{args.repeats} rounds per way", flush=True)
    rows = []
    for w in args.w:
        windows = [conv.context_window(f, w) for f in facts]
        spans = [conv.context_span(f, w) for f in facts]
        run = {
            "one-pass": lambda e: [(kv.k, kv.v) for kv in e.encode_windowed(facts, windows, w)],
            "conversation": lambda e: [(kv.k, kv.v) for kv in e.encode_conversation(facts, spans, w)],
        }
        for enc in args.encodings:
            outs = {a: run[enc](e) for a, e in encs.items()}  # warm-up
            times = {a: [] for a in encs}
            for r in range(args.repeats):
                for a in (ATTENTION_IMPLS if r % 2 == 0 else ATTENTION_IMPLS[::-1]):
                    t = time.perf_counter()
                    outs[a] = run[enc](encs[a])
                    times[a].append(time.perf_counter() - t)
                    print(f"  w={w} {enc} round {r + 1}/{args.repeats} {a}: {times[a][-1]:.2f} s", flush=True)
            diff = max(float(np.abs(x[j] - y[j]).max()) for x, y in zip(outs["tiled"], outs["sdpa"]) for j in (0, 1))
            med = {a: statistics.median(t) for a, t in times.items()}
            rows.append({"w": w, "encoding": enc, "tiled_s": med["tiled"], "sdpa_s": med["sdpa"], "max_kv_diff": diff})
    print()
    print_rows("Masked rows, tiled vs dense attention (the same facts; medians)",
               ("w", "encoding", "dense s", "tiled s", "speed-up", "max |dKV|"),
               [(str(r["w"]), r["encoding"], f"{r['sdpa_s']:.2f}", f"{r['tiled_s']:.2f}",
                 f"{r['sdpa_s'] / r['tiled_s']:.2f}x", f"{r['max_kv_diff']:.1e}") for r in rows])
    return rows


def _random_facts(args, spec) -> list:
    """`--load-facts` facts of random float32 K / V in the model's shape, `--tokens` in all."""
    from inferscale.common.storage.format import FactKV

    rng = np.random.default_rng(0)
    sizes = np.diff(np.linspace(0, args.tokens, args.load_facts + 1).astype(int))
    kv = [rng.standard_normal((spec.num_layers, int(n), spec.num_kv_heads, spec.head_dim)).astype(np.float32)
          for n in sizes]
    return [FactKV(f"f{i}", np.arange(len(k[0])), k, 0.5 * k) for i, k in enumerate(kv)]


def _stored(spec, facts: list, dtype: str) -> tuple[list, np.ndarray]:
    """The facts written to a store of `dtype` and read back in its compact layout, and their serving
    positions in a row after a 30-token header."""
    from inferscale.common.storage.format import StoreMeta
    from inferscale.common.storage.local_store import Store

    with tempfile.TemporaryDirectory(prefix="inferscale-cpu-paths-") as tmp:
        st = Store.create(Path(tmp) / "s", StoreMeta.for_model(spec, "0" * 64, dtype=dtype))
        st.put(facts)
        compact = st.get_compact([f.fact_id for f in facts])
    sizes = [f.k.shape[1] for f in facts]
    return compact, np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 30


def bench_rotation(args, model: str) -> list[dict]:
    import torch

    from inferscale.common.model.spec import ModelSpec
    from inferscale.vllm.kernels.compact import gather, layer_kv
    from inferscale.vllm.kernels.chunked_rope import RopeTable

    spec = ModelSpec.from_pretrained(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    facts = _random_facts(args, spec)
    tables = [RopeTable(r, spec.max_position) for r in spec.ropes]
    cpu = torch.device("cpu")
    print(f"rotation: {args.tokens} positions in {len(facts)} facts, {spec.num_layers} layers x "
          f"{spec.num_kv_heads} KV heads x {spec.head_dim}, one torch thread, {args.rounds} rounds per way", flush=True)
    rows = []
    try:
        for dtype in ROTATION_DTYPES:
            compact, starts = _stored(spec, facts, dtype)
            (part,) = gather([(c, 0, c.num_tokens, int(s)) for c, s in zip(compact, starts)])  # one dtype: one part
            pos = torch.from_numpy(part.positions)
            cs = [t(pos) for t in tables]

            def load(path: str):
                out = []
                for i in range(spec.num_layers):
                    r = spec.layer_rope_index(i)
                    out.append(layer_kv(part, i, *cs[r], spec.ropes[r], torch.float32, cpu, path))
                return out

            got = {way: load(way) for way in ROTATION_WAYS}  # warm-up (compiles the kernels)
            times = {w: [] for w in got}
            for rnd in range(args.rounds):
                for j in range(len(ROTATION_WAYS)):
                    way = ROTATION_WAYS[(rnd + j) % len(ROTATION_WAYS)]
                    t = time.perf_counter()
                    got[way] = load(way)
                    times[way].append(time.perf_counter() - t)
            med = {w: statistics.median(t) for w, t in times.items()}
            diff = {w: max(float((a[0] - b[0]).abs().max()) for a, b in zip(got[w], got["reference"]))
                    for w in ("numba", "torch")}
            rows.append({"dtype": dtype, **{f"{w}_s": med[w] for w in ROTATION_WAYS},
                         **{f"{w}_max_k_diff": d for w, d in diff.items()}})
            print(f"  {dtype}: " + ", ".join(f"{w} {med[w] * 1e3:.1f} ms" for w in ROTATION_WAYS), flush=True)
    finally:
        torch.set_num_threads(threads)
    print()
    print_rows(f"The connector's layers for one load of {args.tokens} positions (CPU, one thread; medians)",
               ("stored dtype", "reference ms", "torch ms", "numba ms", "numba vs torch", "numba vs reference",
                "max |dK| torch", "max |dK| numba"),
               [(r["dtype"], f"{r['reference_s'] * 1e3:.1f}", f"{r['torch_s'] * 1e3:.1f}", f"{r['numba_s'] * 1e3:.1f}",
                 f"{r['torch_s'] / r['numba_s']:.2f}x", f"{r['reference_s'] / r['numba_s']:.2f}x",
                 f"{r['torch_max_k_diff']:.1e}", f"{r['numba_max_k_diff']:.1e}") for r in rows])
    return rows


def bench_embedding(args) -> list[dict]:
    import torch

    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo
    from inferscale.retrieval.embedders import MiniLMEmbedder

    samples = load_locomo(REPO_ROOT / DEFAULT_LOCOMO_PATH)
    sample = next((s for s in samples if s.conversation.id == args.conversation), None)
    if sample is None:
        raise SystemExit(f"no conversation {args.conversation!r}")
    queries = [q.question for q in sample.questions[: args.queries]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        onnx = MiniLMEmbedder(runtime="onnx", query_weights="int8")
        ways = {"torch": lambda q, e=MiniLMEmbedder(runtime="torch"): e.embed([q]),
                "onnx": lambda q: onnx.embed([q]), "onnx_int8": onnx.embed_query}
        print(f"embedding: {len(queries)} queries, one thread, {args.rounds} rounds per way", flush=True)
        got = {w: np.stack([np.reshape(f(q), -1) for q in queries]) for w, f in ways.items()}  # warm-up (+ export)
        times = {w: [] for w in ways}
        for rnd in range(args.rounds):
            for q in queries:
                for w in list(ways)[:: 1 if rnd % 2 == 0 else -1]:
                    t = time.perf_counter()
                    ways[w](q)
                    times[w].append(time.perf_counter() - t)
        # as in serving: between two queries the engine's forward pass streams its weights and KV
        # (SmolLM2-135M in float32: 540 MB) through the CPU caches, evicting the embedder's
        big = np.ones(EVICT_BYTES // 8)
        for w in ("onnx", "onnx_int8"):
            times[f"{w}_cold"] = []
        for rnd in range(args.rounds):
            for q in queries:
                for w in ("onnx", "onnx_int8")[:: 1 if rnd % 2 == 0 else -1]:
                    big *= 1.0
                    t = time.perf_counter()
                    ways[w](q)
                    times[f"{w}_cold"].append(time.perf_counter() - t)
        retrieval = _int8_retrieval(onnx, samples[: args.retrieval_conversations], args.retrieval_k)
    finally:
        torch.set_num_threads(threads)
    med = {w: statistics.median(t) for w, t in times.items()}
    row = {f"{w}_s": m for w, m in med.items()}
    row["max_diff"] = float(np.abs(got["onnx"] - got["torch"]).max())
    row["retrieval"] = retrieval
    print()
    print_rows("One query's embedding (all-MiniLM-L6-v2, one thread; medians)",
               ("torch ms", "onnx ms", "int8 ms", "onnx vs torch", "int8 vs onnx",
                f"after {EVICT_BYTES >> 20} MiB streamed: onnx ms", "int8 ms", "int8 vs onnx", "max |d| onnx"),
               [(f"{med['torch'] * 1e3:.1f}", f"{med['onnx'] * 1e3:.1f}", f"{med['onnx_int8'] * 1e3:.1f}",
                 f"{med['torch'] / med['onnx']:.2f}x", f"{med['onnx'] / med['onnx_int8']:.2f}x",
                 f"{med['onnx_cold'] * 1e3:.1f}", f"{med['onnx_int8_cold'] * 1e3:.1f}",
                 f"{med['onnx_cold'] / med['onnx_int8_cold']:.2f}x", f"{row['max_diff']:.1e}")])
    r = retrieval
    print_rows(f"int8 query weights vs float32 over LoCoMo ({r['conversations']} conversations, {r['questions']} "
               f"questions; facts embedded in float32 either way)",
               ("k", "top-k the same facts", "same top-k set", "evidence recall float32", "evidence recall int8"),
               [(str(k), f"{r['overlap'][k]:.3f}", f"{r['same_set'][k]:.3f}", f"{r['recall'][k]['float32']:.3f}",
                 f"{r['recall'][k]['int8']:.3f}") for k in r["overlap"]])
    print(f"query cosine int8 vs float32: min {r['cos_min']:.4f}, median {r['cos_median']:.4f}")
    return [row]


def _int8_retrieval(embedder, samples, ks: tuple[int, ...]) -> dict:
    """Every LoCoMo question's top-k facts of its conversation (exact inner product over the float32
    fact vectors) with the float32 and the int8 query network: how much of the top-k they share, how
    often the whole set is the same, and evidence recall (share of the question's evidence turns that
    are the source of a retrieved fact, as `locomo.py` reports it) of each."""
    overlap = {k: [] for k in ks}
    same = {k: [] for k in ks}
    recall = {k: {"float32": [], "int8": []} for k in ks}
    cos = []
    for n, s in enumerate(samples, 1):
        facts = s.conversation.facts
        if not facts:
            continue
        vecs = embedder.embed([f.text for f in facts])  # [F, 384]
        source = [f.source_turn for f in facts]
        q32 = embedder.embed([q.question for q in s.questions])  # [Q, 384]
        q8 = np.stack([embedder.embed_query(q.question) for q in s.questions])
        cos.append((q32 * q8).sum(1))
        for k in ks:
            top32 = np.argsort(-(q32 @ vecs.T), axis=1, kind="stable")[:, :k]
            top8 = np.argsort(-(q8 @ vecs.T), axis=1, kind="stable")[:, :k]
            for qa, a, b in zip(s.questions, top32, top8):
                overlap[k].append(len(set(a) & set(b)) / len(a))
                same[k].append(set(a) == set(b))
                ev = set(qa.evidence)
                if ev:
                    recall[k]["float32"].append(len(ev & {source[i] for i in a}) / len(ev))
                    recall[k]["int8"].append(len(ev & {source[i] for i in b}) / len(ev))
        print(f"  retrieval: {s.conversation.id} ({n}/{len(samples)}), {len(facts)} facts, {len(s.questions)} "
              "questions", flush=True)
    cos = np.concatenate(cos)
    return {"conversations": len(samples), "questions": int(cos.size), "cos_min": float(cos.min()),
            "cos_median": float(np.median(cos)),
            "overlap": {k: float(np.mean(v)) for k, v in overlap.items()},
            "same_set": {k: float(np.mean(v)) for k, v in same.items()},
            "recall": {k: {w: float(np.mean(x)) for w, x in v.items()} for k, v in recall.items()}}


def bench_write(args, model: str) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from inferscale.common.model.spec import ModelSpec
    from inferscale.vllm.kernels.compact import gather, layer_kv, prepare_paged, write_paged
    from inferscale.vllm.kernels.paged_write import learn_layout
    from inferscale.vllm.kernels.chunked_rope import RopeTable
    from inferscale.vllm.write_threads import split_write

    spec = ModelSpec.from_pretrained(model)
    L, H, D, bs = spec.num_layers, spec.num_kv_heads, spec.head_dim, 32
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    facts = _random_facts(args, spec)
    tables = [RopeTable(r, spec.max_position) for r in spec.ropes]
    layer_rope = [spec.layer_rope_index(i) for i in range(L)]
    blocks = -(-(args.tokens + 30) // bs) + 1
    slots = torch.arange(args.tokens) + 30 + bs  # after a 30-token header, from block 1
    rows = []
    pool = ThreadPoolExecutor(args.write_threads - 1) if args.write_threads > 1 else None
    try:
        for cache_name in args.cache_dtypes:
            cache_dtype = getattr(torch, cache_name)
            isa = _get_attn_isa(cache_dtype, bs, D)  # the ISA vLLM's CPU backend picks for this cache

            def backend_write(k, v, cache, slots_):
                key_cache, value_cache = cache.view(cache.shape[0], H, 2 * bs, -1).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots_, isa, k_scale=1.0, v_scale=1.0,
                                               kv_cache_dtype="auto")

            layout = learn_layout(backend_write, torch.zeros(blocks + 1, H, bs, 2 * D, dtype=cache_dtype), bs, H, D)
            if layout is None:
                raise SystemExit(f"the {isa} layout of {cache_name} caches could not be learned")
            caches = {w: [torch.zeros(blocks + 1, H, bs, 2 * D, dtype=cache_dtype) for _ in range(L)]
                      for w in WRITE_WAYS}
            print(f"write: {args.tokens} positions in {len(facts)} facts into {L} {cache_name} paged caches "
                  f"(vLLM's {isa!r} layout), {args.rounds} rounds per way", flush=True)
            for dtype in ROTATION_DTYPES:
                compact, starts = _stored(spec, facts, dtype)

                def load(way: str):  # a fresh part per load, as the connector stages one per request
                    (part,) = gather([(c, 0, c.num_tokens, int(s)) for c, s in zip(compact, starts)])
                    cs = [t(torch.from_numpy(part.positions)) for t in tables]
                    if way in ("write_paged", "plain"):
                        write_paged(part, list(range(L)), caches[way], slots, cs, spec.ropes, layer_rope, layout,
                                    streaming=way == "write_paged")
                        return
                    if way == "split":  # prepared once, its layers split over the threads
                        write = prepare_paged(part, slots, cs, spec.ropes, layer_rope, layout)
                        split_write(write, list(range(L)), caches[way], pool, args.write_threads)
                        return
                    for i in range(L):
                        r = layer_rope[i]
                        k, v = layer_kv(part, i, *cs[r], spec.ropes[r], cache_dtype, torch.device("cpu"))
                        backend_write(k, v, caches[way][i], slots)

                for way in WRITE_WAYS:  # warm-up (compiles the kernels)
                    load(way)
                equal = all(torch.equal(c[0].view(torch.uint8), c[j].view(torch.uint8))
                            for c in zip(*caches.values()) for j in range(1, len(WRITE_WAYS)))
                times = {w: [] for w in WRITE_WAYS}
                for rnd in range(args.rounds):
                    for way in (WRITE_WAYS if rnd % 2 == 0 else WRITE_WAYS[::-1]):
                        t = time.perf_counter()
                        load(way)
                        times[way].append(time.perf_counter() - t)
                med = {w: statistics.median(t) for w, t in times.items()}
                rows.append({"cache": cache_name, "isa": isa, "dtype": dtype, **{f"{w}_s": med[w] for w in WRITE_WAYS},
                             "bit_equal": equal})
                print(f"  {cache_name} cache, {dtype} store: " + ", ".join(f"{w} {med[w] * 1e3:.1f} ms"
                                                                           for w in WRITE_WAYS), flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        torch.set_num_threads(threads)
    print()
    print_rows(f"One load of {args.tokens} positions into vLLM's CPU paged cache (medians)",
               ("cache (layout)", "stored dtype", "layer_kv + backend write ms", "plain stores ms", "write_paged ms",
                "speed-up", "vs plain", f"split over {args.write_threads} threads ms", "split speed-up",
                "caches bit-equal"),
               [(f"{r['cache']} ({r['isa']})", r["dtype"], f"{r['backend_s'] * 1e3:.1f}", f"{r['plain_s'] * 1e3:.1f}",
                 f"{r['write_paged_s'] * 1e3:.1f}", f"{r['backend_s'] / r['write_paged_s']:.2f}x",
                 f"{r['plain_s'] / r['write_paged_s']:.2f}x",
                 f"{r['split_s'] * 1e3:.1f}", f"{r['write_paged_s'] / r['split_s']:.2f}x",
                 "yes" if r["bit_equal"] else "NO") for r in rows])
    return rows

if __name__ == "__main__":
    main()
