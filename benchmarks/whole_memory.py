"""The whole memory against the top k: answer quality on the calibration's five conversations.

Which scope serves a model best is the model's property. This measures it on the conversations
`inferscale calibrate` learns its gate on (LoCoMo's first three and the packaged user-and-assistant
conversations' two), with the same questions (categories 1-4, the first `--questions` of each) and
answers (greedy, `--max-tokens`). Each conversation is one user (its turns and facts, Context-Window
Encoding), and every question is answered by each method in one vLLM batch:

* `whole (chain)`: every fact in the order it was added, from the user's memory chain (`mode:
  chain`; exact: the same answer as the whole memory prefilled as text, which the tests check), up
  to the chain's budget (`--max-model-len` less 1,024 tokens here), the most relevant of the rest
  after it;
* `whole + top 3`: the same, with the 3 facts most relevant to the question repeated as text after
  the memory, next to the question (`repeat: 3`; still exact, a few dozen tokens prefilled);
* `text k=10`, `text k=50`: the top k retrieved, prefilled as text;
* `inject k=10`: the same 10 facts' own KV injected (the approximation);
* `inject k=10 last:N`, `inject k=10 top:N` (`--methods inject10+last2,inject10+top2,...`): the
  same, with N facts recomputed by vLLM: the last N in the server's order (the least relevant), or
  the N most relevant moved next to the question (`top:N`);
* `text k=10 in top:5's order`, `inject k=10 in top:5's order` (`text10@top5`, `inject10@top5`):
  the control of `top:5`'s order alone, the facts laid out as it lays them out, nothing recomputed.

Scored per answer with gold-token recall (correctness, robust to full-sentence answers) and LoCoMo
F1 (also wording); reported per conversation and pooled, with each method's paired gap to
`text k=10` and its standard error.

    python benchmarks/whole_memory.py --quick                  # 10 questions per conversation
    python benchmarks/whole_memory.py                          # 40 (SmolLM2-135M-Instruct)
    python benchmarks/whole_memory.py --model qwen2.5-coder-1.5b --json whole-qwen.json
    python benchmarks/whole_memory.py --model qwen2.5-coder-1.5b --quick --methods chain,chain+top3,text10,inject10
    python benchmarks/whole_memory.py --methods inject10,inject10+last2,inject10+top2,inject10+last5,inject10+top5
    python benchmarks/whole_memory.py --methods inject10,inject10+top5,text10@top5,inject10@top5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_args import memory_root, positive, print_rows, vllm_cpu_env

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.common.prompt.recovery import RecoveryPolicy  # noqa: E402
from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

TOP5 = RecoveryPolicy.parse("top:5")

SCOPES = ("whole (chain)", "whole + top 3", "text k=10", "text k=50", "inject k=10")
POLICIES = ("last:2", "top:2", "last:5", "top:5")  # inject k=10 with part of the memory recomputed
# the control of `top:5`'s order alone: k=10 laid out as top:5 lays it out, nothing recomputed
ORDERED = ("text k=10 in top:5's order", "inject k=10 in top:5's order")
METHODS = SCOPES + tuple(f"inject k=10 {p}" for p in POLICIES) + ORDERED
BASE = "text k=10"
KEYS = dict(zip(("chain", "chain+top3", "text10", "text50", "inject10",
                 *(f"inject10+{p.replace(':', '')}" for p in POLICIES), "text10@top5", "inject10@top5"),
                METHODS))  # --methods names


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="10 questions per conversation")
    p.add_argument("--questions", type=positive, default=None, help="questions per conversation (default 40)")
    p.add_argument("--max-tokens", type=positive, default=32, help="answer length (default 32, as calibrate)")
    p.add_argument("--model", default=None, help="model folder or registry name (default: SmolLM2-135M-Instruct)")
    add_flags(p, EngineSettings, defaults={"max_model_len": 8192, "w": 5})
    p.add_argument("--kv-cache-gib", type=positive, default=2)
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write every answer and the summary here")
    p.add_argument("--conversations", default=None,
                   help="sample ids, comma-separated, of the calibration's five (default: all five)")
    p.add_argument("--methods", default=",".join(list(KEYS)[: len(SCOPES)]),
                   help=f"comma-separated, of {', '.join(KEYS)} (default: the first five; text10, the baseline, "
                        "always runs)")
    a = p.parse_args(argv)
    a.questions = a.questions or (10 if a.quick else 40)
    keys = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in keys if m not in KEYS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(KEYS)})")
    a.methods = tuple(m for m in METHODS if m in {KEYS[k] for k in keys} | {BASE})
    a.conversations = tuple(c.strip() for c in a.conversations.split(",") if c.strip()) if a.conversations else None
    return a


def requests(user: str, question: str, ids10, ids50, max_tokens: int, methods=METHODS):
    """One question's request per method of `methods` (in their order)."""
    from inferscale.serving.memory_llm import MemoryRequest

    every = dict(zip(METHODS, (
        MemoryRequest(user, question, mode="chain", max_tokens=max_tokens),
        MemoryRequest(user, question, mode="chain", max_tokens=max_tokens, repeat=3),
        MemoryRequest(user, question, k=10, mode="text", fact_ids=ids10, max_tokens=max_tokens),
        MemoryRequest(user, question, k=50, mode="text", fact_ids=ids50, max_tokens=max_tokens),
        MemoryRequest(user, question, k=10, mode="inject", fact_ids=ids10, max_tokens=max_tokens),
        *(MemoryRequest(user, question, k=10, mode="inject", fact_ids=ids10, max_tokens=max_tokens, policy=p)
          for p in POLICIES),
        *(MemoryRequest(user, question, k=10, mode=mode, fact_ids=tuple(TOP5.arrange(ids10)), max_tokens=max_tokens)
          for mode in ("text", "inject")))))
    return [every[m] for m in methods]


