"""benchmarks/whole_memory.py's bookkeeping: its arguments and its paired gaps (no engine)."""

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import whole_memory  # noqa: E402


def test_arguments():
    assert whole_memory.parse_args(["--quick"]).questions == 10
    assert whole_memory.parse_args([]).questions == 40
    with pytest.raises(SystemExit):
        whole_memory.parse_args(["--questions", "0"])
    assert whole_memory.parse_args([]).methods == whole_memory.SCOPES  # the policies are asked for by name
    assert whole_memory.parse_args(["--methods", "inject10+top2,inject10+last2"]).methods == \
        (whole_memory.BASE, "inject k=10 last:2", "inject k=10 top:2")
    assert whole_memory.parse_args(["--methods", "chain+top3,chain"]).methods == \
        ("whole (chain)", "whole + top 3", whole_memory.BASE)  # in METHODS order, the baseline always
    with pytest.raises(SystemExit):
        whole_memory.parse_args(["--methods", "chain,everything"])
    assert whole_memory.parse_args([]).conversations is None
    assert whole_memory.parse_args(["--conversations", "asst-1, conv-26"]).conversations == ("asst-1", "conv-26")


@settings(max_examples=30, deadline=None)
@given(scores=st.lists(st.tuples(*[st.floats(0, 1)] * len(whole_memory.METHODS)), min_size=2, max_size=12))
def test_gaps_are_paired_against_text_k10_in_points(scores):
    rows = [{"conversation": f"c{i % 2}", **{m: {"recall": s[j], "f1": s[j]} for j, m in enumerate(whole_memory.METHODS)}}
            for i, s in enumerate(scores)]
    out = whole_memory.summarise(rows)["pooled"]
    base = whole_memory.METHODS.index(whole_memory.BASE)
    for j, m in enumerate(whole_memory.METHODS):
        gap = sum(100 * (s[base] - s[j]) for s in scores) / len(scores)
        assert out[m]["recall_gap"] == pytest.approx(gap, abs=1e-9)
    assert out[whole_memory.BASE]["recall_gap"] == 0 and out[whole_memory.BASE]["recall_se"] == 0
