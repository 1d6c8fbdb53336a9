"""Fidelity of KV injection vs joint prefill on LoCoMo, as a function of k and w.

For every question: retrieve the top-k facts of its conversation (all-MiniLM-L6-v2, exact
cosine), lay them out in conversation order, and score the gold answer twice with the JAX
engine: once by joint prefill of the whole prompt text ("joint", the oracle) and once with the
facts' KV encoded independently by Context-Window Encoding with `w` preceding turns and injected
("inject", the real use). Reported per (k, w):

* KL(joint || inject) of the next-token distribution at the first answer token,
* top-1 agreement (same argmax at the first answer token),
* mean log-likelihood per token of the gold answer under each method, and their difference.

With `--policies`, injection runs once per recovery policy (`inferscale.common.prompt.recovery`: `none`
= plain injection, `last:N` = recompute the last N facts, `heads:N` = recompute the first N tokens
of every fact, `blend:R` = recompute the R% of memory tokens whose KV deviates most from joint
prefill's at layer 1 (CacheBlend), `keys:S` = inject everything with the memory's keys scaled by
S/100 (an attention temperature, as APE), `all` = recompute everything, which equals joint prefill); each
row reports the share of memory tokens the policy recomputes. `--order` is every benchmark's
(`bench_args.ORDERS`): `relevance` lays the facts out most relevant first (the server's order),
`relevance_last` least relevant first, so the most relevant sit next to the question (and are the
ones `last:N` recomputes).
`--context facts` encodes each fact after the w facts before it in the memory, rendered as the
memory block renders them (list-context encoding), instead of after w conversation turns.

    python benchmarks/fidelity.py                      # every LoCoMo conversation and question
    python benchmarks/fidelity.py --quick              # one conversation, a few questions
    python benchmarks/fidelity.py --k 5,20 --w 0,20 --conversations 2 --questions 30 --json out.json
    python benchmarks/fidelity.py --k 10 --w 5 --policies none,last:2,heads:4 --order relevance_last

Fact encodings are computed once per (fact, w) and shared by all questions and all k. The joint
prefill does not depend on w, so it runs once per (question, k).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_args import ORDERS, arrange, int_list, positive  # noqa: E402  (benchmarks/ is the script's folder)
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, str(REPO_ROOT))

from inferscale.evaluation.locomo import load_locomo  # noqa: E402

from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH
from inferscale.retrieval.vector_index import ExactIndex  # noqa: E402
from inferscale.common.prompt.recovery import RecoveryPolicy, recompute_share  # noqa: E402

DEFAULT_K = (5, 10, 20, 50)
DEFAULT_W = (0, 5, 20)
EMBEDDER = "all-MiniLM-L6-v2"
# --quick: one conversation, a few questions. On 2 busy CPU cores the encoder does ~100-250
# tokens/s, and a fact at w=20 is a ~1k-token forward, so the memory that has to be encoded (the
# union of the questions' top-k facts) is what sets the run time; see `main`'s --help.
QUICK = {"conversations": 1, "questions": 3, "k": (5, 10), "w": DEFAULT_W}


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="KL / top-1 agreement / gold-answer log-likelihood of KV injection vs joint prefill "
                    "on LoCoMo, per number of retrieved facts k and encoding window w.")
    p.add_argument("path", nargs="?", default=None,
                   help=f"LoCoMo locomo10.json (default: {DEFAULT_LOCOMO_PATH} relative to the repository root)")
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--k", type=int_list(None), default=None,
                   help=f"retrieved facts per question, comma-separated (default {','.join(map(str, DEFAULT_K))})")
    p.add_argument("--w", type=int_list(None), default=None,
                   help=f"encoding context windows in turns (default {','.join(map(str, DEFAULT_W))})")
    p.add_argument("--conversations", type=positive, default=None, help="first N conversations (default all)")
    p.add_argument("--questions", type=positive, default=None,
                   help="N questions per conversation, sampled with --seed (default all)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK['conversations']} conversation, {QUICK['questions']} questions, "
                        f"k={','.join(map(str, QUICK['k']))}, w={','.join(map(str, QUICK['w']))} "
                        "(explicit --k/--w/--conversations/--questions override); a few minutes on 2 CPU cores")
    p.add_argument("--seed", type=int, default=0, help="question sampling seed (default 0)")
    p.add_argument("--max-answer-tokens", type=positive, default=15,
                   help="score at most this many gold-answer tokens (default 15; longer answers are cut)")
    p.add_argument("--policies", type=policy_list, default=(RecoveryPolicy(),),
                   help="recovery policies for injection, comma-separated: none, all, last:N, heads:N "
                        "(default none)")
    p.add_argument("--context", choices=("turns", "facts"), default="turns",
                   help="what a fact is encoded after: its w preceding conversation turns (Context-Window "
                        "Encoding, default) or the w facts before it in the memory, rendered as served")
    p.add_argument("--order", choices=ORDERS, default="conversation",
                   help="fact order in the prompt: conversation order (default), most relevant first (relevance, "
                        "the server's) or last, next to the question (relevance_last)")
    p.add_argument("--json", dest="json_out", default=None, help="write per-question results and the table here")
    args = p.parse_args(argv)
    if args.quick:
        for name in ("conversations", "questions", "k", "w"):
            if getattr(args, name) is None:
                setattr(args, name, QUICK[name])
    args.k = tuple(sorted(set(args.k or DEFAULT_K)))
    args.w = tuple(sorted(set(args.w or DEFAULT_W)))
    if min(args.k) < 1:
        p.error("--k values must be >= 1")
    if min(args.w) < 0:
        p.error("--w values must be >= 0")
    return args


def policy_list(text: str) -> tuple[RecoveryPolicy, ...]:
    try:
        out = tuple(RecoveryPolicy.parse(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out:
        raise argparse.ArgumentTypeError("name at least one policy")
    return out


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------
def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl(lp: np.ndarray, lq: np.ndarray) -> np.ndarray:
    """KL(p || q) along the last axis, from log-probabilities."""
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def gold_ll(lp: np.ndarray, answer: list[int]) -> float:
    """Mean log-probability per token of `answer` (row i of `lp` predicts answer[i])."""
    return float(np.mean(lp[np.arange(len(answer)), answer]))


@dataclass
class JointRef:
    """What the joint prefill of one (question, k) leaves for comparison with every w."""
    logp: np.ndarray  # [n_answer, vocab] float64 log-probs at the answer positions
    ll: float


@dataclass
class Row:
    conversation: str
    question: str
    category: int
    k: int  # requested
    k_eff: int  # facts actually retrieved (the memory may hold fewer)
    w: int
    answer_tokens: int
    kl_first: float
    kl_answer: float  # mean KL over the scored answer positions (teacher-forced)
    top1_agree: bool
    ll_joint: float
    ll_inject: float
    policy: str = "none"
    recompute_share: float = 0.0  # of the memory's fact tokens


@dataclass
class EncodeStats:
    facts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    by_w: dict = field(default_factory=dict)  # w -> [facts, tokens, seconds]

    def add(self, w: int, facts: int, tokens: int, seconds: float) -> None:
        self.facts += facts
        self.tokens += tokens
        self.seconds += seconds
        cur = self.by_w.setdefault(w, [0, 0, 0.0])
        cur[0] += facts
        cur[1] += tokens
        cur[2] += seconds


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def answer_ids(engine, answer: str, max_tokens: int) -> list[int]:
    """Token ids of the gold answer, as its text follows the assistant generation prompt.

    The prompt ends with the template's generation prompt (for ChatML "<|im_start|>assistant\n"),
    so the answer text starts fresh: no leading space, no special tokens.
    """
    return engine.tokenizer.encode(answer.strip(), add_special_tokens=False)[:max_tokens]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def length_groups(engine, conv, fact_indices: list[int], w: int) -> list[list[int]]:
    """Split facts by the power-of-two length their encoding input pads to.

    The encoder pads each batch to the power of two above its longest item, so one long window
    (say 1100 tokens) in a batch of ~800-token ones doubles that batch's cost; encoding each
    length class of 512 tokens and more on its own keeps every batch at its own size. Shorter
    inputs stay together: splitting them saves little and costs extra compiled shapes.
    """
    groups: dict[int, list[int]] = {}
    for i in fact_indices:
        f = conv.facts[i]
        ctx, ids = engine.builder.encode_plan(f.text, f.date, conv.context_window(f, w))
        groups.setdefault(max(256, _pow2(len(ctx) + len(ids))), []).append(i)
    return [groups[b] for b in sorted(groups)]


def select_questions(questions: list, n: int | None, seed: int) -> list:
    if n is None or n >= len(questions):
        return list(questions)
    keep = sorted(random.Random(seed).sample(range(len(questions)), n))
    return [questions[i] for i in keep]


def run(args: argparse.Namespace, console) -> dict:
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    path = Path(args.path) if args.path else (REPO_ROOT / DEFAULT_LOCOMO_PATH).resolve()
    samples = load_locomo(path)
    if args.conversations is not None:
        samples = samples[: args.conversations]
    work = []  # (sample, questions)
    for s in samples:
        qs = select_questions(s.questions, args.questions, args.seed)
        if qs and s.conversation.facts:
            work.append((s, qs))
    n_q = sum(len(qs) for _, qs in work)
    console.print(f"data: {path} — {len(work)} conversation(s), {n_q} question(s)")

    # -- retrieval ------------------------------------------------------------------------------
    t = time.perf_counter()
    from inferscale.retrieval.embedders import MiniLMEmbedder

    embedder = MiniLMEmbedder()
    kmax = max(args.k)
    retrieved = []  # per conversation: [n_q, kmax] fact indices, best first
    for s, qs in work:
        facts = s.conversation.facts
        index = ExactIndex(embedder.dim)  # exact cosine: rankings do not depend on index parameters
        index.add(range(len(facts)), embedder.embed([f.text for f in facts]))
        _, idx = index.search(embedder.embed([q.question for q in qs]), min(kmax, len(facts)))
        retrieved.append(idx)
    del embedder
    t_retrieval = time.perf_counter() - t

    # -- engine ---------------------------------------------------------------------------------
    from inferscale.jax.engine import Engine

    t = time.perf_counter()
    engine = Engine.from_pretrained(args.model_dir)
    t_load = time.perf_counter() - t
    console.print(f"engine: {engine.spec.num_layers} layers, kernels={engine.kernels}, "
                  f"dtype={engine.config.dtype}, max_context={engine.max_context}, backend={_backend()} "
                  f"(load {t_load:.1f} s; retrieval {t_retrieval:.1f} s)")

    pad_id = next(iter(sorted(engine.eos_ids)), 0)
    cont_len = args.max_answer_tokens  # every continuation padded to this length: one compiled shape
    rows: list[Row] = []
    skipped: list[dict] = []
    enc_stats = EncodeStats()
    total = sum(len(qs) for _, qs in work) * len(args.k) * (1 + len(args.w) * len(args.policies))
    bar = tqdm(total=total, desc="scoring", unit="call", dynamic_ncols=True)

    for (s, qs), idx in zip(work, retrieved):
        conv = s.conversation
        answers = [answer_ids(engine, q.answer, cont_len) for q in qs]
        # fact indices per (question, k), idx best first; facts[] is in conversation order
        picks = {(qi, k): arrange([int(i) for i in idx[qi][:k]], args.order) for qi in range(len(qs)) for k in args.k}
        needed = sorted({i for v in picks.values() for i in v})
        joint: dict[tuple[int, int], JointRef | None] = {}
        for wi, w in enumerate(args.w):
            # encode the union of the facts any question needs, once per w
            facts = [conv.facts[i] for i in needed]
            bar.set_postfix_str(f"{conv.id}: encoding {len(facts)} facts at w={w}")
            t = time.perf_counter()
            kv_by_idx = {}
            bar_of = lambda it: tqdm(it, desc=f"encode w={w}", unit="batch", leave=False,  # noqa: E731
                                     dynamic_ncols=True)
            if args.context == "facts":
                kv_by_idx.update(zip(needed, engine.encode_after_facts(conv.facts, w, needed, progress=bar_of)))
            else:
                for group in length_groups(engine, conv, needed, w):
                    kvs = engine.encode_facts([conv.facts[i] for i in group], conv, w, progress=bar_of)
                    kv_by_idx.update(zip(group, kvs))
            enc_stats.add(w, len(facts), sum(kv.num_tokens for kv in kv_by_idx.values()),
                          time.perf_counter() - t)
            bar.set_postfix_str(f"{conv.id}: w={w}")
            for qi, q in enumerate(qs):
                ans = answers[qi]
                for k in args.k:
                    if not ans:
                        if wi == 0:
                            skipped.append({"conversation": conv.id, "question": q.question, "k": k,
                                            "reason": "empty gold answer"})
                        bar.update(len(args.policies) + (wi == 0))
                        continue
                    mem = [kv_by_idx[i] for i in picks[(qi, k)]]
                    cont = ans + [pad_id] * (cont_len - len(ans))
                    n = len(ans)
                    if wi == 0:
                        try:
                            lj = engine.score(q.question, mem, cont, mode="joint")
                        except ValueError as e:  # prompt does not fit the context
                            joint[(qi, k)] = None
                            skipped.append({"conversation": conv.id, "question": q.question, "k": k,
                                            "reason": str(e)})
                        else:
                            lpj = log_softmax64(lj[:n])
                            joint[(qi, k)] = JointRef(lpj, gold_ll(lpj, ans))
                        bar.update(1)
                    ref = joint[(qi, k)]
                    for policy in args.policies:
                        if ref is not None:
                            li = engine.score(q.question, mem, cont, mode="inject", policy=policy)
                            lpi = log_softmax64(li[:n])
                            kls = kl(ref.logp, lpi)
                            layout = engine.layout(q.question, mem)
                            rows.append(Row(conv.id, q.question, q.category, k, len(mem), w, n,
                                            float(kls[0]), float(kls.mean()),
                                            bool(np.argmax(ref.logp[0]) == np.argmax(lpi[0])),
                                            ref.ll, gold_ll(lpi, ans), str(policy),
                                            recompute_share(layout, policy.mask(layout, np.zeros(len(layout))))))
                        bar.update(1)
            del kv_by_idx  # free this w's KV before encoding the next
    bar.close()
    return {
        "rows": rows, "skipped": skipped, "encode": enc_stats, "wall_s": time.perf_counter() - t_start,
        "load_s": t_load, "retrieval_s": t_retrieval, "n_questions": n_q, "data": str(path),
        "engine": {"kernels": engine.kernels, "dtype": engine.config.dtype, "max_context": engine.max_context,
                   "backend": _backend(), "fingerprint": engine.fingerprint},
    }


def _backend() -> str:
    import jax

    return jax.default_backend()


def summarize(rows: list[Row], ks, ws, policies=("none",)) -> list[dict]:
    out = []
    for k in ks:
        for w in ws:
            for policy in map(str, policies):
                sel = [r for r in rows if r.k == k and r.w == w and r.policy == policy]
                if not sel:
                    out.append({"k": k, "w": w, "policy": policy, "n": 0})
                    continue
                ll_j = np.array([r.ll_joint for r in sel])
                ll_i = np.array([r.ll_inject for r in sel])
                out.append({
                    "k": k, "w": w, "policy": policy, "n": len(sel),
                    "k_eff_mean": float(np.mean([r.k_eff for r in sel])),
                    "recompute_share": float(np.mean([r.recompute_share for r in sel])),
                    "kl_first_mean": float(np.mean([r.kl_first for r in sel])),
                    "kl_first_median": float(np.median([r.kl_first for r in sel])),
                    "kl_answer_mean": float(np.mean([r.kl_answer for r in sel])),
                    "top1_agree": float(np.mean([r.top1_agree for r in sel])),
                    "ll_joint_mean": float(ll_j.mean()),
                    "ll_inject_mean": float(ll_i.mean()),
                    "ll_delta_mean": float((ll_i - ll_j).mean()),
                })
    return out


def print_tables(console, summary: list[dict], result: dict) -> None:
    from rich.table import Table

    t = Table(title="KV injection vs joint prefill")
    for col in ("k", "w", "policy", "recomputed", "n", "mean KL", "top-1 agree", "LL joint", "LL inject",
                "Δ LL (inj−joint)"):
        t.add_column(col, justify="right")
    for s in summary:
        if not s["n"]:
            t.add_row(str(s["k"]), str(s["w"]), s["policy"], "-", "0", *["-"] * 5)
            continue
        t.add_row(str(s["k"]), str(s["w"]), s["policy"], f"{100 * s['recompute_share']:.0f}%", str(s["n"]),
                  f"{s['kl_first_mean']:.4f}",
                  f"{100 * s['top1_agree']:.1f}%", f"{s['ll_joint_mean']:.3f}", f"{s['ll_inject_mean']:.3f}",
                  f"{s['ll_delta_mean']:+.3f}")
    console.print(t)
    console.print("mean KL = KL(joint || inject) and top-1 agree = same argmax, both at the first answer token; "
                  "LL = mean log-likelihood per gold-answer token (joint does not depend on w)")

    enc: EncodeStats = result["encode"]
    e = Table(title="Fact encoding (once per fact and w)")
    for col in ("w", "facts", "fact tokens", "seconds", "ms / fact"):
        e.add_column(col, justify="right")
    for w, (nf, nt, sec) in sorted(enc.by_w.items()):
        e.add_row(str(w), str(nf), str(nt), f"{sec:.1f}", f"{1000 * sec / max(nf, 1):.0f}")
    e.add_row("all", str(enc.facts), str(enc.tokens), f"{enc.seconds:.1f}",
              f"{1000 * enc.seconds / max(enc.facts, 1):.0f}")
    console.print(e)
    console.print("encoding seconds include JIT compilation of each new shape")
    if result["skipped"]:
        reasons = {}
        for s in result["skipped"]:
            reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
        console.print(f"skipped {len(result['skipped'])} (question, k) pair(s): "
                      + "; ".join(f"{n} × {r}" for r, n in reasons.items()))
    console.print(f"wall time {result['wall_s']:.1f} s (engine load {result['load_s']:.1f} s, "
                  f"embedding + retrieval {result['retrieval_s']:.1f} s, encoding {enc.seconds:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # the embedder and the model load from local files only
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file: do not wrap the tables at 80 columns
        console = Console(width=120)
    from inferscale.models import resolve_model

    model_dir = resolve_model(args.model)
    args.model_dir = model_dir
    cmd = " ".join(shlex.quote(a) for a in (sys.argv if argv is None else ["fidelity.py", *argv]))
    console.print(f"[bold]InferScale fidelity[/bold]: {cmd}")
    console.print(f"model: {model_dir.name} ({model_dir}); embedder: {EMBEDDER}")
    console.print(f"k={','.join(map(str, args.k))} w={','.join(map(str, args.w))} "
                  f"conversations={args.conversations or 'all'} questions={args.questions or 'all'} "
                  f"seed={args.seed} max_answer_tokens={args.max_answer_tokens} "
                  f"policies={','.join(map(str, args.policies))} order={args.order} context={args.context}")

    result = run(args, console)
    summary = summarize(result["rows"], args.k, args.w, args.policies)
    print_tables(console, summary, result)

    if args.json_out:
        enc: EncodeStats = result["encode"]
        payload = {
            "args": {k: (list(map(str, v)) if k == "policies" else list(v) if isinstance(v, tuple)
                         else str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": str(model_dir), "embedder": EMBEDDER, "data": result["data"], "engine": result["engine"],
            "summary": summary,
            "encode": {"facts": enc.facts, "tokens": enc.tokens, "seconds": enc.seconds,
                       "by_w": {str(w): {"facts": v[0], "tokens": v[1], "seconds": v[2]}
                                for w, v in sorted(enc.by_w.items())}},
            "wall_s": result["wall_s"], "load_s": result["load_s"], "retrieval_s": result["retrieval_s"],
            "skipped": result["skipped"],
            "rows": [vars(r) for r in result["rows"]],
        }
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1, allow_nan=True))
        os.replace(tmp, out)
        console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
