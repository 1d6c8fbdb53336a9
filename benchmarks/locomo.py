"""LoCoMo, side by side: KV injection vs the facts as prompt text, per k (retrieved facts) and w (window).

One `MemoryLLM` (vLLM + InferScale's connector; SmolLM2-135M-Instruct by default) answers LoCoMo
questions (categories 1-4 by default) greedily, from the top-k facts of the question's
conversation retrieved by the memory service (MiniLM). Memory = the conversation's `observation`
facts (each tied to its source turn, dated with its session; `--event-summaries` adds the event
summaries), ingested per conversation with Context-Window Encoding:

* text   - the retrieved facts pasted into the prompt as text (the Mem0-style baseline); it does
           not depend on w, so it runs once per (question, k);
* inject - the same facts, in the same prompt positions, served as KV encoded offline with the w
           preceding turns and injected by the connector; once per (question, k, w).

Every method at a given (question, k) uses the same fact ids (one retrieval). Each w has its own
memory service on one root, encoder and embedder (user "<sample_id>-w<w>"), so all w share one
engine. `--kv-dtype float32,int8` also compares store dtypes: each dtype other than float32 has
its own users ("<sample_id>-w<w>-int8") and rows ("inject{int8}", "= float32" in the tables), and
holds the very encodings of the first dtype's users (each fact is encoded once; the others are
written from that encoding in their dtype, as an ingest in that dtype would write it; a resumed
run encodes a dtype's missing users again). Answers are generated in vLLM batches of
`--batch` questions (every method and k of those questions at once).

Phases, each written as soon as it is done (OUT/...):

1. grid: per answer, a row in results.jsonl with the prediction, F1 / LoCoMo F1 / BLEU-1
   (`locomo_report.score_row`) and `gold_ll`, the gold answer's mean log-likelihood per token
   after the same prompt (`MemoryLLM.score_many`). `--resume` skips rows already there.
2. footprint: bytes of KV per conversation per dtype, next to the facts' text (footprint.json).
3. ttft: TTFT vs k, end to end and engine-only, text ("joint") vs inject vs the question alone,
   interleaved, one token per request, fresh prefix-cache salts (`ttft.run_one`; ttft.json).
4. throughput: requests/s vs concurrent users through `inferscale serve` (`throughput.py` in a
   subprocess, after this process's engine is gone; throughput.json).
5. judge (with `--judge-url` and `--judge-model`, or `--judge-url local`: the benchmark's model
   served by `inferscale serve` with memory off, once this process's engine is gone): each answered
   row without a verdict is judged through the OpenAI-compatible endpoint
   (`inferscale.evaluation.judge`, Mem0's binary rubric: the J score), each distinct answer to a
   question once (the judge is greedy: methods giving the same answer share its verdict, and a
   reply without a label is kept, not asked again); judged copies of the rows are appended to
   results.jsonl (the later line wins), so a judge can be added later with `--resume`.

Then results.json (arguments, versions, model, machine, seed, every summary), results.md (the
tables, also printed) and PNG plots: each metric vs k per w, TTFT vs k, throughput vs users.
With `--resume`, phases whose JSON exists are not run again.

    python benchmarks/locomo.py --quick            # 1 conversation, 8 questions, k=10, w=0,5 (~10 min, 2 cores)
    python benchmarks/locomo.py                    # all 10 conversations, 1,540 questions, k=5..50, w=0..50
    python benchmarks/locomo.py --conversations conv-26,conv-41 --k 10,50 --out runs/two \\
        --memory-root runs/two-mem --resume        # the README's run; resumable
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

import locomo_report as report  # noqa: E402  (benchmarks/ is the script's folder)
from inferscale.common.storage.format import KV_DTYPES  # noqa: E402
from bench_args import ORDERS, arrange, int_list, memory_root, positive, vllm_cpu_env  # noqa: E402

DEFAULT_K = (5, 10, 20, 50)
DEFAULT_W = (0, 5, 20, 50)
QUICK = {"conversations": "1", "limit": 8, "k": (10,), "w": (0, 5), "facts": 60, "ttft_questions": 3,
         "throughput": (1, 8)}
MAX_TOKENS = 32
MAX_MODEL_LEN = 4096
SEED = 0
PHASES = ("answers", "ttft", "throughput", "loglik", "text")  # answers: the whole grid; text: its text rows


def dtype_list(text: str) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not out or [x for x in out if x not in KV_DTYPES]:
        raise argparse.ArgumentTypeError(f"store dtypes must be among {','.join(KV_DTYPES)}, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH
    from inferscale.common.modes import QUERY_WEIGHTS

    p = argparse.ArgumentParser(description="LoCoMo accuracy, TTFT, throughput and KV footprint of KV injection vs "
                                            "facts as prompt text, per retrieved facts k and encoding window w.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"a LoCoMo-format JSON file (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--conversations", default=None,
                   help="the first N conversations, or comma-separated sample ids (default: all)")
    p.add_argument("--limit", type=positive, default=None, help="questions per conversation (default all)")
    p.add_argument("--k", type=int_list(1), default=None,
                   help=f"retrieved facts, comma-separated (default {','.join(map(str, DEFAULT_K))})")
    p.add_argument("--w", type=int_list(0), default=None,
                   help=f"context-window turns per fact, comma-separated (default {','.join(map(str, DEFAULT_W))})")
    p.add_argument("--categories", type=int_list(1), default=(1, 2, 3, 4),
                   help="LoCoMo question categories (default 1,2,3,4; 5 = adversarial)")
    p.add_argument("--event-summaries", action="store_true", help="also ingest the event summaries as facts")
    p.add_argument("--quick", action="store_true",
                   help=f"1 conversation, {QUICK['limit']} questions (whose evidence lies in the ingested turns), "
                        f"k={','.join(map(str, QUICK['k']))}, w={','.join(map(str, QUICK['w']))}, first "
                        f"{QUICK['facts']} facts, TTFT on {QUICK['ttft_questions']} questions, throughput at "
                        f"{','.join(map(str, QUICK['throughput']))} users")
    p.add_argument("--out", default="locomo-results", help="output folder (default ./locomo-results)")
    p.add_argument("--resume", action="store_true", help="keep OUT's rows and phases; run only what is missing")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--memory-root", default=None,
                   help="memory directory (default: a temporary one, removed; give one to reuse ingests on --resume)")
    p.add_argument("--max-tokens", type=positive, default=MAX_TOKENS, help=f"answer tokens (default {MAX_TOKENS})")
    p.add_argument("--encoder-device", default="auto",
                   help="where facts are encoded: auto (CUDA when there is a GPU), cpu, cuda[:N] (default auto)")
    p.add_argument("--batch", type=positive, default=8, help="questions per vLLM batch (default 8)")
    p.add_argument("--query-weights", default="auto", choices=QUERY_WEIGHTS,
                   help="the search query's embedding network: int8 or float32 weights, auto (default): int8 "
                        "where it runs in ONNX Runtime (MiniLMEmbedder.query_weights; facts are float32 either way)")
    p.add_argument("--kv-dtype", type=dtype_list, default=("float32",),
                   help="how new memory stores keep KV, comma-separated, of " + ",".join(KV_DTYPES) + " (default "
                        "float32, as the README's runs: injection's approximation alone; a resumed --memory-root "
                        "keeps its stores' dtype); each dtype but float32 adds methods 'inject...{DTYPE}' served "
                        "from the first dtype's encodings written in DTYPE")
    p.add_argument("--kv-cache-gib", type=positive, default=4,
                   help="vLLM CPU's KV cache in GiB (default 4; lower it to run beside another engine)")
    p.add_argument("--order", choices=ORDERS[1:], default="relevance",
                   help="fact order in every method's prompt: most relevant first (default) or last, next to the "
                        "question (where last:N recomputes them)")
    p.add_argument("--policies", type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
                   default=("none",), help="recovery policies of the inject methods, comma-separated: none, "
                                           "last:N, all (default none; each other policy adds a method "
                                           "'inject+POLICY' per w)")
    p.add_argument("--context", choices=("turns", "facts", "conversation"), default="turns",
                   help="what injected facts are encoded after: their w preceding turns (default), those turns "
                        "read from one pass over the conversation (conversation encoding), or the w facts added "
                        "before them, rendered as served (list context); methods 'inject[CONTEXT]...', users "
                        "'<id>-w<w>-CONTEXT', so all can share one --out and --memory-root")
    p.add_argument("--ttft-questions", type=int, default=None, help="questions timed for TTFT vs k (default 10; 0: none)")
    p.add_argument("--ttft-k", type=int_list(0), default=(0, 5, 10, 20, 50), help="k values of TTFT vs k")
    p.add_argument("--throughput", type=int_list(1), default=None,
                   help="concurrent users of the throughput phase (default 1,4,16)")
    p.add_argument("--boundary", choices=("no", "yes", "both"), default="no",
                   help="serve the memory with its end boundary (methods named ...+end): no (default), yes, or both "
                        "side by side")
    p.add_argument("--skip", type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                   help=f"phases to leave out, comma-separated, of {','.join(PHASES)}")
    p.add_argument("--judge-url", default=None,
                   help="OpenAI-compatible endpoint (/v1 root) of an LLM judge, or 'local': the benchmark's model "
                        "served by `inferscale serve` with memory off, after the answers (benchmarks/local_judge.py)")
    p.add_argument("--judge-model", default=None, help="the judge's model name (not with --judge-url local)")
    p.add_argument("--judge-api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the judge's API key (default OPENAI_API_KEY)")
    p.add_argument("--judge-concurrency", type=positive, default=4, help="judge requests in flight (default 4)")
    args = p.parse_args(argv)
    q = QUICK if args.quick else {}
    args.conversations = args.conversations or q.get("conversations")
    args.limit = args.limit or q.get("limit")
    args.k = args.k or q.get("k", DEFAULT_K)
    args.w = args.w or q.get("w", DEFAULT_W)
    args.max_facts = q.get("facts")
    args.ttft_questions = q.get("ttft_questions", 10) if args.ttft_questions is None else args.ttft_questions
    args.throughput = args.throughput or q.get("throughput", (1, 4, 16))
    if args.ttft_questions < 0:
        p.error("--ttft-questions must be >= 0")
    from inferscale.common.prompt.recovery import connector_policy

    try:
        args.policies = tuple(str(connector_policy(x)) for x in args.policies)
    except ValueError as e:
        p.error(f"--policies: {e}")
    if bad := set(args.skip) - set(PHASES):
        p.error(f"--skip: unknown phase(s) {sorted(bad)}; choose from {', '.join(PHASES)}")
    args.judge_local = args.judge_url == "local"
    if args.judge_local and args.judge_model:
        p.error("--judge-url local judges with the benchmark's own model: leave out --judge-model")
    if not args.judge_local and bool(args.judge_url) != bool(args.judge_model):
        p.error("--judge-url and --judge-model go together")
    args.judge = None
    if args.judge_url and not args.judge_local:
        from inferscale.evaluation.judge import JudgeConfig

        try:
            args.judge = JudgeConfig(base_url=args.judge_url, model=args.judge_model, api_key_env=args.judge_api_key_env,
                                     concurrency=args.judge_concurrency)
        except ValueError as e:
            p.error(str(e))
    args.path = Path(args.path) if args.path else REPO_ROOT / DEFAULT_LOCOMO_PATH
    args.out = Path(args.out)
    return args


def select_samples(samples, which: str | None):
    """The first N samples ("2") or the named ones ("conv-26,conv-41"), in the order given."""
    if not which:
        return samples
    if which.isdigit():
        return samples[: int(which)]
    by = {s.conversation.id: s for s in samples}
    names = [n.strip() for n in which.split(",") if n.strip()]
    if missing := [n for n in names if n not in by]:
        raise SystemExit(f"--conversations: no sample {missing} in the file (have {', '.join(by)})")
    return [by[n] for n in names]


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


# -- phase 1: the accuracy grid ------------------------------------------------------------------
def ingestible(svc, sid, turns, facts) -> tuple[list, list]:
    """The turns and facts the memory service accepts; what it refuses (too long, not text) is
    skipped and reported, with the facts whose source turn was skipped."""
    refused = svc.refusals(facts, turns)
    bad_turns = {t.id for t in turns if f"turn {t.id}" in refused}
    for f in facts:
        if f.source_turn in bad_turns and f"fact {f.id}" not in refused:
            refused[f"fact {f.id}"] = f"its source turn {f.source_turn!r} was skipped"
    for what, why in refused.items():
        print(f"{sid}: skipping {what}: {why}", flush=True)
    if refused:
        print(f"{sid}: skipped {len(refused)} of {len(turns) + len(facts)} turns and facts", flush=True)
    return ([t for t in turns if f"turn {t.id}" not in refused], [f for f in facts if f"fact {f.id}" not in refused])


def ingest(services, users, sid, turns, facts) -> None:
    """Ingest the conversation into each service's user (keys: w, or (w, store dtype)) it lacks."""
    for key, svc in services.items():
        if users[key] in svc.catalog.users():
            continue
        label = f"w={key[0]} {key[1]}" if isinstance(key, tuple) else f"w={key}"
        t0 = time.perf_counter()
        turns, facts = ingestible(svc, sid, turns, facts)
        svc.add(users[key], turns=turns, facts=facts, progress=lambda done, n: print(
            f"{sid}: {label}: {done}/{n} facts encoded ({time.perf_counter() - t0:.0f} s)", flush=True))
        print(f"{sid}: ingested {len(turns)} turns + {len(facts)} facts at {label} in {time.perf_counter() - t0:.1f} s",
              flush=True)


