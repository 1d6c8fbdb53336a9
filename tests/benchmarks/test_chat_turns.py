"""benchmarks/chat_turns.py's bookkeeping: its arguments, the per-turn medians it reports, and how it
compares two configurations' answers (no engine: rows as the replay writes them)."""

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import chat_turns  # noqa: E402


def test_arguments():
    a = chat_turns.parse_args(["--quick", "--k", "all", "--skip", "memory-first/inject"])
    assert (a.turns, a.at, a.k, a.layouts) == (10, (1, 5, 10), "all", ["history-first", "memory-first"])
    assert chat_turns.configurations(a.layouts, a.modes)[0] == chat_turns.PLAIN
    assert chat_turns.parse_args(["--turns", "4"]).at == (1,)  # measured turns past the chat are dropped
    for bad in (["--layouts", "auto"], ["--modes", "joint"], ["--k", "0"]):
        with pytest.raises(SystemExit):
            chat_turns.parse_args(bad)


@settings(max_examples=50, deadline=None)
@given(ttfts=st.lists(st.floats(0.01, 10), min_size=3, max_size=12))
def test_a_measured_turn_is_the_median_of_it_and_its_neighbours(ttfts):
    rows = [{"turn": t, "config": "c", "ttft_s": x, "prompt_tokens": 10, "cached_tokens": 0, "f1": 0.5,
             "recall": 1.0, "token_ids": [1]} for t, x in enumerate(ttfts, 1)]
    at = (1, len(ttfts))
    s = chat_turns.summarise(rows, ["c"], at)["c"]
    assert s["ttft_s"][1] == pytest.approx(sorted(ttfts[:2])[0] / 2 + sorted(ttfts[:2])[1] / 2)
    assert s["ttft_s"][len(ttfts)] == pytest.approx(sum(ttfts[-2:]) / 2)
    assert s["vs_turn_1"][len(ttfts)] == pytest.approx(s["ttft_s"][len(ttfts)] / s["ttft_s"][1])


def test_answers_are_compared_until_the_chats_diverge():
    rows = [{"turn": t, "config": c, "token_ids": ids} for c, seq in (("a", [[1], [2], [3], [4]]),
                                                                      ("b", [[1], [2], [9], [4]]))
            for t, ids in enumerate(seq, 1)]
    assert chat_turns.same_answers(rows, "a", "b") == (2, 4)  # turn 4 equal again, but the chats differ by then
    assert chat_turns.same_answers(rows, "a", "missing") is None
