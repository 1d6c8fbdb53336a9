"""One-pass encoding plans: the prefix tree keeps every item's tokens, positions and ancestors."""

import numpy as np
import pytest

from inferscale.common.prompt.packing import batch_rows, pack_items


def ancestors(row, q):
    out = set()
    while q >= 0:
        out.add(q)
        q = row.parent[q]
    return out


def check_plan(items, plan, row_tokens):
    longest = max(len(c) + len(f) for c, f in items)
    for row in plan.rows:
        assert len(row) <= max(row_tokens, longest)
        vis = row.visible()
        for q in range(len(row)):
            assert set(np.flatnonzero(vis[q])) == ancestors(row, q)
            assert row.positions[q] == len(ancestors(row, q)) - 1  # a token's position is its depth
    for (ctx, fact), (r, at) in zip(items, plan.where):
        row = plan.rows[r]
        np.testing.assert_array_equal(row.tokens[at], fact)
        np.testing.assert_array_equal(row.positions[at], np.arange(len(ctx), len(ctx) + len(fact)))
        # the fact's last token sees exactly its item: the context and the fact, in order
        path = sorted(ancestors(row, int(at[-1])))
        np.testing.assert_array_equal(row.tokens[path], list(ctx) + list(fact))


def test_shared_prefixes_run_once():
    head = [1, 2, 3]
    items = [(head + [10, 11], [20, 21]), (head + [10, 11], [22]), (head, [23, 24]),
             (head + [10], [25]), (head + [10, 11, 20, 21], [26]), (head + [12], [20, 21])]
    plan = pack_items(items, 64, min_shared=0.0)
    check_plan(items, plan, 64)
    assert len(plan.rows) == 1 and not plan.rows[0].is_chain
    assert plan.item_tokens == sum(len(c) + len(f) for c, f in items) == 37
    # header 3, [10] 1, [11] 1, facts 2+1, [23 24] 2, [25] 1, [26] 1 (after the first fact), [12 20 21] 3
    assert plan.row_tokens == 15


def test_identical_items_share_every_token():
    items = [([5, 6], [7, 8])] * 3
    plan = pack_items(items, 64)
    assert plan.row_tokens == 4
    assert all(np.array_equal(at, plan.where[0][1]) for _, at in plan.where)


def test_rows_respect_the_budget_and_a_long_item_gets_its_own():
    rng = np.random.default_rng(0)
    items = [([0] + list(rng.integers(1, 50, int(rng.integers(0, 30)))), list(rng.integers(1, 50, 4)))
             for _ in range(40)]
    items.append(([0] + list(range(1, 80)), [1, 2]))  # 82 tokens > the budget
    plan = pack_items(items, 48, min_shared=0.0)
    check_plan(items, plan, 48)
    assert len(plan.rows) > 1
    assert sum(len(r) for r in plan.rows) == plan.row_tokens < plan.item_tokens
    batches = batch_rows(plan, 3)
    assert sorted(r for b in batches for r in b) == list(range(len(plan.rows)))
    assert all(len(b) <= 3 for b in batches)


def test_an_item_sharing_little_runs_as_its_own_chain():
    head = [1, 2]
    items = [(head + [3, 4, 5, 6], [7]), (head + [3, 4, 5, 6], [8]),  # same window: 6 of 7 shared
             (head + [9, 10, 11, 12], [13]),  # only the header: 2 of 7
             (head + [9, 10, 11, 12, 13], [14])]  # the previous item whole, then one more: a chain
    plan = pack_items(items, 64)
    check_plan(items, plan, 64)
    assert [len(r) for r in plan.rows] == [8, 8]
    assert [r.is_chain for r in plan.rows] == [False, True]
    assert [r for r, _ in plan.where] == [0, 0, 1, 1]
    batches = batch_rows(plan, 8)
    assert batches == [[1], [0]]  # chains first, never batched with branching rows
    with pytest.raises(ValueError, match="min_shared"):
        pack_items(items, 64, min_shared=1.5)


def test_windowed_visibility_counts_positions_not_row_indices():
    items = [([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4], [7, 8])]
    row = pack_items(items, 64).rows[0]
    vis = row.visible(window=2)
    for q in range(len(row)):
        seen = set(np.flatnonzero(vis[q]))
        assert seen == {k for k in ancestors(row, q) if row.positions[q] - row.positions[k] < 2}
    padded = row.visible(len(row) + 3)
    assert padded.shape == (len(row) + 3,) * 2
    assert padded[len(row):].sum() == 3 and all(padded[i, i] for i in range(len(row), len(row) + 3))


def test_bad_items_are_named():
    with pytest.raises(ValueError, match="encode item 1 has an empty fact"):
        pack_items([([1], [2]), ([1], [])], 8)
    with pytest.raises(ValueError, match="row_tokens"):
        pack_items([([1], [2])], 0)
    with pytest.raises(ValueError, match="shorter"):
        pack_items([([1], [2])], 8).rows[0].visible(1)