def answer_batch(llm, items, args, fh, done) -> int:
    """Generate (and score the gold answer of) every (row, request) item in one vLLM batch each."""
    from inferscale.serving.memory_llm import PlanError

    ok = []
    for row, req in items:  # refuse what cannot be composed before anything is submitted
        try:
            n_gold = len(llm.encoder.tokenizer.encode(str(row["gold"]), add_special_tokens=False))
            # room for the gold answer (scored) and for a whole answer: never one cut by the context
            llm.composer.compose(req.user, req.question, list(req.fact_ids), req.w, max(n_gold, req.max_tokens),
                                 req.policy, req.boundary)
            ok.append((row, req, n_gold))
        except PlanError as e:  # e.g. a prompt longer than max_model_len
            row.update(prediction=None, gold_ll=None, error=str(e))
            _write(fh, done, row)
    if not ok:
        return 0
    t0 = time.perf_counter()
    outs = llm.generate_many([req for _, req, _ in ok])
    t1 = time.perf_counter()
    scored = [(row, req) for row, req, n in ok if n > 0] if "loglik" not in args.skip else []
    scores = dict(zip((id(r) for r, _ in scored),
                      llm.score_many([q for _, q in scored], [str(r["gold"]) for r, _ in scored]))) if scored else {}
    t2 = time.perf_counter()
    for (row, req, _), out in zip(ok, outs):
        sc = scores.get(id(row))
        row.update(prediction=out.text.strip(), prompt_tokens=out.num_prompt, injected_tokens=out.num_injected,
                   new_tokens=len(out.token_ids), gold_ll=sc.mean if sc else None,
                   gold_tokens=sc.num_tokens if sc else None, batch_requests=len(ok), batch_answer_s=t1 - t0,
                   batch_score_s=t2 - t1, error=None)
        row.update(report.score_row(row))
        _write(fh, done, row)
    return len(ok)


