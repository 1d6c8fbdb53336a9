"""The quality gate's statistics: is a method non-inferior to text within a tolerance delta?

The data of one method is its per-question **paired gap** to text (text's score minus the
method's, on the same question with the same facts), per conversation. The test:

* **Pooled over conversations, with a hierarchical paired bootstrap.** Each resample draws the
  conversations with replacement, then within each drawn conversation its questions with
  replacement, and pools the gaps of every drawn question (a question-weighted mean). The
  one-sided (1 - a) upper bound of the pooled gap is the (1 - a) quantile of the resampled
  means; the bootstrap p-value of "the gap is at least delta" is the share of resampled means
  above delta, so `p <= a` exactly when the bound at level a is `<= delta`.
* **No conversation significantly worse than delta.** Each conversation's own one-sided (1 - a)
  lower bound (the a quantile of its resampled means) must not lie above delta.
* **Holm over the methods tried.** Step-down over the methods' p-values (ascending): the i-th
  smallest of m is tested at a / (m - i + 1) and the steps stop at the first that fails, so the
  chance that any inferior method passes stays at most a however many methods are tried (Holm,
  1979). The conversation condition only takes passes away, so it keeps that guarantee.

A method passes when Holm's step reaches it and passes it and no conversation vetoes it.

Two-stage resampling counts the within-conversation noise twice, once in the spread of the
drawn conversations' means and once in the resampled questions, so with conversations that
differ little the bound is wider than the sampling error (about 1.33x with 5 conversations of
40 questions): the test is conservative, it serves text more often, never injection more often.
`pass_probability` and `resolvable_delta` model that, so the delta they report is the one the
test actually resolves (checked by simulation in tests/common/test_gate_statistics.py).

Plain Python and numpy; seeded, so a decision is reproducible.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from statistics import NormalDist
from typing import Mapping, Sequence

import numpy as np

ALPHA = 0.05  # one-sided: the pooled bound is a 95% upper bound, each conversation's a 95% lower bound
RESAMPLES = 10_000  # bootstrap resamples per method and measure
POWER = 0.9  # resolvable_delta: an equivalent method passes at least this often
# The per-question SD of the gold-token-recall gap assumed when planning how many questions to ask:
# an assumption, not a measurement (the shipped files kept no per-question recall); LoCoMo F1's gap
# has about 0.24 in them (gap_stderr x sqrt(40), 1.1-5.0 points)
PLANNING_SD = 0.25


@dataclass(frozen=True)
class GapTest:
    """One method's test on one measure (gaps as fractions: 0.05 = 5 points)."""

    gap: float  # pooled mean gap to text (positive: below text)
    upper: float  # one-sided (1 - alpha) upper bound of the pooled gap
    p: float  # bootstrap p-value of "the gap is at least delta"
    conversations: dict[str, tuple[float, float]]  # conversation -> (its mean gap, its one-sided lower bound)
    n: int  # questions pooled

    def worse(self, delta: float) -> list[str]:
        """The conversations significantly worse than delta: their lower bound above it."""
        return [c for c, (_, low) in self.conversations.items() if low > delta]


@dataclass(frozen=True)
class Verdict:
    """A method's outcome among the methods tried."""

    test: GapTest
    passed: bool
    level: float  # the Holm level it was tested at (alpha / (m - rank + 1))
    bound: float  # the upper bound at that level (what is compared with delta)
    reason: str


def seed_of(*parts: object) -> int:
    """A stable seed from names (`crc32`, not Python's salted hash)."""
    return zlib.crc32("\x1f".join(map(str, parts)).encode())


