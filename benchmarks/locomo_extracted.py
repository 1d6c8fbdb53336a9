"""LoCoMo from the raw conversation: facts extracted by the served model, against the dataset's own.

One `MemoryLLM` (vLLM + InferScale's connector) holds two memories of one LoCoMo conversation:

* observations - the dataset's hand-written `observation` facts (what every other LoCoMo figure
                 of this project uses), ingested with their turns;
* extracted    - the raw conversation, each session in order (`extract_sessions`), the facts
                 extracted and decided (add / update / delete / none) by the served model itself,
                 through the same engine (`EngineJsonLLM`: vLLM's structured outputs).

Per session it prints and records the facts extracted and the ingest cost, split into the LLM's
extraction and decisions, and the memory service's writes (encoding each fact's KV after its
window, storing, indexing). Then the same held-in questions (the first N of categories 1-4) are
answered from each memory as text and injected under each `--policies` policy, at each k, with
the same per-question retrieval in the server's order (`inferscale.evaluation.calibrate.measure`),
and the end-to-end TTFT of each method is timed in the same run (one token, methods interleaved,
medians; `time_to_first_token`). `auto` serves a model with the policy its calibration passes
(the last table says which, per k).

    python benchmarks/locomo_extracted.py --quick            # SmolLM2, 2 sessions, 6 questions, k=10 (minutes)
    python benchmarks/locomo_extracted.py --model qwen2.5-coder-1.5b --out runs/extracted \\
        --memory-root runs/extracted-mem --resume            # conv-26 whole, 40 questions, k=10 (hours on 2 cores)

Writes OUT/sessions.jsonl (one row per extracted session; with --resume and the same memory root,
sessions already there are not extracted again), OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.config import EngineSettings, add_flags  # noqa: E402  (plain Python: no engine)

from bench_args import int_list, memory_root, positive, vllm_cpu_env  # noqa: E402

QUICK = {"sessions": 2, "questions": 6, "k": (10,)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="LoCoMo with facts extracted from the raw conversation by the served "
                                            "model vs the dataset's observations: ingest cost, F1, TTFT.")
    p.add_argument("--model", default=None, help="a model folder or short name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=None, help="a LoCoMo-format file (default: the checkout's LoCoMo)")
    p.add_argument("--conversation", default="conv-26", help="the sample id (default conv-26)")
    p.add_argument("--sessions", type=positive, default=None, help="only the first N sessions (default: all)")
    p.add_argument("--questions", type=positive, default=40, help="held-in questions of categories 1-4 (default 40)")
    p.add_argument("--k", type=int_list(1), default=(10,), help="retrieved facts, comma-separated (default 10)")
    p.add_argument("--policies", default="none,last:5", help="injection's recovery policies (default none,last:5)")
    p.add_argument("--ttft-questions", type=int, default=3, help="questions timed for TTFT (default 3; 0: none)")
    add_flags(p, EngineSettings, defaults={"w": 5})
    p.add_argument("--window", type=positive, default=20, help="messages per extraction call (default 20)")
    p.add_argument("--batch", type=positive, default=16, help="candidates decided together (default 16)")
    p.add_argument("--max-facts", type=positive, default=16, help="facts per extraction call at most (default 16)")
    p.add_argument("--max-tokens", type=positive, default=32, help="answer tokens (default 32)")
    p.add_argument("--kv-cache-gib", type=positive, default=4,
                   help="vLLM CPU's KV cache (default 4: room for every window's extraction at once)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['sessions']} sessions, {QUICK['questions']} "
                                                         "questions whose evidence lies in them, k=10")
    p.add_argument("--out", default="locomo-extracted", help="output folder (default ./locomo-extracted)")
    p.add_argument("--memory-root", default=None, help="memory directory (default: a temporary one, removed)")
    p.add_argument("--resume", action="store_true", help="keep the sessions OUT and the memory root already hold")
    p.add_argument("--no-observations", dest="observations", action="store_false",
                   help="answer from the extracted memory only (the observations' figures on the same questions "
                        "are the calibration's: `inferscale calibrate --ttft-questions N`)")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.questions, args.k = QUICK["sessions"], QUICK["questions"], QUICK["k"]
    args.policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    return args


class Timed:
    """Wraps an object; the seconds spent in the named methods add up in `spent[name]`."""

    def __init__(self, inner, names: tuple[str, ...]) -> None:
        self._inner, self._names, self.spent = inner, names, dict.fromkeys(names, 0.0)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self._names:
            return attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.spent[name] += time.perf_counter() - t0

        return timed


def select(sample, sessions: int | None, n_questions: int):
    """(turns, observations, questions): the first `sessions` sessions and their facts, and the
    first questions of categories 1-4 whose evidence lies in them."""
    conv = sample.conversation
    order = list(dict.fromkeys(t.session for t in conv.turns))
    keep = set(order[:sessions] if sessions else order)
    turns = [t for t in conv.turns if t.session in keep]
    have = {t.id for t in turns}
    facts = [f for f in conv.facts if f.source_turn in have]
    qs = [q for q in sample.questions if q.category in (1, 2, 3, 4)
          and (sessions is None or (q.evidence and set(q.evidence) <= have))]
    return turns, facts, qs[:n_questions]


def extract_sessions(llm, turns, args, out: Path) -> list[dict]:
    """The conversation into user "extracted", as an import of a whole history runs: every
    session's turns stored, the candidates of every session's windows extracted in one batch (the
    windows are independent), then each session's candidates decided and applied in session order
    (`Extractor.decide_all`, `--batch` at a time). One row per session; the batch's
    extraction time is recorded once (`extract_s`), split over the turns in the report."""
    from inferscale.memory.extraction import Extracted, Extractor
    from inferscale.memory.extraction_llms import EngineJsonLLM

    path = out / "sessions.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if args.resume and path.exists() else []
    done = {r["session"] for r in rows}
    memory = Timed(llm.memory, ("add", "update", "delete", "search"))
    ask = Timed(EngineJsonLLM(llm), ("complete_json_many",))
    ex = Extractor(memory, ask, window=args.window, max_facts=args.max_facts, batch=args.batch)
    sessions = [s for s in dict.fromkeys(t.session for t in turns) if s not in done]
    of = {s: [t for t in turns if t.session == s] for s in sessions}
    for s in sessions:
        ex.store_turns("extracted", of[s])
    windows = [(s, of[s][i : i + args.window]) for s in sessions for i in range(0, len(of[s]), args.window)]
    print(f"extracting the candidates of {len(sessions)} sessions ({len(windows)} windows) in one batch", flush=True)
    t0 = time.perf_counter()
    found = ex.candidates_many([w for _, w in windows])
    extract_s = time.perf_counter() - t0
    print(f"  {sum(map(len, found))} candidates in {extract_s:.0f} s", flush=True)
    with path.open("a") as fh:
        for n, s in enumerate(sessions):
            cands = [c for (ws, _), cs in zip(windows, found) if ws == s for c in cs]
            before = (dict(memory.spent), ask.spent["complete_json_many"])
            t0, got = time.perf_counter(), Extracted(candidates=len(cands), turns_stored=len(of[s]))
            ex.decide_all("extracted", cands, got)
            spent = {k: memory.spent[k] - before[0][k] for k in memory.spent}
            row = {"session": s, "turns": len(of[s]), "candidates": got.candidates, "added": len(got.added),
                   "updated": len(got.updated), "deleted": len(got.deleted), "unchanged": len(got.unchanged),
                   "decide_llm_s": ask.spent["complete_json_many"] - before[1],
                   "write_s": spent["add"] + spent["update"] + spent["delete"], "search_s": spent["search"],
                   "wall_s": time.perf_counter() - t0, "extract_s": extract_s if n == 0 else 0.0,
                   "facts_after": len(llm.memory.list("extracted"))}
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            rows.append(row)
            print(f"session {s} ({n + 1}/{len(sessions)}): {len(of[s])} turns, {got.candidates} candidates -> "
                  f"+{row['added']} ~{row['updated']} -{row['deleted']} ={row['unchanged']}; decisions' LLM "
                  f"{row['decide_llm_s']:.0f} s, writes {row['write_s']:.0f} s; {row['facts_after']} facts", flush=True)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.common.model.spec import ModelSpec
    from inferscale.evaluation.calibrate import measure, time_to_first_token
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo
    from inferscale.models import resolve_model
    from inferscale.retrieval.embedders import MiniLMEmbedder
    from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

    by = {s.conversation.id: s for s in load_locomo(args.data or REPO_ROOT / DEFAULT_LOCOMO_PATH)}
    if args.conversation not in by:
        raise SystemExit(f"--conversation: no {args.conversation!r} (have {', '.join(by)})")
    turns, facts, questions = select(by[args.conversation], args.sessions, args.questions)
    if not questions:
        raise SystemExit("no question of categories 1-4 has its evidence in the selected sessions")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model(args.model))
    root, tmp = memory_root(args.memory_root, "inferscale-extracted-")
    t_start = time.perf_counter()
    llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=args.w, enable_prefix_caching=False,
                                    cpu_kv_cache_gib=args.kv_cache_gib,
                                    max_model_len=min(4096, ModelSpec.from_pretrained(model).max_position)),
                    embedder=MiniLMEmbedder())
    try:
        print(f"{args.conversation}: {len(turns)} turns, {len(facts)} observations, {len(questions)} questions; "
              f"model {Path(model).name}", flush=True)
        ingest_obs, done_mark = None, out / "observations.done"
        if args.observations and not (args.resume and done_mark.exists()):
            t0 = time.perf_counter()
            if "observations" in llm.memory.catalog.users():  # an ingest cut off part way: again, whole
                llm.memory.delete_user("observations")
            llm.memory.add("observations", turns=turns, facts=facts,
                           progress=lambda d, n: print(f"  observations: {d}/{n} facts encoded", flush=True))
            ingest_obs = time.perf_counter() - t0
            done_mark.write_text(f"{ingest_obs:.1f}\n")
        sessions = extract_sessions(llm, turns, args, out)
        results = {"args": {k: v for k, v in vars(args).items()}, "model": Path(model).name,
                   "turns": len(turns), "observations": len(facts), "questions": len(questions),
                   "observations_ingest_s": ingest_obs, "sessions": sessions, "memories": {}}
        for user in ("observations", "extracted") if args.observations else ("extracted",):
            print(f"answering {len(questions)} questions from {user} ({len(llm.memory.list(user))} facts)", flush=True)
            measured = measure(llm, user, questions, args.k, args.policies, args.max_tokens)
            ttft = (time_to_first_token(llm, user, questions[: args.ttft_questions], args.k, args.policies)
                    if args.ttft_questions else {})
            results["memories"][user] = {"facts": len(llm.memory.list(user)),
                                         "measured": [vars(m) for m in measured],
                                         "ttft_ms": {f"{k}:{p}": v for (k, p), v in ttft.items()}}
        results["auto"] = {k: llm.resolve("auto", k=k)[:2] for k in args.k}
        results["extracted_facts"] = [{"id": f.fact_id, "text": f.text, "source_turn": f.source_turn}
                                      for f in llm.memory.list("extracted")]
        results["wall_s"] = time.perf_counter() - t_start
    finally:
        llm.close()
        if tmp is not None:
            tmp.cleanup()
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(report(results))
    print(report(results))


def report(r: dict) -> str:
    """The run's tables as Markdown."""
    s = r["sessions"]
    turns = sum(x["turns"] for x in s) or 1
    lines = [f"# LoCoMo {r['args']['conversation']} from the raw conversation ({r['model']})", "",
             f"{r['turns']} turns in {len(s)} sessions; {r['questions']} questions; k = "
             f"{','.join(map(str, r['args']['k']))}.", "",
             "| ingest | facts | LLM s/turn (extraction + decisions) | writes s/turn (encoding, storing) | total s/turn |",
             "|---|---|---|---|---|"]
    extract_s, decide_s, write_s = (sum(x.get(k, 0.0) for x in s) for k in ("extract_s", "decide_llm_s", "write_s"))
    lines.append(f"| extracted ({sum(x['candidates'] for x in s)} candidates: +{sum(x['added'] for x in s)} "
                 f"~{sum(x['updated'] for x in s)} -{sum(x['deleted'] for x in s)}) | "
                 f"{r['memories']['extracted']['facts']} | {extract_s / turns:.2f} + {decide_s / turns:.2f} | "
                 f"{write_s / turns:.2f} | {(extract_s + decide_s + write_s) / turns:.2f} |")
    if r.get("observations_ingest_s"):
        lines.append(f"| observations (hand-written) | {r['observations']} | - | "
                     f"{r['observations_ingest_s'] / r['turns']:.2f} | {r['observations_ingest_s'] / r['turns']:.2f} |")
    lines += ["", "| memory | k | method | LoCoMo F1 | gap to text (points) | TTFT e2e ms | text / method TTFT |",
              "|---|---|---|---|---|---|---|"]
    for user, m in r["memories"].items():
        for k in r["args"]["k"]:
            here = [x for x in m["measured"] if x["k"] == k]
            text_ms = m["ttft_ms"].get(f"{k}:text")
            ms = lambda v: f"{v:,.0f}" if v else "-"  # noqa: E731
            lines.append(f"| {user} | {k} | text | {here[0]['text_f1']:.3f} | - | {ms(text_ms)} | 1.0x |")
            for x in here:
                t = m["ttft_ms"].get(f"{k}:{x['policy']}")
                ratio = f"{text_ms / t:.1f}x" if t and text_ms else "-"
                lines.append(f"| {user} | {k} | inject+{x['policy']} | {x['f1']:.3f} | "
                             f"{100 * (x['text_f1'] - x['f1']):+.1f} ± {100 * x['gap_stderr']:.1f} | {ms(t)} | {ratio} |")
    lines += ["", "`auto` serves: " + "; ".join(f"k={k}: {m}{'+' + p if p else ''}" for k, (m, p) in r["auto"].items()),
              "", "Per session:", ""]
    lines += ["| session | turns | candidates | added | updated | deleted | none | decisions' LLM s | writes s |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {x['session']} | {x['turns']} | {x['candidates']} | {x['added']} | {x['updated']} | {x['deleted']} | "
              f"{x['unchanged']} | {x['decide_llm_s']:.0f} | {x['write_s']:.0f} |" for x in s]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