def _write(fh, done, row) -> None:
    fh.write(json.dumps(row) + "\n")
    fh.flush()
    done[report.row_key(row)] = row


def grid_methods(args) -> list[tuple[str, int | None, str | None, str | None]]:
    """(method name, w, recovery policy, store dtype): text (unless skipped), then per w and store
    dtype plain injection ("inject", or "inject[facts]" under list context) and "inject...+POLICY"
    for every other policy; a dtype other than float32 is named in braces ("inject{int8}")."""
    out: list[tuple[str, int | None, str | None, str | None]] = [] if "text" in args.skip else [
        ("text", None, None, None)]
    inject = "inject" if args.context == "turns" else f"inject[{args.context}]"
    for w in args.w:
        for d in args.kv_dtype:
            tag = "" if d == "float32" else f"{{{d}}}"
            out += [(inject + tag if p == "none" else f"{inject}{tag}+{p}", w, p, d) for p in args.policies]
    if args.boundary == "yes":
        return [(m + END, w, p, d) for m, w, p, d in out]
    if args.boundary == "both":
        return out + [(m + END, w, p, d) for m, w, p, d in out]
    return out


END = "+end"  # a method served with the memory's boundary (`layout.BOUNDARY`, `--boundary`)


def with_boundary(method: str) -> bool:
    return method.endswith(END)


