"""The extraction benchmark's plain-Python parts (benchmarks/locomo_extracted.py): its arguments,
which sessions, facts and questions a partial run takes, the timing wrapper and the report."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import locomo_extracted as bench  # noqa: E402

from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_arguments():
    a = bench.parse_args(["--quick"])
    assert (a.sessions, a.questions, a.k, a.policies, a.observations) == (2, 6, (10,), ("none", "last:5"), True)
    a = bench.parse_args(["--k", "10,50", "--policies", "none", "--no-observations"])
    assert a.k == (10, 50) and a.policies == ("none",) and not a.observations and a.sessions is None


def test_a_partial_run_takes_whole_sessions_and_the_questions_they_answer():
    sample = next(s for s in load_locomo(REPO / DEFAULT_LOCOMO_PATH) if s.conversation.id == "conv-26")
    turns, facts, qs = bench.select(sample, 2, 100)
    assert {t.session for t in turns} == {1, 2} and turns == [t for t in sample.conversation.turns if t.session <= 2]
    have = {t.id for t in turns}
    assert facts and all(f.source_turn in have for f in facts)
    assert qs and all(q.category in (1, 2, 3, 4) and set(q.evidence) <= have for q in qs)
    whole = bench.select(sample, None, 40)
    assert len(whole[0]) == len(sample.conversation.turns) and len(whole[2]) == 40


def test_timed_adds_up_the_named_methods_only():
    class Inner:
        def slow(self):
            time.sleep(0.02)
            return 1

        def fast(self):
            return 2

    t = bench.Timed(Inner(), ("slow",))
    assert t.slow() == 1 and t.slow() == 1 and t.fast() == 2
    assert 0.04 <= t.spent["slow"] < 1 and set(t.spent) == {"slow"}


def test_the_report_splits_the_ingest_cost_per_turn():
    m = {"k": 10, "policy": "none", "f1": 0.1, "text_f1": 0.15, "recompute_share": 0.0, "n": 4, "gap_stderr": 0.01}
    r = {"args": {"conversation": "conv-26", "k": [10]}, "model": "M", "turns": 20, "observations": 5,
         "questions": 4, "observations_ingest_s": None,
         "sessions": [{"session": 1, "turns": 10, "candidates": 3, "added": 2, "updated": 1, "deleted": 0,
                       "unchanged": 0, "extract_s": 40.0, "decide_llm_s": 4.0, "write_s": 6.0},
                      {"session": 2, "turns": 10, "candidates": 1, "added": 1, "updated": 0, "deleted": 0,
                       "unchanged": 0, "extract_s": 0.0, "decide_llm_s": 0.0, "write_s": 2.0}],
         "memories": {"extracted": {"facts": 3, "measured": [m], "ttft_ms": {"10:text": 900.0, "10:none": 300.0}}},
         "auto": {10: ["text", None]}}
    md = bench.report(r)
    assert "| extracted (4 candidates: +3 ~1 -0) | 3 | 2.00 + 0.20 | 0.40 | 2.60 |" in md
    assert "| extracted | 10 | inject+none | 0.100 | +5.0 ± 1.0 | 300 | 3.0x |" in md
    assert "`auto` serves: k=10: text" in md
