"""KV dtypes side by side: what a fact token costs in the store and what each dtype does to answers.

One JAX engine on SmolLM2-135M-Instruct (the default model) and one LoCoMo conversation. The
facts any question needs are encoded once (Context-Window Encoding, `--w` turns, float32) and
written to one store per dtype (float32, float16, bfloat16, int8 and float8_e4m3 with per-channel
scales); every request reads its facts back from its dtype's store with `Store.get` (verified
shard, the reference dequantisation to float32, in numpy; the fused dequantising kernels that
serving uses compute the same values and are checked against it by the tests). For each question and each k, the top-k facts (MiniLM,
exact cosine) are the same for every dtype, and the dtypes answer in rotating order so machine
noise hits all alike. Reported per (k, dtype):

* bytes per fact token: the store's shard files on disk / the fact tokens they hold (scales,
  token ids and safetensors headers included);
* first-token KL(float32 || dtype) of the next-token distribution after the prompt, and how often
  the argmax equals float32's;
* LoCoMo F1 of the greedy answer (`--max-tokens`), its difference from float32's with a 95% paired
  bootstrap interval over questions, and how many answers equal float32's word for word;
* time to first token, medians: engine-only (the engine's answer call: composition, injection,
  prefill of the question) and end to end (+ reading the k facts from the store, dequantisation
  included), each over the question alone with no memory (the floor, timed in the same rotation).

    python benchmarks/kv_dtypes.py --quick                    # 8 questions, k=10 (~5 min on 2 cores)
    python benchmarks/kv_dtypes.py --questions 30             # 30 questions of conv-26, k=10 and 50 (~35 min)
    python benchmarks/kv_dtypes.py --questions 80 --k 10,50 --json runs/kv-dtypes.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench_args import int_list, positive  # benchmarks/ is the script's folder
from fidelity import kl, log_softmax64, select_questions

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

from inferscale.evaluation.locomo import load_locomo  # noqa: E402

from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH
from inferscale.retrieval.vector_index import ExactIndex  # noqa: E402
from inferscale.evaluation.qa_metrics import locomo_f1  # noqa: E402
from inferscale.common.storage.local_store import Store  # noqa: E402
from inferscale.common.modes import KV_DTYPES

QUICK = {"questions": 8, "k": (10,)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Bytes, first-token KL, LoCoMo F1 and TTFT per stored KV dtype "
                                            "(JAX engine, the same retrieved facts for every dtype).")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--conversation", default="conv-26", help="LoCoMo conversation id (default conv-26)")
    p.add_argument("--questions", type=positive, default=40, help="questions, sampled with --seed (default 40)")
    p.add_argument("--k", type=int_list(1), default=(10, 50), help="retrieved facts per question (default 10,50)")
    add_flags(p, EngineSettings, defaults={"w": 5})
    p.add_argument("--dtypes", default=",".join(KV_DTYPES),
                   help=f"store dtypes, comma-separated, float32 first (default {','.join(KV_DTYPES)})")
    p.add_argument("--max-tokens", type=positive, default=16,
                   help="answer tokens (default 16; LoCoMo's gold answers are a few words)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK}")
    p.add_argument("--json", default=None, help="write rows and the summary to this file")
    args = p.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    bad = [d for d in dtypes if d not in KV_DTYPES]
    if bad or not dtypes or dtypes[0] != "float32":
        p.error(f"--dtypes must start with float32 and name only {', '.join(KV_DTYPES)}; got {args.dtypes!r}")
    args.dtypes = dtypes
    if args.w < 0:
        p.error(f"--w must be >= 0, got {args.w}")
    if args.quick:
        args.questions, args.k = QUICK["questions"], QUICK["k"]
    from inferscale.models import resolve_model

    args.model = str(resolve_model(args.model))  # the default model is converted on first use
    return args


def store_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "shards").iterdir())


def paired_bootstrap(diffs: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """95% interval of the mean of paired differences, resampling questions."""
    if not diffs:
        return float("nan"), float("nan")
    d = np.asarray(diffs)
    means = np.random.default_rng(seed).choice(d, (n, len(d))).mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def run(args: argparse.Namespace, console) -> dict:
    from tqdm.auto import tqdm

    from inferscale.jax.engine import Engine
    from inferscale.retrieval.embedders import MiniLMEmbedder

    path = Path(args.path) if args.path else (REPO_ROOT / DEFAULT_LOCOMO_PATH).resolve()
    sample = next((s for s in load_locomo(path) if s.conversation.id == args.conversation), None)
    if sample is None:
        raise SystemExit(f"no conversation {args.conversation!r} in {path}")
    conv = sample.conversation
    qs = select_questions(sample.questions, args.questions, args.seed)
    embedder = MiniLMEmbedder()
    index = ExactIndex(embedder.dim)
    index.add(range(len(conv.facts)), embedder.embed([f.text for f in conv.facts]))
    _, top = index.search(embedder.embed([q.question for q in qs]), min(max(args.k), len(conv.facts)))
    picks = {(qi, k): sorted(int(i) for i in top[qi][:k]) for qi in range(len(qs)) for k in args.k}
    needed = sorted({i for v in picks.values() for i in v})
    console.print(f"{conv.id}: {len(qs)} questions, k={list(args.k)}, {len(needed)} facts to encode at w={args.w}")

    engine = Engine.from_pretrained(args.model)
    t = time.perf_counter()
    kvs = engine.encode_facts([conv.facts[i] for i in needed], conv, args.w,
                              progress=lambda it: tqdm(it, desc=f"encode w={args.w}", unit="batch",
                                                       dynamic_ncols=True))
    encode_s = time.perf_counter() - t
    tokens = sum(kv.num_tokens for kv in kvs)
    console.print(f"encoded {len(kvs)} facts ({tokens} tokens) in {encode_s:.0f} s")

    tmp = Path(tempfile.mkdtemp(prefix="inferscale-kv-dtypes-"))
    try:
        stores, nbytes = {}, {}
        for d in args.dtypes:
            Store.create(tmp / d, engine.store_meta(args.w).with_dtype(d)).put(kvs)
            stores[d] = Store.open(tmp / d)
            nbytes[d] = store_bytes(tmp / d) / tokens
        fact_id = {i: kv.fact_id for i, kv in zip(needed, kvs)}
        methods = ("none",) + args.dtypes
        rows, first = [], {}
        warm = [fact_id[i] for i in needed[: max(args.k)]]
        for d in args.dtypes:  # compile every shape once, untimed
            engine.answer("warm-up", stores[d].get(warm[: min(args.k)]), max_new_tokens=2)
        engine.answer("warm-up", [], max_new_tokens=2)
        bar = tqdm(total=len(qs) * len(args.k) * len(methods), desc="answers", unit="call", dynamic_ncols=True)
        for qi, q in enumerate(qs):
            for k in args.k:
                ids = [fact_id[i] for i in picks[(qi, k)]]
                rot = qi % len(methods)
                for m in methods[rot:] + methods[:rot]:
                    t0 = time.perf_counter()
                    facts = [] if m == "none" else stores[m].get(ids)
                    read_s = time.perf_counter() - t0
                    ans = engine.answer(q.question, facts, max_new_tokens=args.max_tokens)
                    row = {"question": q.question, "category": q.category, "k": k, "method": m,
                           "answer": ans.text, "f1": locomo_f1(ans.text, q.answer, q.category),
                           "ttft_engine_s": ans.ttft_s, "ttft_e2e_s": read_s + ans.ttft_s,
                           "inject_s": ans.timings.get("inject", 0.0)}
                    if m != "none":
                        row["logp"] = log_softmax64(engine.score(q.question, facts, [])[:1])
                    rows.append(row)
                    bar.update(1)
                first[(qi, k)] = {r["method"]: r for r in rows[-len(methods):]}
        bar.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    summary = []
    for k in args.k:
        groups = [first[(qi, k)] for qi in range(len(qs))]
        floor_e = statistics.median(g["none"]["ttft_engine_s"] for g in groups)
        floor_x = statistics.median(g["none"]["ttft_e2e_s"] for g in groups)
        for d in args.dtypes:
            ref = [g["float32"] for g in groups]
            cur = [g[d] for g in groups]
            kls = [float(kl(r["logp"], c["logp"])[0]) for r, c in zip(ref, cur)]
            diffs = [c["f1"] - r["f1"] for r, c in zip(ref, cur)]
            lo, hi = paired_bootstrap(diffs, args.seed)
            e = statistics.median(c["ttft_engine_s"] for c in cur)
            x = statistics.median(c["ttft_e2e_s"] for c in cur)
            summary.append({
                "k": k, "dtype": d, "bytes_per_token": nbytes[d], "kl_first_mean": float(np.mean(kls)),
                "kl_first_max": float(np.max(kls)),
                "top1_agree": float(np.mean([np.argmax(r["logp"][0]) == np.argmax(c["logp"][0])
                                             for r, c in zip(ref, cur)])),
                "f1": float(np.mean([c["f1"] for c in cur])), "f1_delta": float(np.mean(diffs)),
                "f1_delta_ci": [lo, hi], "same_answer": float(np.mean([r["answer"] == c["answer"]
                                                                       for r, c in zip(ref, cur)])),
                "ttft_engine_s": e, "ttft_e2e_s": x, "floor_engine_s": floor_e, "floor_e2e_s": floor_x,
                "engine_over_floor": e / floor_e, "e2e_over_floor": x / floor_x,
                "inject_s": statistics.median(c["inject_s"] for c in cur)})
    for r in rows:
        r.pop("logp", None)
    return {"summary": summary, "rows": rows, "encode_s": encode_s, "facts": len(kvs), "tokens": tokens,
            "questions": len(qs), "conversation": conv.id, "w": args.w}


def print_table(console, result: dict) -> None:
    from rich.table import Table

    table = Table(title=f"KV dtypes: {result['conversation']}, {result['questions']} questions, w={result['w']} "
                        "(KL, top-1 and same answer against float32; TTFT medians and their ratio to the "
                        "question alone)")
    for col in ("k", "dtype", "B/token", "KL mean", "KL max", "top-1", "F1", "F1 - fp32 [95% CI]", "same",
                "TTFT engine", "TTFT e2e"):
        table.add_column(col, justify="right")
    for s in result["summary"]:
        lo, hi = s["f1_delta_ci"]
        table.add_row(str(s["k"]), s["dtype"], f"{s['bytes_per_token']:,.0f}", f"{s['kl_first_mean']:.1e}",
                      f"{s['kl_first_max']:.1e}", f"{s['top1_agree']:.0%}", f"{s['f1']:.3f}",
                      f"{s['f1_delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]", f"{s['same_answer']:.0%}",
                      f"{s['ttft_engine_s'] * 1e3:.0f} ms ({s['engine_over_floor']:.2f}x)",
                      f"{s['ttft_e2e_s'] * 1e3:.0f} ms ({s['e2e_over_floor']:.2f}x)")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table
    t = time.perf_counter()
    result = run(args, console)
    print_table(console, result)
    console.print(f"wall {time.perf_counter() - t:.0f} s (encoding {result['encode_s']:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