def user_of(sid: str, w: int, context: str, dtype: str = "float32") -> str:
    """The memory user holding conversation `sid` encoded with (context, w), stored in `dtype`."""
    return f"{sid}-w{w}" + ("" if context == "turns" else f"-{context}") + ("" if dtype == "float32" else f"-{dtype}")


class ReusedEncodings:
    """An encoder that encodes each (fact, context, w) once: later requests for the same fact
    after the same context get a copy of the first encoding (the same float32 KV, which a store
    of another dtype then writes in its own). Everything else is the wrapped encoder's."""

    def __init__(self, encoder) -> None:
        self.inner = encoder
        self.memo: dict[tuple, object] = {}
        self.encoded = self.reused = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _cached(self, kind: str, encode, facts, contexts, w: int) -> list:
        from dataclasses import replace

        keys = [(kind, w, f, tuple(c)) for f, c in zip(facts, contexts)]
        todo = [i for i, key in enumerate(keys) if key not in self.memo]
        if todo:
            for i, kv in zip(todo, encode([facts[i] for i in todo], [contexts[i] for i in todo], w)):
                self.memo[keys[i]] = kv
            self.encoded += len(todo)
        self.reused += len(keys) - len(todo)
        # copies: the service sets each copy's store key and text
        return [replace(self.memo[key], meta=dict(self.memo[key].meta)) for key in keys]

    def encode_windowed(self, facts, windows, w):
        return self._cached("turns", self.inner.encode_windowed, facts, windows, w)

    def encode_listed(self, facts, previous, w):
        return self._cached("facts", self.inner.encode_listed, facts, previous, w)

    def encode_conversation(self, facts, spans, w):
        return self._cached("conversation", self.inner.encode_conversation, facts, spans, w)


