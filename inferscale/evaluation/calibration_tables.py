"""What `inferscale calibrate` prints: the run as a Markdown table (quality per k and method, the
gate's gap and bound, TTFT) and the gate's verdicts per method and measure, with their reasons."""

from __future__ import annotations

import statistics

from inferscale.gate.calibration import MEASURES, Calibration, Measured


def pooled(measured: list[Measured], measure: str, text: bool) -> float | None:
    """The question-weighted mean of text's (or the policy's) `measure` over `measured`'s
    conversations; None when a measurement kept no per-question scores of it."""
    if not measured or any(len(m.scores.get(measure, ())) != m.n for m in measured):
        return None
    values = [t if text else x for m in measured for t, x in m.scores[measure]]
    return statistics.fmean(values) if values else None


def table(cal: Calibration, ttft: dict[tuple[int, str], float]) -> str:
    """The run as a Markdown table: per k, text and each policy, quality pooled over the
    conversations (gold-token recall, LoCoMo F1), the gap the gate tested with its upper bound,
    the decision and (if timed) TTFT."""
    head = "| k | method | recomputes | gold recall | LoCoMo F1 | gold recall gap (points) | upper bound | gate |"
    rule = "|---|---|---|---|---|---|---|---|"
    if ttft:
        head, rule = head + " TTFT e2e ms | text / method TTFT |", rule + "---|---|"
    rows = [head, rule]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for k in sorted({m.k for m in cal.measured}):
        here = [m for m in cal.measured if m.k == k]
        text_ms = ttft.get((k, "text"))
        one = [m for m in here if m.policy == here[0].policy]  # text's scores, once per conversation
        text_f1 = pooled(one, "f1", True)
        if text_f1 is None:
            text_f1 = statistics.fmean(m.text_f1 for m in one)
        cells = [str(k), "text", "-", fmt(pooled(one, "recall", True)), fmt(text_f1), "-", "-", "-"]
        rows.append("| " + " | ".join(cells + ([f"{text_ms:,.0f}", "1.0x"] if ttft else [])) + " |")
        for p in dict.fromkeys(m.policy for m in here):
            mine = [m for m in here if m.policy == p]
            v = cal.verdicts.get((k, p))
            test = next(iter(v.tests.values()), None) if v else None
            f1 = pooled(mine, "f1", False)
            gap = f"{100 * test.test.gap:+.1f}" if test else "-"
            bound = f"{100 * test.bound:+.1f}" if test else "-"
            share = max(m.recompute_share for m in mine)
            cells = [str(k), f"inject+{p}", f"{100 * share:.0f}%", fmt(pooled(mine, "recall", False)),
                     fmt(f1 if f1 is not None else statistics.fmean(m.f1 for m in mine)), gap, bound,
                     "pass" if v and v.passed else "fail"]
            ms = ttft.get((k, p))
            rows.append("| " + " | ".join(cells + ([f"{ms:,.0f}", f"{text_ms / ms:.1f}x"] if ttft else [])) + " |")
    return "\n".join(rows)


def verdict_table(cal: Calibration) -> str:
    """Per method and correctness measure: the pooled gap, its upper bound at the Holm level it was
    tested at, each conversation's gap (* where it is significantly worse than the tolerance),
    LoCoMo F1's pooled gap beside them, and the decision; then each method's reason."""
    convs = sorted({m.data for m in cal.measured})
    rows = ["| k | policy | measure | pooled gap | upper bound (level) | " + " | ".join(convs)
            + " | LoCoMo F1 gap | decision |", "|---|---|---|---|---|" + "---|" * (len(convs) + 2)]
    reasons = []
    for (k, p), v in sorted(cal.verdicts.items(), key=lambda kv: (kv[0][0], kv[1].recompute_share, kv[0][1])):
        f1 = v.reported.get("f1")
        f1_cell = f"{100 * f1.test.gap:+.1f}" if f1 else "-"
        for measure, t in (v.tests.items() or [("-", None)]):
            if t is None:
                cells = ["-", "-"] + ["-"] * len(convs)
            else:
                worse = set(t.test.worse(cal.tolerance))
                cells = [f"{100 * t.test.gap:+.1f}", f"{100 * t.bound:+.1f} ({t.level:.4f})"] + [
                    f"{100 * t.test.conversations[c][0]:+.1f}" + ("*" if c in worse else "")
                    if c in t.test.conversations else "-" for c in convs]
            rows.append(f"| {k} | {p} | {MEASURES.get(measure, measure)} | " + " | ".join(cells)
                        + f" | {f1_cell} | {'pass' if v.passed else 'fail'} |")
        reasons.append(f"k={k} {p}: {'pass' if v.passed else 'fail'}: {v.reason}")
    return "\n".join(rows + [""] + reasons)