def bootstrap(groups: Sequence[Sequence[float]], resamples: int, rng: np.random.Generator
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Hierarchical bootstrap of the pooled mean of `groups` (one sequence of gaps per
    conversation): (pooled means, one array per resample; each conversation's own resampled
    means, from the same question resamples)."""
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    if not arrays or any(a.size == 0 for a in arrays):
        raise ValueError("every conversation needs at least one question")
    n = np.array([a.size for a in arrays])
    padded = np.zeros((len(arrays), n.max()))
    for c, a in enumerate(arrays):
        padded[c, : a.size] = a
    # stage 1: the conversations, with replacement; stage 2: each drawn one's questions, with
    # replacement, afresh for every draw (a conversation drawn twice is resampled twice)
    pick = rng.integers(0, len(arrays), size=(resamples, len(arrays)))
    size = n[pick][:, :, None]
    idx = (rng.random((resamples, len(arrays), n.max())) * size).astype(np.int64)
    drawn = padded[pick[:, :, None], idx]
    if (n != n.max()).any():
        drawn = np.where(np.arange(n.max()) < size, drawn, 0.0)
    pooled = drawn.sum(axis=(1, 2)) / n[pick].sum(axis=1)
    within = [a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1) for a in arrays]
    return pooled, within


def quantile(x: np.ndarray, q: float) -> float:
    """The smallest resampled value with at least a share q at or below it (inverted CDF), so
    that `quantile(x, 1 - a) <= delta` exactly when `mean(x > delta) <= a`."""
    return float(np.quantile(x, min(max(q, 0.0), 1.0), method="inverted_cdf"))


def gap_test(gaps: Mapping[str, Sequence[float]], delta: float, alpha: float = ALPHA,
             resamples: int = RESAMPLES, seed: int = 0) -> tuple[GapTest, np.ndarray]:
    """The pooled test of one method (`gaps`: conversation -> per-question gaps); also the
    pooled resamples, for bounds at other levels."""
    names = sorted(gaps)
    pooled, within = bootstrap([gaps[c] for c in names], resamples, np.random.default_rng(seed))
    flat = np.concatenate([np.asarray(gaps[c], dtype=np.float64) for c in names])
    convs = {c: (float(np.mean(gaps[c])), quantile(w, alpha)) for c, w in zip(names, within)}
    test = GapTest(float(flat.mean()), quantile(pooled, 1 - alpha), float(np.mean(pooled > delta)), convs, flat.size)
    return test, pooled


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[tuple[bool, float]]:
    """Holm's step-down: per hypothesis (in the order given), whether it is rejected and the
    level it was tested at. The i-th smallest p of m is tested at alpha / (m - i + 1); the first
    that is not rejected stops the steps (every later one is not rejected either)."""
    m = len(pvalues)
    out: list[tuple[bool, float]] = [(False, alpha)] * m
    going = True
    for rank, i in enumerate(sorted(range(m), key=lambda j: (pvalues[j], j))):
        level = alpha / (m - rank)
        going = going and pvalues[i] <= level
        out[i] = (going, level)
    return out


def noninferior(methods: Mapping[str, Mapping[str, Sequence[float]]], delta: float, alpha: float = ALPHA,
                resamples: int = RESAMPLES, seed: int = 0, holm_correction: bool = True,
                points: float = 100.0, unit: str = "points") -> dict[str, Verdict]:
    """The test of every method tried (`methods`: method -> conversation -> per-question gaps),
    with Holm's correction over them (`holm_correction=False`: each alone at alpha, for
    comparison). Each method is resampled with its own seed (`seed` and its name), so adding a
    method changes no other method's resamples. Reasons print gaps x`points` in `unit`."""
    names = list(methods)
    tests = {}
    for name in names:
        tests[name] = gap_test(methods[name], delta, alpha, resamples, seed_of(seed, name))
    steps = holm([tests[n][0].p for n in names], alpha) if holm_correction else [(tests[n][0].p <= alpha, alpha)
                                                                                 for n in names]
    pts = lambda x: f"{points * x:+.1f}"  # noqa: E731
    out = {}
    for name, (rejected, level) in zip(names, steps):
        test, pooled = tests[name]
        bound = quantile(pooled, 1 - level)
        worse = test.worse(delta)
        where = f"Holm level {alpha:g}/{round(alpha / level)}" if holm_correction and len(names) > 1 \
            else f"level {alpha:g}"
        if not rejected and test.p <= level:
            why = (f"Holm's steps stopped before it (its p {test.p:.4f} would pass at {level:.4f}, but a method "
                   "with a smaller p failed first)")
        elif not rejected:
            why = (f"upper bound {pts(bound)} {unit} ({where}) is above the tolerance {points * delta:.1f} "
                   f"(gap {pts(test.gap)}, p {test.p:.4f})")
        elif worse:
            low = {c: test.conversations[c] for c in worse}
            why = "significantly worse than the tolerance on " + ", ".join(
                f"{c} (gap {pts(g)}, lower bound {pts(lo)})" for c, (g, lo) in low.items())
        else:
            why = (f"gap {pts(test.gap)} {unit}, upper bound {pts(bound)} ({where}) within the tolerance "
                   f"{points * delta:.1f}; no conversation significantly worse")
        out[name] = Verdict(test, rejected and not worse, level, bound, why)
    return out