def run_grid(llm, services, plan, args, fh, done) -> int:
    from inferscale.serving.memory_llm import MemoryRequest

    ks, ws = args.k, args.w
    first = (ws[0], args.kv_dtype[0])  # retrieval: the first w's service and user
    methods = grid_methods(args)
    n_new = 0
    for s, turns, facts, questions in plan:
        sid = s.conversation.id
        need = [(qi, q) for qi, q in questions
                if any((sid, m, w, k, qi) not in done for k in ks for m, w, _, _ in methods)]
        if not need:
            print(f"{sid}: all rows done")
            continue
        users = {key: user_of(sid, key[0], args.context, key[1]) for key in services}
        ingest(services, users, sid, turns, facts)
        source = {f.id: f.source_turn for f in facts}
        t_conv = time.perf_counter()
        for b in range(0, len(need), args.batch):
            items = []
            for qi, q in need[b: b + args.batch]:
                for k in ks:
                    t0 = time.perf_counter()
                    ids = arrange([f.fact_id for f in services[first].search(users[first], q.question, k)],
                                  args.order)
                    search_s = time.perf_counter() - t0
                    ev = set(q.evidence)
                    recall = (len(ev & {source[i] for i in ids}) / len(ev)) if ev else None
                    for method, w, policy, dtype in methods:
                        base = {"conversation": sid, "method": method, "w": w, "k": k, "question_idx": qi}
                        if report.row_key(base) in done:
                            continue
                        key = first if w is None else (w, dtype)
                        row = dict(base, category=q.category, question=q.question, gold=q.answer, facts=ids,
                                   evidence_recall=recall, search_s=search_s)
                        mode = "text" if policy is None else "inject"
                        items.append((row, MemoryRequest(users[key], q.question, k=k, mode=mode, fact_ids=tuple(ids),
                                                         w=key[0], max_tokens=args.max_tokens, policy=policy,
                                                         boundary=with_boundary(method))))
            n_new += answer_batch(llm, items, args, fh, done)
            print(f"  {sid}: {min(b + args.batch, len(need))}/{len(need)} questions "
                  f"({time.perf_counter() - t_conv:.0f} s, {n_new} new answers)", flush=True)
    return n_new


# -- phases 2-5 -----------------------------------------------------------------------------------
def footprint(llm, svc, plan, key, context) -> dict:
    """KV bytes of each conversation's user of `key` = (w, store dtype), next to its facts' text."""
    from inferscale.common.storage.paths import user_store_dir

    out = {}
    for s, _, facts, _ in plan:
        user = user_of(s.conversation.id, key[0], context, key[1])
        rows = svc.fact_plan(user, [f.fact_id for f in svc.list(user)]).facts
        store_dir = user_store_dir(llm.config.memory_root, user)
        on_disk = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
        out[s.conversation.id] = report.kv_footprint(llm.encoder.spec, sum(len(t) for _, _, t in rows), len(rows),
                                                     sum(len(f.text.encode()) for f in facts), on_disk, key[1])
    return out


