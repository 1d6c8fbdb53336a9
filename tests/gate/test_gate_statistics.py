"""The gate's statistics (`gate.noninferiority`) on synthetic, seeded gaps: a method as good as
text passes at a tolerance its question count resolves, a method twice the tolerance worse fails,
Holm keeps trying several methods from inflating false passes, and docs/quality.md's table is the
committed function's.

The synthetic per-question gaps (text's score minus the method's) have the SD the gate plans with,
`PLANNING_SD` = 25 points of gold-token recall (LoCoMo F1's per-question gap has about 24 in the
shipped files): most questions answered alike (gap 0), the rest anywhere in [-1, 1], shifted by
the method's true gap. Five conversations of 40 questions, as the shipped calibrations."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.gate.noninferiority import (
    PLANNING_SD,
    bootstrap_se,
    gap_test,
    holm,
    noninferior,
    pass_probability,
    quantile,
    resolution_table,
    resolvable_delta,
    seed_of,
)

CONVS, QUESTIONS = 5, 40
RESAMPLES = 1000  # per method in these simulations (the gate uses 10,000)


def synthetic(rng, true_gap: float, sd: float = PLANNING_SD, convs: int = CONVS, n: int = QUESTIONS):
    """conversation -> per-question gaps: 0 with probability 1 - 3 sd^2, else uniform on [-1, 1]
    (SD sd), plus `true_gap`."""
    differ = 3 * sd ** 2
    return {f"conv-{c}": np.where(rng.random(n) < differ, rng.uniform(-1, 1, n), 0.0) + true_gap
            for c in range(convs)}


def pass_rates(true_gaps: dict[str, float], delta: float, runs: int, seed: int, resamples: int = RESAMPLES
               ) -> dict[str, float]:
    """Over `runs` seeded runs of the methods (name -> true gap) tried together: how often each
    passes ("name"), how often any passes ("any"), and the same tested each alone at 5%, without
    Holm ("name alone", "any alone"), on the same resamples."""
    rng = np.random.default_rng(seed)
    hits: dict[str, int] = {}
    for r in range(runs):
        methods = {name: synthetic(rng, g) for name, g in true_gaps.items()}
        tests = {m: gap_test(methods[m], delta, resamples=resamples, seed=seed_of(r, m))[0] for m in methods}
        steps = holm([t.p for t in tests.values()])
        passed = {m: rejected and not t.worse(delta) for (m, t), (rejected, _) in zip(tests.items(), steps)}
        alone = {m: t.p <= 0.05 and not t.worse(delta) for m, t in tests.items()}
        for key, hit in [*passed.items(), ("any", any(passed.values())),
                         *((f"{m} alone", a) for m, a in alone.items()), ("any alone", any(alone.values()))]:
            hits[key] = hits.get(key, 0) + hit
    return {key: h / runs for key, h in hits.items()}


def test_the_synthetic_gaps_have_the_planned_sd():
    gaps = np.concatenate(list(synthetic(np.random.default_rng(0), 0.0, n=20_000).values()))
    assert abs(gaps.std() - PLANNING_SD) < 0.005 and abs(gaps.mean()) < 0.005


def test_an_equivalent_method_passes_at_a_tolerance_its_questions_resolve():
    """At the tolerance 5 x 40 questions resolve with 95% power (6.8 points for one method), a
    method as good as text passes at least 90% of the time; at the docs' 90%-power tolerance it
    passes about 90% of the time (the model behind docs/quality.md's table holds)."""
    delta = resolvable_delta(QUESTIONS, CONVS, PLANNING_SD, power=0.95)
    assert 0.065 < delta < 0.072
    assert pass_rates({"m": 0.0}, delta, 400, seed=1)["m"] >= 0.90
    at_90 = resolvable_delta(QUESTIONS, CONVS, PLANNING_SD)
    assert 0.85 <= pass_rates({"m": 0.0}, at_90, 400, seed=2)["m"] <= 0.95


def test_a_method_twice_the_tolerance_worse_fails():
    delta = resolvable_delta(QUESTIONS, CONVS, PLANNING_SD)
    assert pass_rates({"m": 2 * delta}, delta, 300, seed=3)["m"] <= 0.05
    # and one just at the tolerance (the hardest inferior case) passes at most alpha of the time
    assert pass_rates({"m": delta}, delta, 300, seed=4)["m"] <= 0.05


def test_holm_keeps_six_methods_at_the_tolerance_from_passing_more_often():
    """Six methods each exactly delta worse than text (inferior, barely): tested each alone at 5%,
    one of them passes far more often than 5%; with Holm, at most 5% of the time."""
    delta = resolvable_delta(QUESTIONS, CONVS, PLANNING_SD, methods=6)
    rates = pass_rates({f"m{i}": delta for i in range(6)}, delta, 200, seed=5, resamples=500)
    assert rates["any"] <= 0.05 and rates["any alone"] > 2 * rates["any"]


def test_six_equivalent_noisy_methods_do_not_carry_a_bad_one_through():
    """Six methods as good as text (noisy, as measured) tried beside one exactly the tolerance worse
    (inferior, barely): the six pass as Holm's steps go, and the bad one, reached last, passes no
    more often than alpha, nor than tested alone."""
    delta = resolvable_delta(QUESTIONS, CONVS, PLANNING_SD, methods=7)
    rates = pass_rates({**{f"ok{i}": 0.0 for i in range(6)}, "bad": delta}, delta, 150, seed=6, resamples=500)
    assert rates["bad"] <= 0.05 and rates["bad"] <= rates["bad alone"]
    assert min(rates[f"ok{i}"] for i in range(6)) >= 0.90


def test_the_analytic_bound_width_matches_the_bootstrap():
    """`bootstrap_se` (behind the resolvable tolerance) is the two-stage bootstrap's spread,
    which counts the within-conversation noise twice: wider than the pooled mean's true SE."""
    rng = np.random.default_rng(7)
    widths = []
    for r in range(60):
        v = noninferior({"m": synthetic(rng, 0.0)}, 0.05, resamples=RESAMPLES, seed=r)["m"]
        widths.append(v.test.upper - v.test.gap)
    predicted = 1.6449 * bootstrap_se(QUESTIONS, CONVS, PLANNING_SD)
    assert abs(np.mean(widths) / predicted - 1) < 0.08
    assert bootstrap_se(QUESTIONS, CONVS, PLANNING_SD) > PLANNING_SD / np.sqrt(CONVS * QUESTIONS) * 1.3


@settings(max_examples=200, deadline=None)
@given(p=st.lists(st.floats(0, 1), min_size=1, max_size=8), alpha=st.sampled_from([0.01, 0.05, 0.1]))
def test_holm_is_a_step_down(p, alpha):
    out = holm(p, alpha)
    alone = [x <= alpha for x in p]
    assert all(a or not r for (r, _), a in zip(out, alone))  # never passes what the test alone fails
    assert all(r for (r, _), x in zip(out, p) if x <= alpha / len(p))  # Bonferroni's passes pass
    order = sorted(range(len(p)), key=lambda i: (p[i], i))
    passed = [out[i][0] for i in order]
    assert passed == sorted(passed, reverse=True)  # the steps stop at the first failure
    assert [out[i][1] for i in order] == [alpha / (len(p) - r) for r in range(len(p))]
    if len(p) == 1:
        assert out[0][0] == alone[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), shift=st.floats(0.001, 0.3), delta=st.floats(0.01, 0.2))
