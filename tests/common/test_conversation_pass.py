"""Conversation-encoding plans (`inferscale.common.prompt.conversation_pass`), without a model.

A token's KV is a function of its id, its position and the KV of the keys it sees, so two tokens
with equal `closure` signatures get equal KV in any model: shared rows are checked against a row
per fact (the reference) and the first facts' rows against turn-window items that way."""

from __future__ import annotations

import numpy as np
import pytest

from inferscale.common.prompt.conversation_pass import SpanItem, conversation_plan, span_start
from inferscale.common.facts import Conversation, Fact, Turn
from inferscale.common.prompt.packing import pack_items

HEADER = (1, 2, 3)


CANON: dict = {}  # signature -> small int: equal signatures compare in O(1), shared across plans


def closure(row, q: int, window: int | None = None, memo=None) -> int:
    """A canonical id of (token id, and for each key q sees: its position relative to q's and its
    own id, recursively): equal ids mean equal KV in any model (RoPE sees relative positions)."""
    memo = {} if memo is None else memo
    vis = row.visible(None, window)
    pos = row.positions
    for t in range(q + 1):  # keys come before their queries in every row
        if t not in memo:
            seen = frozenset((int(pos[t] - pos[k]), memo[k]) for k in np.flatnonzero(vis[t, :t]))
            memo[t] = CANON.setdefault((int(row.tokens[t]), seen), len(CANON))
    return memo[q]


def fact_closures(plan, i: int, window: int | None = None) -> list[int]:
    r, at = plan.where[i]
    memo: dict = {}
    return [closure(plan.rows[r], int(q), window, memo) for q in at]


def conversation(n_turns: int, rng) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in rng.integers(10, 60, size=rng.integers(2, 6))) for _ in range(n_turns)]


def items_for(turns, sources: list[int], w: int, rng) -> list[SpanItem]:
    out = []
    for s in sources:
        span = tuple(turns[span_start(s, w): s])
        out.append(SpanItem(span, min(w, len(span)), tuple(int(x) for x in rng.integers(60, 90, size=3))))
    return out


def test_span_start_is_the_block_before_the_windows_end():
    assert [span_start(s, 3) for s in range(0, 14)] == [0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 6, 6, 6, 9]
    for w in range(1, 7):
        for s in range(60):
            start = span_start(s, w)
            assert start <= max(0, s - w) and min(s, w) <= s - start <= 2 * w  # the window, at most 2w
    assert span_start(5, 0) == 5
    with pytest.raises(ValueError, match="must be >= 0"):
        span_start(-1, 3)


def test_context_span_ends_with_the_context_window():
    turns = [Turn(f"T{i}", "A", f"turn {i}") for i in range(20)]
    facts = [Fact(f"f{i}", "x", f"T{i}") for i in range(20)]
    conv = Conversation("c", turns, facts)
    for f in facts:
        span, window = conv.context_span(f, 4), conv.context_window(f, 4)
        assert span[len(span) - len(window):] == window
    assert [t.id for t in conv.context_span(facts[9], 4)] == [f"T{i}" for i in range(4, 9)]
    assert conv.context_span(facts[9], 0) == [] and conv.context_span(Fact("n", "x"), 4) == []


@pytest.mark.parametrize("w", [0, 1, 3, 5])
def test_shared_rows_give_every_fact_its_reference_row(w):
    rng = np.random.default_rng(w)
    turns = conversation(30, rng)
    sources = sorted(int(s) for s in rng.integers(0, 30, size=16)) + [12, 12]  # two facts of one turn
    items = items_for(turns, sources, w, rng)
    shared = conversation_plan(HEADER, items, w, max_context=512)
    alone = conversation_plan(HEADER, items, w, max_context=512, share=False)
    assert len(alone.rows) == len(items) and len(shared.rows) < len(items)
    assert shared.row_tokens < alone.row_tokens
    for i, it in enumerate(items):
        r, at = shared.where[i]
        np.testing.assert_array_equal(shared.rows[r].tokens[at], it.fact)
        assert fact_closures(shared, i) == fact_closures(alone, i)
        assert fact_closures(shared, i, window=7) == fact_closures(alone, i, window=7)  # sliding layers too