def ttft_methods(args) -> tuple[str, ...]:
    """`ttft.run_one`'s names of the grid's methods (text is "joint"), then the question alone."""
    methods = ("joint", "inject", *[f"inject+{p}" for p in args.policies if p != "none"])
    if args.boundary != "no":  # the same methods served with the memory's boundary
        methods = (() if args.boundary == "yes" else methods) + tuple(m + END for m in methods)
    return methods + ("none",)


def run_ttft(llm, plan, args) -> list[dict]:
    """TTFT vs k on the first conversation (w = the first w): per question and k, joint / inject /
    the question alone, rotated; one untimed warm-up round first."""
    import ttft

    s, _, _, questions = plan[0]
    user, w = user_of(s.conversation.id, args.w[0], args.context, args.kv_dtype[0]), args.w[0]
    qs = [q.question for _, q in questions[: args.ttft_questions + 1]]
    cached = ttft.CachedTokens(llm)
    methods = ttft_methods(args)
    rows = []
    for n, question in enumerate(qs):  # the first question is the warm-up
        for k in args.ttft_k:
            ids, search_s = ttft.retrieve(llm, question, k, user=user, w=w)
            ids = arrange(ids, args.order)
            order = methods[n % len(methods):] + methods[: n % len(methods)]
            for m in order if k else ("none",):
                r = ttft.run_one(llm, cached, m, question, k, ids, search_s, uuid.uuid4().hex, user=user, w=w)
                if n:
                    rows.append(r)
    return rows