def test_a_worse_method_never_passes_where_a_better_one_fails(seed, shift, delta):
    """Same questions and resamples, every gap larger by `shift`: the bound and every conversation's
    gap move up by it, so a pass can only turn into a fail."""
    base = synthetic(np.random.default_rng(seed), 0.0, n=20)
    worse = {c: g + shift for c, g in base.items()}
    a = noninferior({"m": base}, delta, resamples=200, seed=seed)["m"]
    b = noninferior({"m": worse}, delta, resamples=200, seed=seed)["m"]
    assert b.test.upper == pytest.approx(a.test.upper + shift)
    assert not (b.passed and not a.passed)
    assert (a.test.p <= 0.05) == (a.test.upper <= delta)  # the p-value and the bound agree


@settings(max_examples=30, deadline=None)
@given(n=st.lists(st.integers(1, 30), min_size=1, max_size=6), delta=st.floats(0, 0.5))
def test_a_method_answering_as_text_does_passes_any_tolerance(n, delta):
    same = {f"c{i}": np.zeros(k) for i, k in enumerate(n)}
    v = noninferior({"a": same, "b": same}, delta, resamples=100)
    assert all(x.passed and x.test.upper == 0 and x.test.p == 0 for x in v.values())


def test_unequal_conversations_pool_by_question_and_one_far_worse_vetoes():
    gaps = {"short": [1.0] * 4, **{f"long-{i}": [0.0] * 36 for i in range(4)}}
    v = noninferior({"m": gaps}, 0.5, resamples=2000)["m"]
    assert v.test.gap == pytest.approx(4 / 148) and v.test.n == 148
    assert v.test.upper < 0.5  # pooled, it is well within the tolerance...
    assert v.test.conversations["short"] == (1.0, 1.0) and v.test.worse(0.5) == ["short"]
    assert not v.passed and "significantly worse" in v.reason and "short" in v.reason  # ...but not on "short"
    assert quantile(np.array([0.0, 1.0, 2.0, 3.0]), 0.5) == 1.0  # inverted CDF: a value resampled


def test_the_resolvable_tolerance_shrinks_with_questions_and_grows_with_methods():
    d = lambda n, c=CONVS, m=1: resolvable_delta(n, c, PLANNING_SD, m)  # noqa: E731
    assert d(40) > d(100) > d(200)
    assert d(40, m=6) > d(40)
    assert pass_probability(d(40), QUESTIONS, CONVS, PLANNING_SD) == pytest.approx(0.9, abs=1e-6)
    assert pass_probability(d(40), QUESTIONS, CONVS, PLANNING_SD, true_gap=2 * d(40)) < 0.001


def test_docs_quality_has_the_committed_resolution_table():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "quality.md").read_text()
    assert resolution_table() in docs
