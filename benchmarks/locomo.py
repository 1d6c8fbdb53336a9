"""LoCoMo answer quality: KV injection vs facts as prompt text, per k (retrieved facts) and w (window).

One `MemoryLLM` (vLLM + InferScale's connector, SmolLM2-135M-Instruct by default, max_model_len
4096) answers LoCoMo questions (categories 1-4 by default) greedily with at most 32 new tokens,
from the top-k facts of the question's conversation retrieved by the memory service (MiniLM):

* text   - the retrieved facts pasted into the prompt as text (the Mem0-style baseline); it does
           not depend on w, so it runs once per (question, k);
* inject - the same facts, in the same prompt positions, served as KV encoded offline by
           Context-Window Encoding with the w preceding turns and injected by the connector;
           runs once per (question, k, w).

Facts carry their session dates (set by the loader, rendered into the fact text by the prompt
builder). Every method at a given (question, k) uses the same fact ids (one retrieval).

How several w share one engine: each w has its own memory service on the same root, encoder and
embedder (`MemoryLLM.memory_for(w)`); the conversation is ingested under the user id
"<sample_id>-w<w>" and served with `generate(..., w=w)`. No engine restart per w.

Scores per row: token F1 and BLEU-1 (SQuAD normalisation; `inferscale.common.metrics`), plus
`answer_s` (request in -> full answer, max_tokens=32, including retrieval+composition for that
request; the shared retrieval time is recorded separately as `search_s`). Each row is appended to
OUT/results.jsonl as soon as it exists; `--resume` skips (conversation, method, w, k, question)
rows already there. At the end: OUT/results.json (arguments, versions, machine, means per
method/w/k and per category), OUT/results.md (the table, also printed), and PNG plots of F1 vs k
when matplotlib is installed.

    python benchmarks/locomo.py --quick          # 1 conversation, 8 questions, k=10, w=0,5, 60 facts
    python benchmarks/locomo.py                  # all 10 conversations, all questions of cat. 1-4
    python benchmarks/locomo.py --conversations 2 --limit 50 --k 10,50 --w 0,20 --out runs/a --resume
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from bench_args import int_list, positive, vllm_cpu_env  # noqa: E402  (benchmarks/ is the script's folder)
from inferscale.common.metrics import aggregate, bleu1, token_f1  # noqa: E402

DEFAULT_K = (5, 10, 20, 50)
DEFAULT_W = (0, 5, 20, 50)
QUICK = {"conversations": 1, "limit": 8, "k": (10,), "w": (0, 5), "facts": 60}
MAX_TOKENS = 32
MAX_MODEL_LEN = 4096
SEED = 0
CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from inferscale.common.datasets import DEFAULT_LOCOMO_PATH

    p = argparse.ArgumentParser(description="LoCoMo F1 / BLEU-1 of KV injection vs facts as prompt text, "
                                            "per retrieved facts k and encoding window w, on vLLM.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--conversations", type=positive, default=None, help="first N conversations (default all)")
    p.add_argument("--limit", type=positive, default=None, help="questions per conversation (default all)")
    p.add_argument("--k", type=int_list(0), default=None,
                   help=f"retrieved facts, comma-separated (default {','.join(map(str, DEFAULT_K))})")
    p.add_argument("--w", type=int_list(0), default=None,
                   help=f"context-window turns per fact, comma-separated (default {','.join(map(str, DEFAULT_W))})")
    p.add_argument("--categories", type=int_list(0), default=(1, 2, 3, 4),
                   help="LoCoMo question categories (default 1,2,3,4; 5 = adversarial)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['conversations']} conversation, {QUICK['limit']} questions (those whose evidence "
                        f"lies in the ingested turns), k={','.join(map(str, QUICK['k']))}, "
                        f"w={','.join(map(str, QUICK['w']))}, first {QUICK['facts']} facts")
    p.add_argument("--out", default="locomo-results", help="output folder (default ./locomo-results)")
    p.add_argument("--resume", action="store_true", help="skip rows already in OUT/results.jsonl")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--memory-root", default=None,
                   help="memory directory (default: a temporary one, removed; give one to reuse ingests on --resume)")
    p.add_argument("--max-tokens", type=positive, default=MAX_TOKENS, help=f"answer tokens (default {MAX_TOKENS})")
    args = p.parse_args(argv)
    q = QUICK if args.quick else {}
    if args.conversations is None:
        args.conversations = q.get("conversations")
    if args.limit is None:
        args.limit = q.get("limit")
    args.k = args.k or q.get("k", DEFAULT_K)
    args.w = args.w or q.get("w", DEFAULT_W)
    args.max_facts = q.get("facts")
    if any(k < 1 for k in args.k):
        p.error("--k values must be >= 1")
    args.path = Path(args.path) if args.path else REPO_ROOT / DEFAULT_LOCOMO_PATH
    args.out = Path(args.out)
    return args


def select_memory(conv, max_facts: int | None):
    """(turns, facts) to ingest: the first `max_facts` facts and the turns up to the last of their
    source turns (facts come in conversation order); None: everything."""
    if max_facts is None:
        return list(conv.turns), list(conv.facts)
    facts = list(conv.facts[:max_facts])
    pos = {t.id: i for i, t in enumerate(conv.turns)}
    last = max((pos[f.source_turn] for f in facts if f.source_turn is not None), default=len(conv.turns) - 1)
    return list(conv.turns[: last + 1]), facts


def select_questions(sample, turns, limit: int | None, partial: bool) -> list[tuple[int, object]]:
    """(index in the sample, QA) pairs. With a partial memory (--quick), only questions whose
    evidence turns were all ingested (and that have evidence) are kept."""
    qs = list(enumerate(sample.questions))
    if partial:
        have = {t.id for t in turns}
        qs = [(i, q) for i, q in qs if q.evidence and set(q.evidence) <= have]
    return qs[:limit] if limit else qs


class _NothingToDo(Exception):
    pass


def _key(r: dict) -> tuple:
    return (r["conversation"], r["method"], r["w"], r["k"], r["question_idx"])


def load_done(path: Path) -> dict[tuple, dict]:
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a row cut short by a kill
                    continue
                done[_key(r)] = r
    return done


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "vllm", "jax", "inferscale"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def summarise(rows: list[dict]) -> list[dict]:
    """Means per (method, w, k), overall and per category, sorted."""
    groups = aggregate(rows, lambda r: (r["method"], r["w"], r["k"]))
    cats = aggregate(rows, lambda r: (r["method"], r["w"], r["k"], r["category"]))
    ans = {}
    for r in rows:
        ans.setdefault((r["method"], r["w"], r["k"]), []).append(r["answer_s"])
    out = []
    for (m, w, k), g in groups.items():
        per = {str(c): {"n": v["n"], "f1": v["f1"], "bleu1": v["bleu1"]}
               for (m2, w2, k2, c), v in cats.items() if (m2, w2, k2) == (m, w, k)}
        out.append({"method": m, "w": w, "k": k, "n": g["n"], "f1": g["f1"], "bleu1": g["bleu1"],
                    "answer_s_median": statistics.median([a for a in ans[(m, w, k)] if a is not None] or [float("nan")]),
                    "by_category": dict(sorted(per.items()))})
    out.sort(key=lambda s: (s["method"] != "text", -1 if s["w"] is None else s["w"], s["k"]))
    return out


def markdown(summary: list[dict], categories) -> str:
    f = lambda x: "-" if x is None or x != x else f"{x:.3f}"  # noqa: E731
    head = ["method", "w", "k", "n", "F1", "BLEU-1"]
    for c in categories:
        head += [f"F1 c{c}", f"BLEU-1 c{c}"]
    head.append("answer s (median)")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in summary:
        cells = [s["method"], "-" if s["w"] is None else str(s["w"]), str(s["k"]), str(s["n"]), f(s["f1"]), f(s["bleu1"])]
        for c in categories:
            pc = s["by_category"].get(str(c))
            cells += [f(pc["f1"]) + f" (n={pc['n']})" if pc else "-", f(pc["bleu1"]) if pc else "-"]
        cells.append(f(s["answer_s_median"]))
        lines.append("| " + " | ".join(cells) + " |")
    names = ", ".join(f"c{c} = {CATEGORY_NAMES.get(c, '?')}" for c in categories)
    return "\n".join(lines) + f"\n\nCategories: {names}. F1 / BLEU-1: SQuAD-normalised tokens, means over questions.\n"


def plot(summary: list[dict], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    written = []
    for metric, label in (("f1", "F1"), ("bleu1", "BLEU-1")):
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict = {}
        for s in summary:
            series.setdefault(("text", None) if s["method"] == "text" else ("inject", s["w"]), []).append((s["k"], s[metric]))
        for (m, w), pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="--" if m == "text" else "-", color="black" if m == "text" else None,
                    label="text (baseline)" if m == "text" else f"inject w={w}")
        ax.set_xlabel("k (retrieved facts)")
        ax.set_ylabel(label)
        ax.set_title(f"LoCoMo {label} vs k")
        ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"{metric}_vs_k.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.common.datasets import load_locomo
    from inferscale.default_model import ensure_default_model
    from inferscale.memory.service import MemoryService
    from inferscale.vllm.llm import MemoryLLM, MemoryLLMConfig, PlanError

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "results.jsonl"
    done = load_done(jsonl) if args.resume else {}
    if not args.resume and jsonl.exists():
        jsonl.unlink()  # a fresh run
    samples = load_locomo(args.path, categories=args.categories)
    samples = samples[: args.conversations] if args.conversations else samples
    ws, ks = args.w, args.k

    plan = []  # (sample, turns, facts, questions)
    for s in samples:
        turns, facts = select_memory(s.conversation, args.max_facts)
        plan.append((s, turns, facts, select_questions(s, turns, args.limit, args.max_facts is not None)))
    todo = sum(len(qs) * len(ks) * (1 + len(ws)) for _, _, _, qs in plan)
    methods = [("text", None)] + [("inject", w) for w in ws]
    pending = sum(1 for s, _, _, qs in plan for qi, _ in qs for k in ks for m, w in methods
                  if (s.conversation.id, m, w, k, qi) not in done)
    print(f"{len(plan)} conversation(s), {sum(len(q) for *_, q in plan)} questions, k={list(ks)}, w={list(ws)}: "
          f"{todo} answers, {pending} to run ({len(done)} rows already in {jsonl})")

    model = args.model or str(ensure_default_model())
    tmp = None
    root = args.memory_root
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="inferscale-locomo-")
        root = tmp.name
    services: dict[int, MemoryService] = {}
    n_new = 0
    try:
        if not pending:
            raise _NothingToDo
        t0 = time.perf_counter()
        llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=ws[0], max_model_len=MAX_MODEL_LEN))
        print(f"MemoryLLM started in {time.perf_counter() - t0:.1f} s ({model})")
        for w in ws:  # one memory service per w, all on the same root, encoder and embedder
            services[w] = llm.memory_for(w)

        with jsonl.open("a") as fh:
            for s, turns, facts, questions in plan:
                sid = s.conversation.id
                need = [(qi, q) for qi, q in questions
                        if any(_key({"conversation": sid, "method": m, "w": w, "k": k, "question_idx": qi}) not in done
                               for k in ks for m, w in methods)]
                if not need:
                    print(f"{sid}: all rows done")
                    continue
                users = {w: f"{sid}-w{w}" for w in ws}
                for w in ws:
                    if users[w] in services[w].catalog.users():
                        continue
                    t0 = time.perf_counter()
                    services[w].add(users[w], turns=turns, facts=facts)
                    dt = time.perf_counter() - t0
                    print(f"{sid}: ingested {len(turns)} turns + {len(facts)} facts at w={w} in {dt:.1f} s")
                source = {f.id: f.source_turn for f in facts}
                t_conv = time.perf_counter()
                for n, (qi, q) in enumerate(need):
                    for k in ks:
                        t0 = time.perf_counter()
                        ids = [f.fact_id for f in services[ws[0]].search(users[ws[0]], q.question, k)]
                        search_s = time.perf_counter() - t0
                        ev = set(q.evidence)
                        recall = (len(ev & {source[i] for i in ids}) / len(ev)) if ev else None
                        for method, w in methods:
                            base = {"conversation": sid, "method": method, "w": w, "k": k, "question_idx": qi}
                            if _key(base) in done:
                                continue
                            wu = ws[0] if w is None else w
                            row = dict(base, category=q.category, question=q.question, gold=q.answer,
                                       facts=ids, evidence_recall=recall, search_s=search_s)
                            try:
                                out = llm.generate(users[wu], q.question, k=k, mode=method, max_tokens=args.max_tokens,
                                                   fact_ids=ids, logprobs=None, w=wu)
                                pred = out.text.strip()
                                row.update(prediction=pred, f1=token_f1(pred, q.answer), bleu1=bleu1(pred, q.answer),
                                           answer_s=out.ttft_s, engine_s=out.timings["engine"],
                                           prompt_tokens=out.num_prompt, injected_tokens=out.num_injected,
                                           new_tokens=len(out.token_ids), error=None)
                            except PlanError as e:  # e.g. prompt longer than max_model_len
                                row.update(prediction=None, f1=None, bleu1=None, answer_s=None, error=str(e))
                            fh.write(json.dumps(row) + "\n")
                            fh.flush()
                            done[_key(row)] = row
                            n_new += 1
                    el = time.perf_counter() - t_conv
                    print(f"  {sid}: question {n + 1}/{len(need)} ({el:.0f} s, {n_new} new answers)", flush=True)
    except _NothingToDo:
        print("every row is already in results.jsonl: summarising only")
    finally:
        for svc in services.values():
            svc.close()
        if tmp is not None:
            tmp.cleanup()

    # only the rows of this run's selection (a resumed file may hold more)
    wanted = {(s.conversation.id, qi) for s, _, _, qs in plan for qi, _ in qs}
    rows = [r for r in done.values() if (r["conversation"], r["question_idx"]) in wanted and r["k"] in ks
            and (r["w"] is None or r["w"] in ws) and r.get("f1") is not None]
    summary = summarise(rows)
    table = markdown(summary, args.categories)
    wall = time.perf_counter() - t_start
    plots = plot(summary, args.out)
    meta = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": model, "max_model_len": MAX_MODEL_LEN, "max_tokens": args.max_tokens, "seed": SEED,
            "decoding": "greedy (temperature 0)", "versions": versions(), "machine": machine(),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": wall,
            "new_answers": n_new, "rows": len(rows),
            "errors": sum(1 for r in done.values() if r.get("error")), "plots": plots}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    (args.out / "results.md").write_text(
        f"# LoCoMo: KV injection vs text, {len(plan)} conversation(s)\n\nModel {model}; greedy, "
        f"max_tokens={args.max_tokens}; seed {SEED}.\n\n" + table)
    print()
    print(table)
    print(f"wrote {args.out}/results.jsonl, results.json, results.md{', plots' if plots else ''}; "
          f"wall time {wall:.1f} s")


if __name__ == "__main__":
    main()
