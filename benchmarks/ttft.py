"""Time to first token on vLLM: KV injection vs prefilling the retrieved facts as prompt text.

One `MemoryLLM` (vLLM + InferScale's connector) on SmolLM2-135M-Instruct serves one LoCoMo
conversation's memory (turns + facts, Context-Window Encoding with w=5) for one user. For each
question and each k, the top-k facts are retrieved once (MiniLM + the user's index) and the same
fact ids are served by every method, interleaved in rotating order so machine noise hits all alike:

* joint  - the facts as prompt text, with a fresh random `cache_salt` per request, so vLLM's
           automatic prefix caching cannot help (the Mem0-style baseline: retrieve, paste, prefill);
* apc    - the facts as prompt text with a fixed salt per (user, question, k), sent once untimed
           and then timed: vLLM's automatic prefix cache, warm (the best case for plain vLLM: the
           same prompt seen just before);
* inject - the facts' pre-RoPE KV injected by the connector (MemoryLLM's default salt per user and
           memory version, so blocks that an earlier request of this user injected may come from
           vLLM's prefix cache, as in production); vLLM prefills only the footer and the question;
* inject_cold - the same with a fresh salt per request: every fact is read, rotated and written
           by the connector (no prefix-cache help at all; shows what the cache adds to "inject");
* none   - the floor: the question alone (no memory), fresh salt;
* none_warm - the question alone with its user's salt, so its prompt header comes from vLLM's
           prefix cache as inject's does (the floor a warm production engine gives; the stricter);
           timed once per question (at the first k), since a repeat would find the question cached.

Every request asks for one token (max_tokens=1), so its latency is its time to first token.
End-to-end TTFT = query embedding + search (timed here; the same retrieval for joint, apc and
inject) + composition + the engine call; engine-only TTFT = the engine call alone (`generate`'s
"engine" timing: scheduling, the connector's loads, the forward pass, sampling). Untimed warm-up
requests (every method at every k, on a question that is not timed) run first. While timing, this
process runs torch on `--search-threads` threads (default 1: the query embedding was slower on 2 here).
Reported: medians over questions per (k, method), vLLM's cached-token counts (a check that each
method got the cache state it claims), the ratios joint/inject, apc/inject, inject/none, inject/none_warm
(and the same for inject_cold), the targets at k=50 (joint/inject >= 5x, inject within 1.25x of
each floor), and
how often the first generated token of inject / apc equals joint's.

    python benchmarks/ttft.py --quick          # 80 facts, 5 questions (a few minutes on 2 cores)
    python benchmarks/ttft.py                  # all facts of the conversation, 20 questions
    python benchmarks/ttft.py --k 0,10,50 --questions 10 --json ttft.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench_args import int_list, memory_root, vllm_cpu_env  # benchmarks/ is the script's folder

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

DEFAULT_K = (0, 5, 10, 20, 50)
METHODS = ("joint", "apc", "inject", "inject_cold", "none", "none_warm")
FLOORS = ("none", "none_warm")  # the question alone: does not depend on k
USER = "bench"
W = 5
QUICK_FACTS = 80
TARGET_K = 50
TARGET_SPEEDUP = 5.0  # joint / inject at k=50
TARGET_FLOOR = 1.25  # inject / none at k=50


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH

    p = argparse.ArgumentParser(description="TTFT of KV injection vs joint prefill (with and without vLLM's "
                                            "prefix cache) vs the question alone, on vLLM with one LoCoMo user.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--quick", action="store_true",
                   help=f"first {QUICK_FACTS} facts (and the turns up to the last one's source), 5 questions")
    p.add_argument("--conversation", type=int, default=0, help="index of the LoCoMo conversation (default 0)")
    p.add_argument("--questions", type=int, default=None, help="questions to time (default 20; --quick 5)")
    p.add_argument("--k", type=int_list(0), default=DEFAULT_K,
                   help=f"retrieved facts per question, comma-separated (default {','.join(map(str, DEFAULT_K))})")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed warm-up rounds over every (method, k) on an untimed question (default 1)")
    p.add_argument("--search-threads", type=int, default=1,
                   help="torch threads of this process while timing (query embedding; default 1: vLLM CPU "
                        "binds its worker's threads to cores, and a multi-threaded embedder spin-waits against them; "
                        "0 keeps torch's default)")
    # the engine settings it times, serve's flags (float32 stores: the connector's dequantisation apart)
    add_flags(p, EngineSettings, defaults={"kv_dtype": "float32", "kv_load": "sync", "kv_write": "auto",
                                           "kv_write_threads": None, "query_weights": "auto", "dtype": "float32"})
    p.add_argument("--json", default=None, help="also write every measurement and the summary here")
    args = p.parse_args(argv)
    if args.questions is None:
        args.questions = 5 if args.quick else 20
    if args.questions < 1:
        p.error("--questions must be >= 1")
    args.path = Path(args.path) if args.path else REPO_ROOT / DEFAULT_LOCOMO_PATH
    return args


def select_memory(conv, quick: bool):
    """(turns, facts) to ingest: quick = the first QUICK_FACTS facts and the turns up to the last
    of their source turns (facts come in conversation order); else everything."""
    if not quick:
        return list(conv.turns), list(conv.facts)
    facts = list(conv.facts[:QUICK_FACTS])
    pos = {t.id: i for i, t in enumerate(conv.turns)}
    last = max((pos[f.source_turn] for f in facts if f.source_turn is not None), default=len(conv.turns) - 1)
    return list(conv.turns[: last + 1]), facts


class CachedTokens:
    """Wraps the vLLM `LLM.generate` of a MemoryLLM to keep the last request's `num_cached_tokens`
    (vLLM's prefix-cache hits plus the connector's external tokens), for the report."""

    def __init__(self, llm) -> None:
        self.inner = llm.llm.generate
        self.last: int | None = None
        llm.llm.generate = self

    def __call__(self, *a, **kw):
        outs = self.inner(*a, **kw)
        self.last = getattr(outs[0], "num_cached_tokens", None)
        return outs


def _fresh() -> str:
    return uuid.uuid4().hex


def run_one(llm, cached: CachedTokens, method: str, question: str, k: int, ids: list[str], search_s: float,
            apc_salt: str, user: str = USER, w: int | None = None) -> dict:
    """One timed request of `method` for `user` (whose facts were encoded with window `w`; apc:
    plus its untimed warming request first). A method named "...+end" ("joint+end",
    "inject+last:2+end") serves the memory with its end boundary."""
    end = method.endswith("+end")
    name = method.removesuffix("+end")
    if method == "none":
        out = llm.generate(user, question, mode="none", max_tokens=1, cache_salt=_fresh(), w=w)
        search_s = 0.0  # no retrieval for the question alone
    elif method == "none_warm":
        out = llm.generate(user, question, mode="none", max_tokens=1, w=w)
        search_s = 0.0
    elif method == "apc":
        llm.generate(user, question, mode="text", max_tokens=1, fact_ids=ids, cache_salt=apc_salt, w=w)
        out = llm.generate(user, question, mode="text", max_tokens=1, fact_ids=ids, cache_salt=apc_salt, w=w)
    elif name == "joint":
        out = llm.generate(user, question, mode="text", max_tokens=1, fact_ids=ids, cache_salt=_fresh(), w=w,
                           boundary=end)
    elif name == "inject":
        out = llm.generate(user, question, mode="inject", max_tokens=1, fact_ids=ids, w=w, boundary=end)
    elif method == "inject_cold":
        out = llm.generate(user, question, mode="inject", max_tokens=1, fact_ids=ids, cache_salt=_fresh(), w=w)
    elif name.startswith("inject+"):  # a recovery policy: inject+last:2
        # with the boundary, a salt of its own: the same request without it (same facts, recomputed
        # runs and so salt) would otherwise leave it its recomputed blocks in vLLM's prefix cache
        out = llm.generate(user, question, mode="inject", max_tokens=1, fact_ids=ids, w=w,
                           policy=name.split("+", 1)[1], boundary=end, cache_salt=_fresh() if end else None)
    else:
        raise ValueError(method)
    t = out.timings
    return {"method": method, "k": k, "e2e_s": search_s + out.ttft_s, "engine_s": t["engine"],
            "search_s": search_s, "compose_s": t["compose"], "prompt_tokens": out.num_prompt,
            "planned_injected": out.num_injected, "cached_tokens": cached.last, "token": out.token_ids}


def retrieve(llm, question: str, k: int, user: str = USER, w: int | None = None) -> tuple[list[str], float]:
    """Top-k fact ids and the time of query embedding + search (k=0: no retrieval, no time)."""
    if k == 0:
        return [], 0.0
    t0 = time.perf_counter()
    ids = [f.fact_id for f in llm.memory_for(w).search(user, question, k)]
    return ids, time.perf_counter() - t0


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _stats(sel: list[dict]) -> dict:
    return {"e2e_s": _median([r["e2e_s"] for r in sel]), "engine_s": _median([r["engine_s"] for r in sel]),
            "engine_min_s": min((r["engine_s"] for r in sel), default=None),
            "search_s": _median([r["search_s"] for r in sel]), "compose_s": _median([r["compose_s"] for r in sel]),
            "prompt_tokens": _median([r["prompt_tokens"] for r in sel]),
            "cached_tokens": _median([r["cached_tokens"] for r in sel]), "n": len(sel)}


def summarise(rows: list[dict], ks) -> dict:
    """Medians per (k, method), and ratios of medians. The floors ("none" and "none_warm": the
    question alone) do not depend on k, so the ratios to them use the median of every such request
    (all k pooled)."""
    floors = {m: _stats([r for r in rows if r["method"] == m]) for m in FLOORS}
    out = {"floor": floors["none"], "floor_warm": floors["none_warm"]}
    for k in ks:
        per = {m: _stats([r for r in rows if r["k"] == k and r["method"] == m]) for m in METHODS}
        ratios = {}
        for kind in ("e2e_s", "engine_s"):
            def ratio(a, b):
                x, y = per[a][kind], (floors[b] if b in FLOORS else per[b])[kind]
                return x / y if x and y else None

            ratios[kind] = {"joint/inject": ratio("joint", "inject"), "apc/inject": ratio("apc", "inject"),
                            "inject/none": ratio("inject", "none"), "joint/inject_cold": ratio("joint", "inject_cold"),
                            "inject_cold/none": ratio("inject_cold", "none"),
                            "inject/none_warm": ratio("inject", "none_warm")}
        out[k] = {"median": per, "ratios": ratios}
    return out


def print_report(console, summary: dict, ks, meta: dict) -> dict:
    from rich.table import Table

    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f}"  # noqa: E731
    rx = lambda r: "-" if r is None else f"{r:.2f}x"  # noqa: E731
    tok = lambda n: "-" if n is None else f"{n:.0f}"  # noqa: E731
    table = Table(title=f"TTFT, medians over {meta['questions']} questions (ms)")
    for name in ("k", "method", "prompt tok", "vLLM cached tok", "e2e", "engine", "engine min", "search", "compose"):
        table.add_column(name, justify="left" if name == "method" else "right")
    for k in ks:
        for i, m in enumerate(METHODS):
            x = summary[k]["median"][m]
            table.add_row(str(k) if i == 0 else "", m, tok(x["prompt_tokens"]), tok(x["cached_tokens"]),
                          ms(x["e2e_s"]), ms(x["engine_s"]), ms(x["engine_min_s"]), ms(x["search_s"]),
                          ms(x["compose_s"]), end_section=i == len(METHODS) - 1)
    for name, key in (("none", "floor"), ("none_warm", "floor_warm")):
        f = summary[key]
        table.add_row("all" if name == "none" else "", name, tok(f["prompt_tokens"]), tok(f["cached_tokens"]),
                      ms(f["e2e_s"]), ms(f["engine_s"]), ms(f["engine_min_s"]), ms(f["search_s"]), ms(f["compose_s"]))
    f = summary["floor"]
    console.print(table)
    console.print("e2e = query embedding + search + composition + engine; engine = the vLLM call alone (median, "
                  "and min); search = query embedding + vector search + catalog rows; compose = the prompt layout and "
                  "the injection plan (catalog and store manifest reads); vLLM cached tok = prefix-cache hits + tokens the connector injected. Ratios to "
                  f"'none' and 'none_warm' use their floors over all k (the last rows, {f['n']} requests each); none_warm "
                  "has its prompt header from vLLM's prefix cache, as inject has.")

    names = ("joint/inject", "apc/inject", "inject/none", "inject/none_warm", "joint/inject_cold", "inject_cold/none")
    rt = Table(title="Ratios of medians")
    rt.add_column("k", justify="right")
    rt.add_column("TTFT")
    for n in names:
        rt.add_column(n.replace("/", " /\n"), justify="right")
    for k in ks:
        for kind, label in (("e2e_s", "e2e"), ("engine_s", "engine")):
            r = summary[k]["ratios"][kind]
            rt.add_row(str(k) if kind == "e2e_s" else "", label, *[rx(r[n]) for n in names],
                       end_section=kind == "engine_s")
    console.print(rt)

    verdict = {}
    if TARGET_K in summary:
        r = summary[TARGET_K]["ratios"]
        for kind, label in (("e2e_s", "end-to-end"), ("engine_s", "engine-only")):
            sp, fl = r[kind]["joint/inject"], r[kind]["inject/none"]
            ok_sp = sp is not None and sp >= TARGET_SPEEDUP
            ok_fl = fl is not None and fl <= TARGET_FLOOR
            fw = r[kind]["inject/none_warm"]
            ok_fw = fw is not None and fw <= TARGET_FLOOR
            verdict[kind] = {"joint/inject": sp, "speedup_met": ok_sp, "inject/none": fl, "floor_met": ok_fl,
                             "inject/none_warm": fw, "warm_floor_met": ok_fw}
            met = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
            console.print(f"k={TARGET_K} {label}: joint/inject = {rx(sp)} (target >= {TARGET_SPEEDUP:g}x: "
                          f"{met(ok_sp)}); inject/none = {rx(fl)} (target <= {TARGET_FLOOR:g}x: {met(ok_fl)}); "
                          f"inject/none_warm = {rx(fw)} (<= {TARGET_FLOOR:g}x: {met(ok_fw)})")
        per, f = summary[TARGET_K]["median"], summary["floor"]
        lo = lambda a, b: a / b if a and b else None  # noqa: E731
        mins = {"joint/inject": lo(per["joint"]["engine_min_s"], per["inject"]["engine_min_s"]),
                "inject/none": lo(per["inject"]["engine_min_s"], f["engine_min_s"]),
                "inject/none_warm": lo(per["inject"]["engine_min_s"], summary["floor_warm"]["engine_min_s"])}
        verdict["engine_min"] = mins
        console.print(f"k={TARGET_K} engine-only, ratios of the fastest requests (least disturbed by other load): "
                      f"joint/inject = {rx(mins['joint/inject'])}, inject/none = {rx(mins['inject/none'])}, "
                      f"inject/none_warm = {rx(mins['inject/none_warm'])}")
    else:
        console.print(f"(targets are defined at k={TARGET_K}, which was not run)")
    return verdict


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from rich.console import Console

    from inferscale.evaluation.locomo import load_locomo
    from inferscale.models import resolve_model
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    console = Console()
    if not console.is_terminal:
        console = Console(width=110)  # a log file: room for the tables
    t_start = time.perf_counter()
    samples = load_locomo(args.path)
    if not 0 <= args.conversation < len(samples):
        raise SystemExit(f"--conversation must be in 0..{len(samples) - 1}")
    sample = samples[args.conversation]
    conv = sample.conversation
    turns, facts = select_memory(conv, args.quick)
    questions = [q.question for q in sample.questions[: args.questions]]
    if not questions:
        raise SystemExit(f"conversation {conv.id} has no questions")
    warm_q = "What do you remember about me?"  # warm-up only, never timed
    ks = tuple(dict.fromkeys(args.k))
    if max(ks) > len(facts):
        console.print(f"[yellow]k={max(ks)} > {len(facts)} facts: search returns at most {len(facts)}[/yellow]")

    model = str(resolve_model(args.model))
    root, tmp = memory_root(args.memory_root, "inferscale-ttft-")
    llm = None
    try:
        cfg = MemoryLLMConfig(model=model, memory_root=root, w=W, max_model_len=4096, block_size=32,
                              enable_prefix_caching=True, kv_dtype=args.kv_dtype, kv_load=args.kv_load,
                              kv_write=args.kv_write, kv_write_threads=args.kv_write_threads, dtype=args.dtype,
                              query_weights=args.query_weights)
        t0 = time.perf_counter()
        llm = MemoryLLM(cfg)
        console.print(f"MemoryLLM started in {time.perf_counter() - t0:.1f} s ({model}, {args.dtype}; store KV "
                      f"{args.kv_dtype}, {args.kv_load} loads, {args.kv_write} writes, write threads "
                      f"{args.kv_write_threads or 'as torch'}, {args.query_weights} query embedding)")
        cached = CachedTokens(llm)

        if USER in llm.memory.catalog.users():
            console.print(f"[yellow]memory root already holds user {USER!r}; reusing it[/yellow]")
        else:
            t0 = time.perf_counter()
            llm.memory.add(USER, turns=turns, facts=facts, progress=lambda done, n: print(
                f"ingest: {done}/{n} facts encoded ({time.perf_counter() - t0:.0f} s)", flush=True))
            dt = time.perf_counter() - t0
            console.print(f"ingest: conversation {conv.id}, {len(turns)} turns + {len(facts)} facts at w={W} "
                          f"in {dt:.1f} s ({len(facts) / dt:.1f} facts/s, embedding + encoding + store + index)")

        if args.search_threads > 0:
            import torch

            torch.set_num_threads(args.search_threads)  # after ingest: encoding uses every core
        # warm-up: every method at every k (so every prompt length), on a question that is not timed
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            for k in ks:
                ids, s = retrieve(llm, warm_q, k)
                for m in METHODS:
                    run_one(llm, cached, m, warm_q, k, ids, s, apc_salt=_fresh())
        console.print(f"warm-up: {args.warmup} round(s) in {time.perf_counter() - t0:.1f} s")

        rows = []
        t0 = time.perf_counter()
        slot = 0
        for qi, q in enumerate(questions):
            for k in ks:
                ids, s = retrieve(llm, q, k)
                apc_salt = _fresh()  # fixed for this (user, question, k)
                order = METHODS[slot % len(METHODS):] + METHODS[: slot % len(METHODS)]
                slot += 1
                for m in order:
                    if m == "none_warm" and k != ks[0]:  # once per question: a repeat would find it cached
                        continue
                    r = run_one(llm, cached, m, q, k, ids, s, apc_salt)
                    r["question"] = qi
                    rows.append(r)
            console.print(f"  question {qi + 1}/{len(questions)} done ({time.perf_counter() - t0:.0f} s)")
        timed_s = time.perf_counter() - t0

        # same first token? joint and apc must agree (same prompt, exact KV); inject is approximate
        # (Context-Window Encoding), so it may differ from joint; k=0 injects only the exact header
        agree = {}
        for k in ks:
            a = {"joint==apc": 0, "joint==inject": 0, "total": 0}
            for qi in range(len(questions)):
                tk = {r["method"]: r["token"] for r in rows if r["question"] == qi and r["k"] == k}
                a["total"] += 1
                a["joint==apc"] += tk["joint"] == tk["apc"]
                a["joint==inject"] += tk["joint"] == tk["inject"]
            agree[k] = a

        summary = summarise(rows, ks)
        meta = {"conversation": conv.id, "turns": len(turns), "facts": len(facts), "questions": len(questions),
                "k": list(ks), "w": W, "model": model, "quick": args.quick, "timed_s": timed_s,
                "search_threads": args.search_threads, "kv_load": args.kv_load,
                "kv_write": args.kv_write, "kv_write_threads": args.kv_write_threads,
                "query_weights": args.query_weights}
        verdict = print_report(console, summary, ks, meta)
        console.print("first generated token equal (per k): " + "; ".join(
            f"k={k}: joint==apc {a['joint==apc']}/{a['total']}, joint==inject {a['joint==inject']}/{a['total']}"
            for k, a in agree.items()))
        console.print(f"timed requests: {timed_s:.1f} s; total wall time {time.perf_counter() - t_start:.1f} s")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(
                {"meta": meta, "summary": {str(k): v for k, v in summary.items()}, "targets": verdict,
                 "agreement": {str(k): a for k, a in agree.items()}, "rows": rows}, indent=1))
            console.print(f"wrote {args.json}")
    finally:
        if llm is not None:
            llm.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