def test_a_fact_sees_exactly_the_header_its_window_and_itself():
    rng = np.random.default_rng(1)
    w, turns = 3, conversation(20, rng)
    items = items_for(turns, [2, 7, 8, 13, 19], w, rng)
    plan = conversation_plan(HEADER, items, w, max_context=512)
    for i, it in enumerate(items):
        r, at = plan.where[i]
        row = plan.rows[r]
        vis = row.visible()
        window = [t for turn in it.turns[len(it.turns) - it.window:] for t in turn]
        seen = [k for k in np.flatnonzero(vis[at[-1]]) if k not in at]
        assert list(row.tokens[seen]) == list(HEADER) + window
        wpos = row.positions[seen[len(HEADER):]]
        assert list(row.positions[at]) == list(range(wpos[-1] + 1, wpos[-1] + 1 + len(at)))
        assert np.all(np.diff(wpos) == 1)  # the window is contiguous, and the fact right after it


def test_turns_see_at_most_w_turns_back_and_nothing_after_them():
    rng = np.random.default_rng(2)
    w, turns = 2, conversation(12, rng)
    (item,) = items_for(turns, [11], w, rng)  # span: turns 6..10
    plan = conversation_plan(HEADER, [item], w, max_context=512)
    row = plan.rows[0]
    vis = row.visible()
    bounds = np.cumsum([len(HEADER)] + [len(t) for t in item.turns])
    for j in range(len(item.turns)):
        first = bounds[j]  # the turn's first token sees the header and the w turns before it
        seen = set(np.flatnonzero(vis[first]))
        expect = set(range(len(HEADER))) | set(range(bounds[max(0, j - w)], bounds[j] + 1))
        assert seen == expect


def test_facts_whose_span_is_their_window_match_turn_window_encoding():
    rng = np.random.default_rng(3)
    w, turns = 4, conversation(12, rng)
    items = items_for(turns, [0, 2, 4, 4], w, rng)  # spans = windows in the first block
    plan = conversation_plan(HEADER, items, w, max_context=512)
    pairs = [(list(HEADER) + [t for turn in it.turns for t in turn], list(it.fact)) for it in items]
    ref = pack_items(pairs, 10_000, min_shared=1.0)  # a chain per item: plain causal encoding
    for i in range(len(items)):
        assert fact_closures(plan, i) == fact_closures(ref, i)
    assert plan.item_tokens == ref.item_tokens


def test_long_spans_are_clipped_like_turn_windows():
    rng = np.random.default_rng(4)
    w = 4
    turns = [tuple(range(10, 30))] * 12  # 20 tokens a turn
    items = items_for(turns, [11], w, rng)  # span 4..10: 7 turns, window 4 (80 tokens)
    plan = conversation_plan(HEADER, items, w, max_context=len(HEADER) + 100 + 3)
    assert len(plan.rows[0]) == len(HEADER) + 100 + 3  # 5 turns kept: the window and one before it
    tight = conversation_plan(HEADER, items, w, max_context=len(HEADER) + 50 + 3)
    row = tight.rows[0]
    assert row.is_chain and len(row) == len(HEADER) + 53  # the window's last 50 tokens, as encode_plan
    r, at = tight.where[0]
    np.testing.assert_array_equal(row.tokens[at], items[0].fact)


def test_rows_keep_to_their_budget_and_bad_items_are_named():
    rng = np.random.default_rng(5)
    w, turns = 3, conversation(10, rng)
    items = items_for(turns, [9] * 12, w, rng)  # one span, many facts
    plan = conversation_plan(HEADER, items, w, max_context=512, row_tokens=40)
    assert len(plan.rows) > 1 and all(len(r) <= 40 for r in plan.rows)
    with pytest.raises(ValueError, match="item 0: a window of 3 turns with w=2"):
        conversation_plan(HEADER, items, 2, max_context=512)
    with pytest.raises(ValueError, match="window of 4 turns in a span of 3"):
        SpanItem(((1,), (2,), (3,)), 4, (5,))
    with pytest.raises(ValueError, match="needs fact tokens"):
        SpanItem((), 0, ())