def run_throughput(args, conversation_index: int, out: Path) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).with_name("throughput.py")), str(args.path), "--conversation",
           str(conversation_index), "--concurrency", ",".join(map(str, args.throughput)), "--json", str(out),
           "--kv-dtype", args.kv_dtype[0]]
    cmd += ["--quick"] if args.quick else ["--users", "2", "--requests", "64", "--seconds", "60"]
    if args.model:
        cmd += ["--model", args.model]
    print("throughput:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["summary"]


def run_judge(args, done: dict, wanted, fh) -> int:
    """Judge every wanted row not judged yet. The judge is greedy, so rows that give the same
    answer to the same question (several methods often do) share one verdict: an answer judged
    already passes its verdict on, and each other distinct answer is asked once. A reply without a
    label is kept in the row (`judge_reply`, `judge` None) and not asked again; a failed request is
    retried by the next --resume."""
    from inferscale.evaluation.judge import Judge, verdict_key

    def key(r: dict) -> tuple:
        return verdict_key(r["question"], r["gold"], r["prediction"])

    todo = [r for r in done.values() if wanted(r) and r.get("prediction") is not None and r.get("judge") is None
            and "judge_reply" not in r]
    if not todo:
        return 0
    known = {key(r): r for r in done.values() if r.get("judge") is not None and r.get("prediction") is not None}
    rows_of: dict[tuple, list[dict]] = {}  # each distinct answer still to judge -> its rows
    n_ok = 0
    for r in todo:
        same = known.get(key(r))
        if same is not None:
            _write(fh, done, dict(r, judge=same["judge"], judge_reply=same.get("judge_reply", "")))
            n_ok += 1
        else:
            rows_of.setdefault(key(r), []).append(r)
    print(f"judge: {len(todo)} rows, {n_ok} take the verdict of an identical judged answer, "
          f"{len(rows_of)} distinct answers to judge", flush=True)
    if not rows_of:
        return n_ok
    judge = Judge(args.judge)
    t0 = time.perf_counter()
    n_unlabeled = n_failed = 0
    first_error = None
    pending = list(rows_of.items())  # a key is the rubric's three fields, as the prompt writes them
    for b in range(0, len(pending), 64):
        chunk = pending[b: b + 64]
        verdicts = judge.judge_many([k for k, _ in chunk])
        for (_, rows), v in zip(chunk, verdicts):
            if v.correct is not None:
                for r in rows:
                    _write(fh, done, dict(r, judge=int(v.correct), judge_reply=v.reply[:500]))
                n_ok += len(rows)
            elif v.error:
                n_failed += len(rows)
                first_error = first_error or v.error
            else:
                for r in rows:
                    _write(fh, done, dict(r, judge_reply=v.reply[:500]))
                n_unlabeled += len(rows)
        print(f"  judged {min(b + 64, len(pending))}/{len(pending)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"judge: {n_ok} rows with a verdict, {n_unlabeled} whose reply had no CORRECT/WRONG label, {n_failed} "
          f"whose request failed" + (f" (first: {first_error[:200]})" if first_error else "")
          + "; failed requests are retried on --resume", flush=True)
    return n_ok


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vllm_cpu_env()
    from inferscale.evaluation.locomo import load_locomo
    from inferscale.models import resolve_model

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "results.jsonl"
    if not args.resume:
        for name in ("results.jsonl", "footprint.json", "ttft.json", "throughput.json"):
            (args.out / name).unlink(missing_ok=True)  # a fresh run
    done = report.load_rows(jsonl)
    all_samples = load_locomo(args.path, categories=args.categories, include_event_summaries=args.event_summaries)
    samples = select_samples(all_samples, args.conversations)
    ks, ws = args.k, args.w
    plan = []  # (sample, turns, facts, questions)
    for s in samples:
        turns, facts = select_memory(s.conversation, args.max_facts)
        plan.append((s, turns, facts, select_questions(s, turns, args.limit, args.max_facts is not None)))
    methods = grid_methods(args)
    keys = {(s.conversation.id, m, w, k, qi) for s, _, _, qs in plan for qi, _ in qs for k in ks
            for m, w, _, _ in methods}
    pending = 0 if "answers" in args.skip else len(keys - set(done))
    print(f"{len(plan)} conversation(s), {sum(len(q) for *_, q in plan)} questions, k={list(ks)}, w={list(ws)}: "
          f"{len(keys)} answers, {pending} to run ({len(keys & set(done))} already in {jsonl})", flush=True)
    paths = {n: args.out / f"{n}.json" for n in ("footprint", "ttft", "throughput")}
    need_ttft = "ttft" not in args.skip and args.ttft_questions > 0 and not paths["ttft"].exists()

    model = str(resolve_model(args.model))
    root, tmp = memory_root(args.memory_root, "inferscale-locomo-")
    n_new = 0
    try:
        if pending or need_ttft or not paths["footprint"].exists():
            from dataclasses import replace

            from inferscale.memory.service import MemoryService
            from inferscale.serving.memory_llm import MemoryLLM, MemoryLLMConfig

            t0 = time.perf_counter()
            llm = MemoryLLM(MemoryLLMConfig(model=model, memory_root=root, w=ws[0], context=args.context,
                                            max_model_len=MAX_MODEL_LEN, kv_dtype=args.kv_dtype[0],
                                            cpu_kv_cache_gib=args.kv_cache_gib, encoder_device=args.encoder_device,
                                            query_weights=args.query_weights))
            print(f"MemoryLLM started in {time.perf_counter() - t0:.1f} s ({model})", flush=True)
            # one service per (w, store dtype), on one root, encoder and embedder
            first = (ws[0], args.kv_dtype[0])
            if len(args.kv_dtype) == 1:
                services = {(w, args.kv_dtype[0]): llm.memory_for(w) for w in ws}
                extra = []
            else:  # every dtype stores the same encodings; the first dtype's users are ingested first
                encoder = ReusedEncodings(llm.encoder)
                services = {(w, d): MemoryService(replace(llm.memory_config(w), kv_dtype=d), encoder,
                                                  llm.memory.embedder) for d in args.kv_dtype for w in ws}
                extra = list(services.values())
            try:
                if pending:
                    with jsonl.open("a") as fh:
                        n_new = run_grid(llm, services, plan, args, fh, done)
                fp_keys = [(ws[0], d) for d in args.kv_dtype]  # footprint: the first w, every dtype
                for s, turns, facts, _ in plan:  # TTFT uses the first w and dtype (even on a resume)
                    ingest({key: services[key] for key in fp_keys},
                           {key: user_of(s.conversation.id, key[0], args.context, key[1]) for key in fp_keys},
                           s.conversation.id, turns, facts)
                fp = {}
                for key in fp_keys:
                    for cid, row in footprint(llm, services[key], plan, key, args.context).items():
                        fp[cid if key == first else f"{cid} ({key[1]})"] = row
                paths["footprint"].write_text(json.dumps(fp, indent=1))
                if need_ttft:
                    t0 = time.perf_counter()
                    paths["ttft"].write_text(json.dumps(run_ttft(llm, plan, args), indent=1))
                    print(f"TTFT vs k measured in {time.perf_counter() - t0:.0f} s", flush=True)
            finally:
                for svc in extra:
                    svc.close()
                llm.close()  # the engine's processes and the memory services, before throughput's server
        if "throughput" not in args.skip and not paths["throughput"].exists():
            idx = [s.conversation.id for s in all_samples].index(plan[0][0].conversation.id)
            run_throughput(args, idx, paths["throughput"])
    finally:
        if tmp is not None:
            tmp.cleanup()

    wanted_q = {(s.conversation.id, qi) for s, _, _, qs in plan for qi, _ in qs}
    wanted = lambda r: ((r["conversation"], r["question_idx"]) in wanted_q and r["k"] in ks  # noqa: E731
                        and (r["w"] is None or r["w"] in ws))
    if args.judge_local:  # the benchmark's engine is gone: the judge's server has the machine
        from local_judge import local_judge

        with local_judge(model, args.out / "judge-server.log", args.judge_concurrency) as args.judge:
            with jsonl.open("a") as fh:
                run_judge(args, done, wanted, fh)
    elif args.judge:
        with jsonl.open("a") as fh:
            run_judge(args, done, wanted, fh)
    rows = [r for r in done.values() if wanted(r) and r.get("prediction") is not None]
    write_report(args, plan, rows, done, model, paths, time.perf_counter() - t_start, n_new)


def write_report(args, plan, rows, done, model, paths, wall, n_new) -> None:
    load = lambda p: json.loads(p.read_text()) if p.exists() else None  # noqa: E731
    summary = report.summarise(rows)
    fp, tt, tp = load(paths["footprint"]), load(paths["ttft"]), load(paths["throughput"])
    tsum = report.ttft_summary(tt) if tt else []
    tp_rows = tp["summary"] if isinstance(tp, dict) else []
    plots = report.plot_accuracy(summary, args.out) + report.plot_ttft(tsum, args.out) + \
        report.plot_throughput(tp_rows, args.out)
    md = [f"# LoCoMo: KV injection vs facts as text ({len(plan)} conversation(s), "
          f"{sum(len(q) for *_, q in plan)} questions)\n",
          f"Model {Path(model).name}; greedy, max_tokens={args.max_tokens}; seed {SEED}.\n", "## Accuracy\n",
          report.markdown(summary, args.categories)]
    if tsum:
        md += ["## Time to first token vs k\n", report.ttft_markdown(tsum)]
    if tp_rows:
        md += ["## Throughput vs concurrent users\n", report.throughput_markdown(tp_rows)]
    if fp:
        md += ["## KV footprint per conversation\n", report.footprint_markdown(fp)]
    text = "\n".join(md)
    meta = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "judge"},
            "judge": None if args.judge is None else {"base_url": args.judge.base_url, "model": args.judge.model},
            "model": Path(model).name, "max_model_len": MAX_MODEL_LEN, "max_tokens": args.max_tokens, "seed": SEED,
            "decoding": "greedy (temperature 0)", "versions": report.versions(), "machine": report.machine(),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": wall,
            "new_answers": n_new, "rows": len(rows), "errors": sum(1 for r in done.values() if r.get("error")),
            "fact_set_mismatches": report.fact_set_mismatches(rows),
            "plots": plots}
    (args.out / "results.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "ttft": tsum, "throughput": tp_rows, "footprint": fp}, indent=1))
    (args.out / "results.md").write_text(text)
    print()
    print(text)
    print(f"same fact ids for every method at each (question, k): "
          f"{'yes' if meta['fact_set_mismatches'] == 0 else 'NO, ' + str(meta['fact_set_mismatches']) + ' groups differ'}")
    print(f"wrote {args.out}/results.jsonl, results.json, results.md{', plots' if plots else ''}; "
          f"wall time {wall:.1f} s")


if __name__ == "__main__":
    main()
