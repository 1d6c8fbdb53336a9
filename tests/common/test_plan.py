"""The memory plan's shape rules: segments ascending from 0, and every position no segment covers
(a history-first chat's conversation) recomputed, never injected from nothing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.common.prompt.plan import MemoryPlan, PlanError, PlanSegment


@st.composite
def _plans(draw):
    """A plan of 1-5 segments with random gaps, and its gaps as recompute runs."""
    pos, segs = 0, []
    for i in range(draw(st.integers(1, 5))):
        pos += draw(st.integers(0, 6))  # a gap before the segment, or none
        n = draw(st.integers(1, 8))
        segs.append(PlanSegment("user", f"f{i}", pos, n))
        pos += n
    plan = MemoryPlan("alice", 3, tuple(segs))
    return MemoryPlan("alice", 3, tuple(segs), recompute=plan.gaps())


@settings(max_examples=100, deadline=None)
@given(_plans())
def test_a_plan_whose_gaps_are_recomputed_round_trips(plan):
    again = MemoryPlan.from_params(plan.to_params())
    assert again == plan
    covered = {p for s in plan.segments for p in range(s.start, s.end)} | set(plan.positions_to_recompute())
    assert covered == set(range(plan.end))  # every position below end is injected or recomputed
    assert plan.num_injected == sum(s.n for s in plan.segments)


@settings(max_examples=100, deadline=None)
@given(_plans(), st.data())
def test_a_gap_left_out_of_the_recompute_runs_is_refused(plan, data):
    if not plan.gaps():
        return
    runs = list(plan.recompute)
    start, n = runs.pop(data.draw(st.integers(0, len(runs) - 1)))
    if n > 1 and data.draw(st.booleans()):
        runs.append((start + 1, n - 1))  # only part of the gap recomputed
        runs.sort()
    bad = MemoryPlan(plan.user, plan.version, plan.segments, recompute=tuple(runs))
    with pytest.raises(PlanError, match="not all recomputed"):
        bad.check_shape()
    with pytest.raises(PlanError, match="not all recomputed"):
        MemoryPlan.from_params(bad.to_params())


def test_overlapping_or_empty_segments_are_refused():
    with pytest.raises(PlanError, match="ascending"):
        MemoryPlan("a", 1, (PlanSegment("user", "x", 0, 4), PlanSegment("user", "y", 2, 4))).check_shape()
    with pytest.raises(PlanError, match="no segments"):
        MemoryPlan("a", 1, ()).check_shape()
    with pytest.raises(PlanError, match="store"):
        MemoryPlan("a", 1, (PlanSegment("other", "x", 0, 4),)).check_shape()