def summarise(rows: list[dict], methods=METHODS) -> dict:
    """Per conversation and pooled: each method's mean recall and F1, and its paired gap to `BASE`
    (BASE minus the method, in points) with its standard error."""
    def stats(rs: list[dict]) -> dict:
        out = {}
        for m in methods:
            entry = {"n": len(rs)}
            for measure in ("recall", "f1"):
                entry[measure] = statistics.fmean(r[m][measure] for r in rs)
                gaps = [100 * (r[BASE][measure] - r[m][measure]) for r in rs]
                entry[f"{measure}_gap"] = statistics.fmean(gaps)
                entry[f"{measure}_se"] = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
            out[m] = entry
        return out

    convs = sorted({r["conversation"] for r in rows})
    return {"by_conversation": {c: stats([r for r in rows if r["conversation"] == c]) for c in convs},
            "pooled": stats(rows)}


def report(summary: dict, model: str, args) -> None:
    head = ("conversation", "method", "recall", "gap to text k=10 (pts)", "LoCoMo F1", "F1 gap (pts)")
    body = []
    for conv, s in list(summary["by_conversation"].items()) + [("pooled", summary["pooled"])]:
        for m in s:
            e = s[m]
            gap = "" if m == BASE else f"{e['recall_gap']:+.1f} ± {e['recall_se']:.1f}"
            f1gap = "" if m == BASE else f"{e['f1_gap']:+.1f} ± {e['f1_se']:.1f}"
            body.append((conv, m, f"{e['recall']:.3f}", gap, f"{e['f1']:.3f}", f1gap))
    print_rows(f"\nThe whole memory against the top k, {model} ({args.questions} questions per conversation, answers "
               f"of {args.max_tokens} tokens; a positive gap: worse than text k=10)", head, body)


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.demo import resolve_model_dir
    from inferscale.evaluation.calibrate import CalibrateConfig, load_samples
    from inferscale.evaluation.qa_metrics import gold_recall, locomo_f1
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    model_dir = resolve_model_dir(args.model)
    root, tmp = memory_root(args.memory_root, "inferscale-whole-")
    samples = [s for _, s in load_samples(CalibrateConfig(model=str(model_dir), memory_root=root))]
    if args.conversations:
        unknown = set(args.conversations) - {s.conversation.id for s in samples}
        if unknown:
            raise SystemExit(f"--conversations: not among the calibration's: {', '.join(sorted(unknown))}")
        samples = [s for s in samples if s.conversation.id in args.conversations]
    t0 = time.perf_counter()
    print(f"{model_dir.name}: {', '.join(s.conversation.id for s in samples)}, {args.questions} questions each",
          flush=True)
    llm = MemoryLLM(MemoryLLMConfig(model=str(model_dir), memory_root=root, w=args.w, kv_dtype="float32",
                                    max_model_len=args.max_model_len, chain_budget=args.max_model_len - 1024,
                                    cpu_kv_cache_gib=args.kv_cache_gib, enable_prefix_caching=False),
                    embedder=MiniLMEmbedder())
    rows = []
    try:
        for s in samples:
            conv = s.conversation
            user = f"whole-{conv.id}"
            llm.memory.add(user, turns=conv.turns, facts=conv.facts)
            llm.chain.extend(user)
            status = llm.chain.status(user)
            print(f"[{time.perf_counter() - t0:.0f} s] {conv.id}: {len(conv.facts)} facts, {status['held']} in the "
                  f"chain ({status['stored']} stored)", flush=True)
            questions = [q for q in s.questions if q.category in (1, 2, 3, 4)][: args.questions]
            for q in questions:
                ids10 = tuple(f.fact_id for f in llm.memory.search(user, q.question, 10))
                ids50 = tuple(f.fact_id for f in llm.memory.search(user, q.question, 50))
                outs = llm.generate_many(requests(user, q.question, ids10, ids50, args.max_tokens, args.methods))
                row = {"conversation": conv.id, "question": q.question, "gold": q.answer, "category": q.category}
                for m, out in zip(args.methods, outs):
                    row[m] = {"answer": out.text, "recall": gold_recall(out.text, q.answer, q.category),
                              "f1": locomo_f1(out.text, q.answer, q.category), "prompt_tokens": out.num_prompt}
                rows.append(row)
            mine = [r for r in rows if r["conversation"] == conv.id]
            means = ", ".join(f"{m} {statistics.fmean(r[m]['recall'] for r in mine):.3f}" for m in args.methods)
            print(f"[{time.perf_counter() - t0:.0f} s] {conv.id}: {len(questions)} questions answered; recall: {means}",
                  flush=True)
    finally:
        llm.close()
        if tmp is not None:
            tmp.cleanup()
    summary = summarise(rows, args.methods)
    report(summary, model_dir.name, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
