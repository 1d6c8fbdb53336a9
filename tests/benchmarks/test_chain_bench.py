"""benchmarks/chain.py's bookkeeping: its arguments, the facts it pools, and the medians and
targets it reports (no engine: rows as its runs write them)."""

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chain  # noqa: E402


def test_arguments():
    a = chain.parse_args(["--quick"])
    assert (a.sizes, a.repeats, a.users) == ((30, 100), 2, 6)
    a = chain.parse_args(["--sizes", "5,300", "--users", "0"])
    assert (a.sizes, a.repeats, a.users) == ((5, 300), 3, 0)
    for bad in (["--sizes", "0"], ["--repeats", "0"], ["--user-facts", "-1"]):
        with pytest.raises(SystemExit):
            chain.parse_args(bad)


def test_facts_are_pooled_across_conversations_with_unique_ids():
    from inferscale.evaluation.locomo import DEFAULT_LOCOMO_PATH, load_locomo

    samples = load_locomo(DEFAULT_LOCOMO_PATH)
    first = len(samples[0].conversation.facts)
    facts = chain.pooled_facts(samples, first + 5)
    assert len({f.id for f in facts}) == len(facts) == first + 5
    assert [f.text for f in facts[first:]] == [f.text for f in samples[1].conversation.facts[:5]]
    with pytest.raises(SystemExit):
        chain.pooled_facts(samples, 10 ** 6)


@settings(max_examples=30, deadline=None)
@given(times=st.lists(st.floats(0.01, 10), min_size=len(chain.SYSTEMS) * 3, max_size=len(chain.SYSTEMS) * 3),
       evict=st.lists(st.floats(0.01, 10), min_size=8, max_size=8))
def test_medians_per_size_and_system_and_the_evicting_rounds(times, evict):
    rows = [{"size": 30, "system": s, "ttft_s": times[i * len(chain.SYSTEMS) + j]}
            for i in range(3) for j, s in enumerate(chain.SYSTEMS)]
    ev = [{"round": r, "system": s, "ttft_s": evict[r * 2 + j], "cached_tokens": 5, "prompt_tokens": 10}
          for r in range(4) for j, s in enumerate(("chain", "text all"))]
    out = chain.summarise(rows, {30: {}}, ev)
    for j, s in enumerate(chain.SYSTEMS):
        assert out["ttft_s"][30][s] == sorted(times[i * len(chain.SYSTEMS) + j] for i in range(3))[1]
    assert out["evicting"]["chain"]["p50_s"] == sorted(evict[r * 2] for r in (1, 2, 3))[1]  # round 0 fills the cache
    assert out["evicting"]["text all"]["cached"] == 0.5