# -- what a number of questions can resolve ------------------------------------------------------
def bootstrap_se(questions: int, conversations: int, sd: float, between_sd: float = 0.0) -> float:
    """The expected standard deviation of the hierarchical bootstrap's pooled mean, for
    `conversations` of `questions` each, per-question gap SD `sd` and SD `between_sd` of the
    conversations' true gaps: the drawn conversations' spread (their means carry sd^2/n each)
    plus the resampled questions' (sd^2/n again, times (n-1)/n)."""
    c, n = conversations, questions
    return math.sqrt(((c - 1) / c * (between_sd ** 2 + sd ** 2 / n) + (n - 1) / n * sd ** 2 / n) / c)


def pass_probability(delta: float, questions: int, conversations: int, sd: float, methods: int = 1,
                     alpha: float = ALPHA, between_sd: float = 0.0, true_gap: float = 0.0) -> float:
    """About how often a method whose true pooled gap is `true_gap` passes at tolerance `delta`
    when tested at Holm's most demanding level (alpha / methods): normal approximations of the
    pooled mean (sampling SD sqrt(between^2/c + sd^2/(c n))) and of the bootstrap's bound
    (`bootstrap_se`), times the chance that no conversation vetoes it."""
    nd = NormalDist()
    c, n = conversations, questions
    se = math.sqrt(between_sd ** 2 / c + sd ** 2 / (c * n))
    pooled = nd.cdf((delta - true_gap - nd.inv_cdf(1 - alpha / methods) * bootstrap_se(n, c, sd, between_sd)) / se)
    conv_se = math.sqrt(between_sd ** 2 + sd ** 2 / n)
    veto = 1 - nd.cdf((delta - true_gap + nd.inv_cdf(1 - alpha) * sd * math.sqrt((n - 1) / n) / math.sqrt(n))
                      / conv_se)
    return pooled * (1 - veto) ** c


def resolvable_delta(questions: int, conversations: int, sd: float, methods: int = 1, alpha: float = ALPHA,
                     power: float = POWER, between_sd: float = 0.0) -> float:
    """The smallest tolerance at which a method as good as text (true gap 0) passes at least
    `power` of the time (`pass_probability`), as a fraction."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if pass_probability(mid, questions, conversations, sd, methods, alpha, between_sd) >= power:
            hi = mid
        else:
            lo = mid
    return hi


# the shipped calibrations' counts, and what more questions buy (LoCoMo has about 1,500 of
# categories 1-4 over 10 conversations)
TABLE_COUNTS = ((5, 40), (5, 100), (5, 200), (10, 150))
TABLE_SDS = (0.20, 0.25, 0.30)  # per-question SD of the gap (gold-token recall or J), as a fraction
TABLE_METHODS = (1, 6)  # one policy alone; the six policies `inferscale calibrate` tries by default


def resolution_table(counts=TABLE_COUNTS, sds=TABLE_SDS, methods=TABLE_METHODS, alpha: float = ALPHA,
                     power: float = POWER) -> str:
    """docs/quality.md's table: the tolerance (points) each count of questions resolves, per
    per-question SD and number of methods tried (`python -m inferscale.gate.noninferiority`)."""
    head = "| conversations x questions | policies tried | " + " | ".join(f"SD {100 * s:.0f}" for s in sds) + " |"
    rows = [head, "|---|---|" + "---|" * len(sds)]
    for c, n in counts:
        for m in methods:
            cells = [f"{100 * resolvable_delta(n, c, s, m, alpha, power):.1f}" for s in sds]
            rows.append(f"| {c} x {n} = {c * n} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - prints the docs table
    print(resolution_table())
