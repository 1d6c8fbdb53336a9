"""The memory chain: time to first token with a user's whole memory, against every other way to
serve it, at several memory sizes and with more users than vLLM's KV cache holds; and what keeping
the chain costs (ingest, an append, an update's re-encode).

One `MemoryLLM` (vLLM + InferScale's connector, SmolLM2 by default) holds users whose memories
are LoCoMo's facts (the ten conversations' observations, pooled, in order). Every request asks one
token of a new LoCoMo question (TTFT end to end: retrieval, composition, injection or load, prefill),
and the systems take turns request by request (machine noise hits all alike); medians reported.

Per memory size (`--sizes`, default 30,100,300 facts):
* `question alone`: no memory (mode none), the floor;
* `text top-k`, `inject top-k`: the k facts retrieved for the question (k=10);
* `text all, cold` / `text all, warm`: the whole memory prefilled as text (k "all"), with vLLM's
  prefix cache cold (a fresh salt) or warm (the same memory asked before);
* `chain, from store`: mode chain with every link stored and vLLM's cache cold (a fresh salt): the
  connector loads the links from the user's store, as after an eviction or a restart (the
  connector's host-memory tier is off, so every load reads the store);
* `chain, cache hit`: mode chain asked again: vLLM's prefix cache holds the memory.

Evicting users (`--users`, each with `--user-facts` facts): rounds of one new question per user,
chain against text with the whole memory, both with vLLM's prefix cache on and the product's salts,
in a KV cache (`--kv-cache-gib`) too small for every user's memory, so prefixes are evicted.

Costs: encoding a memory per fact (Context-Window Encoding's ingest) against encoding it as a chain,
an append of one fact, and the re-encode after an update of the middle fact and of the first.
Answers: chain and text with the whole memory give the same tokens (`--answer-tokens`).

    python benchmarks/chain.py --quick          # sizes 30,100, 6 evicting users (a few minutes)
    python benchmarks/chain.py                  # sizes 30,100,300, 16 evicting users
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from bench_args import int_list, memory_root, positive, print_rows, vllm_cpu_env

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

SYSTEMS = ("question alone", "text top-k", "inject top-k", "text all, cold", "text all, warm", "chain, from store",
           "chain, cache hit")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", nargs="?", default=None, help="locomo10.json (default: ../shared/data/locomo/locomo10.json)")
    p.add_argument("--quick", action="store_true", help="sizes 30,100; 6 evicting users; 2 repeats")
    p.add_argument("--sizes", type=int_list(1), default=None, help="memory sizes in facts (default 30,100,300)")
    p.add_argument("--repeats", type=positive, default=None, help="requests per system and size (default 3)")
    p.add_argument("--k", type=positive, default=10, help="facts retrieved for top-k (default 10)")
    p.add_argument("--users", type=int, default=None, help="evicting users (default 16; 0: skip)")
    p.add_argument("--user-facts", type=positive, default=100, help="facts of each evicting user (default 100)")
    p.add_argument("--rounds", type=positive, default=3, help="questions per evicting user (default 3)")
    p.add_argument("--answer-tokens", type=positive, default=16, help="answer compared chain vs text (default 16)")
    p.add_argument("--model", default=None, help="model folder or registry name (default: SmolLM2-135M-Instruct)")
    add_flags(p, EngineSettings, defaults={"max_model_len": 8192})
    p.add_argument("--kv-cache-gib", type=positive, default=1, help="vLLM CPU's KV cache (default 1 GiB)")
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write every measurement and the summary here")
    a = p.parse_args(argv)
    a.sizes = a.sizes or ((30, 100) if a.quick else (30, 100, 300))
    a.repeats = a.repeats or (2 if a.quick else 3)
    a.users = (6 if a.quick else 16) if a.users is None else a.users
    return a


def pooled_facts(samples, n: int):
    """The first `n` facts of the LoCoMo conversations, one after another (ids made unique; without
    their session dates, which would double a fact's tokens: 300 facts then fit SmolLM2's context)."""
    from inferscale.common.facts import Fact

    out = [Fact(f"c{i}-{f.id}", f.text) for i, s in enumerate(samples) for f in s.conversation.facts]
    if len(out) < n:
        raise SystemExit(f"LoCoMo holds {len(out)} facts; asked for {n}")
    return out[:n]


def ask(llm, system: str, user: str, question: str, k: int, max_tokens: int = 1):
    """One request of `system` (see the module's list); its output."""
    fresh = uuid.uuid4().hex
    if system == "question alone":
        return llm.generate(user, question, mode="none", k=0, max_tokens=max_tokens, cache_salt=fresh, logprobs=None)
    if system in ("text top-k", "inject top-k"):
        return llm.generate(user, question, k=k, mode=system.split()[0], max_tokens=max_tokens,
                            cache_salt=fresh if system.startswith("text") else None, logprobs=None)
    if system.startswith("text all"):
        salt = fresh if system.endswith("cold") else None
        return llm.generate(user, question, k="all", mode="text", max_tokens=max_tokens, cache_salt=salt, logprobs=None)
    salt = fresh if system.endswith("store") else None
    return llm.generate(user, question, mode="chain", max_tokens=max_tokens, cache_salt=salt, logprobs=None)


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def sizes_run(llm, facts, questions, args, log) -> tuple[list[dict], dict]:
    """TTFT per (size, system), and the chain's costs per size."""
    rows, costs = [], {}
    qs = itertools.cycle(questions)
    llm.memory.add("warm-up", facts=facts[:3])  # untimed: the encoder's and the embedder's first calls
    llm.chain.extend("warm-up")
    llm.memory.add("warm-up", facts=[pooled_facts_after(facts, 3)])
    llm.chain.extend("warm-up")
    for n in args.sizes:
        user = f"size{n}"
        ingest_s, _ = timed(lambda: llm.memory.add(user, facts=facts[:n]))
        chain_s, _ = timed(lambda: llm.chain.extend(user))
        status = llm.chain.status(user)
        if status["stored"] != n:
            raise SystemExit(f"{user}: the chain holds {status['stored']} of {n} facts; raise --max-model-len")
        for s in SYSTEMS:  # untimed: each path's first request compiles and allocates; warms "text all, warm"
            ask(llm, s, user, next(qs), args.k)
        q = next(qs)
        chain = ask(llm, "chain, from store", user, q, args.k, args.answer_tokens)
        text = ask(llm, "text all, cold", user, q, args.k, args.answer_tokens)
        costs[n] = {"ingest_per_fact_s": ingest_s, "ingest_chain_s": chain_s, "tokens": text.num_prompt,
                    "same_answer": chain.token_ids == text.token_ids}
        for rep in range(args.repeats):
            order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[: rep % len(SYSTEMS)]
            for s in order:
                out = ask(llm, s, user, next(qs), args.k)
                rows.append({"size": n, "system": s, "ttft_s": out.ttft_s, "prompt_tokens": out.num_prompt,
                             "cached_tokens": out.cached_tokens, "injected_tokens": out.num_injected})
        log(f"{n} facts measured")
        extra = pooled_facts_after(facts, n)
        costs[n]["append_s"], _ = timed(lambda: (llm.memory.add(user, facts=[extra]), llm.chain.extend(user)))
        for label, idx in (("update_middle_s", n // 2), ("update_first_s", 0)):
            fid = llm.memory.list(user)[idx].fact_id
            llm.memory.update(user, fid, f"{facts[idx].text} (corrected)")
            costs[n][label], _ = timed(lambda: llm.chain.extend(user))
        log(f"{n} facts: append and updates measured")
    return rows, costs


def pooled_facts_after(facts, n: int):
    from inferscale.common.facts import Fact

    f = facts[n] if n < len(facts) else facts[0]
    return Fact(f"appended-{n}", f.text)


def evicting_run(llm, facts, questions, args, log) -> list[dict]:
    """Rounds of one question per user, chain against text with the whole memory (product salts)."""
    if not args.users:
        return []
    users = [f"evict{u}" for u in range(args.users)]
    for i, user in enumerate(users):  # each user a different slice of the pool: no two share a prefix
        start = (i * 37) % max(1, len(facts) - args.user_facts)
        llm.memory.add(user, facts=[type(f)(f"{user}-{f.id}", f.text) for f in facts[start:start + args.user_facts]])
        llm.chain.extend(user)
    log(f"{len(users)} evicting users of {args.user_facts} facts stored")
    rows = []
    qs = itertools.cycle(questions)
    for rnd in range(args.rounds):
        for i, user in enumerate(users):
            q = next(qs)
            order = ("chain", "text all") if (rnd + i) % 2 == 0 else ("text all", "chain")
            for s in order:
                mode = "chain" if s == "chain" else "text"
                out = llm.generate(user, q, k="all", mode=mode, max_tokens=1, logprobs=None)
                rows.append({"round": rnd, "user": user, "system": s, "ttft_s": out.ttft_s,
                             "prompt_tokens": out.num_prompt, "cached_tokens": out.cached_tokens})
        log(f"evicting users: round {rnd + 1}/{args.rounds}")
    return rows


def summarise(rows: list[dict], costs: dict, evict: list[dict]) -> dict:
    ttft = {}
    for n in sorted({r["size"] for r in rows}):
        ttft[n] = {s: statistics.median(r["ttft_s"] for r in rows if r["size"] == n and r["system"] == s)
                   for s in SYSTEMS}
    out = {"ttft_s": ttft, "costs": costs}
    if evict:
        measured = [r for r in evict if r["round"] > 0] or evict  # round 0 fills the cache
        out["evicting"] = {s: {"p50_s": statistics.median(r["ttft_s"] for r in measured if r["system"] == s),
                               "cached": statistics.mean(r["cached_tokens"] / r["prompt_tokens"]
                                                         for r in measured if r["system"] == s)}
                           for s in ("chain", "text all")}
    return out


def report(summary: dict, args) -> None:
    ms = lambda s: f"{s * 1e3:,.0f}"  # noqa: E731
    ttft, costs = summary["ttft_s"], summary["costs"]
    head = ("facts", "prompt tok") + SYSTEMS + ("chain/alone", "text cold/chain")
    body = []
    for n, t in ttft.items():
        body.append((str(n), str(costs[n]["tokens"])) + tuple(ms(t[s]) for s in SYSTEMS)
                    + (f"{t['chain, from store'] / t['question alone']:.2f}x",
                       f"{t['text all, cold'] / t['chain, from store']:.1f}x"))
    print_rows(f"\nTTFT end to end (ms, median of {args.repeats}; one new question each)", head, body)
    head = ("facts", "ingest per fact s", "ingest as chain s", "append s", "update middle s", "update first s",
            f"chain = text ({args.answer_tokens} tok)")
    body = [(str(n), f"{c['ingest_per_fact_s']:.2f}", f"{c['ingest_chain_s']:.2f}", f"{c['append_s']:.2f}",
             f"{c['update_middle_s']:.2f}", f"{c['update_first_s']:.2f}", "yes" if c["same_answer"] else "NO")
            for n, c in costs.items()]
    print_rows("\nKeeping the chain (seconds; the append and updates include the chain's re-encode)", head, body)
    ev = summary.get("evicting")
    if ev:
        print_rows(f"\nEvicting users ({args.users} users of {args.user_facts} facts, {args.kv_cache_gib} GiB KV cache, "
                   f"rounds 2..{args.rounds})", ("system", "TTFT p50 ms", "prompt share cached"),
                   [(s, ms(v["p50_s"]), f"{v['cached']:.2f}") for s, v in ev.items()])
    big = max(ttft)
    t = ttft[big]
    r1 = t["chain, from store"] / t["question alone"]
    r2 = t["text all, cold"] / t["chain, from store"]
    print(f"target: chain TTFT at {big} facts <= 1.25x the question alone: {r1:.2f}x ({'met' if r1 <= 1.25 else 'missed'})")
    print(f"target: chain >= 20x faster than text with all facts, cold: {r2:.1f}x ({'met' if r2 >= 20 else 'missed'})")
    if ev:
        r3 = ev["text all"]["p50_s"] / ev["chain"]["p50_s"]
        print(f"target: with evicting users, chain p50 >= 5x better than text all with prefix caching: {r3:.1f}x "
              f"({'met' if r3 >= 5 else 'missed'})")
    same = all(c["same_answer"] for c in costs.values())
    print(f"target: chain answers identical to text with the whole memory: {'met' if same else 'missed'}")


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.demo import resolve_model_dir
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    samples = load_locomo(args.path or DEFAULT_LOCOMO_PATH)
    facts = pooled_facts(samples, max(max(args.sizes) + 1, args.user_facts))
    questions = [qa.question for s in samples for qa in s.questions]
    model_dir = resolve_model_dir(args.model)
    root, tmp = memory_root(args.memory_root, "inferscale-chain-")
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:.0f} s] {msg}", flush=True)

    print(f"{model_dir.name}: memories of {', '.join(map(str, args.sizes))} facts; {args.users} evicting users of "
          f"{args.user_facts} facts; KV cache {args.kv_cache_gib} GiB", flush=True)
    llm = MemoryLLM(MemoryLLMConfig(model=str(model_dir), memory_root=root, w=0, kv_dtype="float32",
                                    max_model_len=args.max_model_len, chain_budget=args.max_model_len - 512,
                                    cpu_kv_cache_gib=args.kv_cache_gib, host_cache_bytes=0),
                    embedder=MiniLMEmbedder())
    try:
        rows, costs = sizes_run(llm, facts, questions, args, log)
        evict = evicting_run(llm, facts, questions, args, log)
    finally:
        llm.close()
        if tmp is not None:
            tmp.cleanup()
    summary = summarise(rows, costs, evict)
    report(summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows,
                                               "evicting": evict}, indent=1, default=str))


if __name__ == "__main__":
    main()
