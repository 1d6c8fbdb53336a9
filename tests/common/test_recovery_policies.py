"""Recovery policies as plain Python: parsing, validation and the masks they put on a layout."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.common.prompt.layout import PromptLayout, Segment
from inferscale.common.prompt.recovery import RecoveryPolicy, injected_prefix, recompute_share


def layout():
    segs, pos = [], 0
    for kind, n, action, fid in [("header", 3, "inject", None), ("fact", 4, "inject", "a"), ("fact", 2, "inject", "b"),
                                 ("fact", 5, "inject", "c"), ("footer", 2, "compute", None),
                                 ("question", 3, "compute", None)]:
        segs.append(Segment(kind, tuple(range(n)), pos, action, fid))
        pos += n
    return PromptLayout(tuple(segs))  # header 0-2, a 3-6, b 7-8, c 9-13, footer 14-15, question 16-18


def bits(mask):
    return "".join("i" if m else "c" for m in mask)


@pytest.mark.parametrize("text,want", [
    ("none", "iii" "iiii" "ii" "iiiii" "cc" "ccc"),
    ("all", "iii" "cccc" "cc" "ccccc" "cc" "ccc"),
    ("last:1", "iii" "iiii" "ii" "ccccc" "cc" "ccc"),
    ("last:2", "iii" "iiii" "cc" "ccccc" "cc" "ccc"),
    ("last:9", "iii" "cccc" "cc" "ccccc" "cc" "ccc"),
    ("heads:1", "iii" "ciii" "ci" "ciiii" "cc" "ccc"),
    ("heads:3", "iii" "ccci" "cc" "cccii" "cc" "ccc"),
    ("top:1", "iii" "iiii" "ii" "ccccc" "cc" "ccc"),  # the mask of facts `arrange` already moved
])
def test_masks(text, want):
    p = RecoveryPolicy.parse(text)
    lay = layout()
    mask = p.mask(lay)
    assert bits(mask) == want and str(p) == text
    assert injected_prefix(mask) == (want + "c").index("c")
    assert p.prefix_compatible == (injected_prefix(mask) == int(mask.sum()) or p.name != "heads")
    assert not p.needs_deviation
    assert recompute_share(lay, mask) == pytest.approx(want[3:14].count("c") / 11)
    assert np.array_equal(lay.inject_mask(), RecoveryPolicy().mask(lay)) and lay.num_injected == 14


@pytest.mark.parametrize("text,msg", [("fast", "must be one of"), ("last", "needs n >= 1"), ("last:0", "needs n"),
                                      ("heads:x", "non-negative integer"), ("none:2", "takes no n"),
                                      ("all:1", "takes no n"), ("blend:101", "percentage"), ("keys", "needs n")])
def test_bad_policies_are_refused(text, msg):
    with pytest.raises(ValueError, match=msg):
        RecoveryPolicy.parse(text)


def test_blend_recomputes_the_most_deviating_memory_tokens():
    lay = layout()
    dev = np.zeros(len(lay))
    dev[[1, 5, 8, 12, 16]] = [9.0, 3.0, 2.0, 1.0, 99.0]  # header and question tokens are never chosen
    p = RecoveryPolicy.parse("blend:20")  # 20% of the 11 memory tokens: 3
    assert p.needs_deviation and not p.prefix_compatible
    assert bits(p.mask(lay, dev)) == "iii" "iici" "ic" "iiici" "cc" "ccc"
    assert bits(RecoveryPolicy.parse("blend:100").mask(lay, dev)) == bits(RecoveryPolicy.parse("all").mask(lay))
    with pytest.raises(ValueError, match="needs the KV deviation"):
        p.mask(lay)


def test_keys_scales_the_memory_and_is_not_for_vllm():
    from inferscale.common.prompt.recovery import connector_policy

    lay = layout()
    p = RecoveryPolicy.parse("keys:80")
    assert p.key_scale == 0.8 and RecoveryPolicy.parse("last:2").key_scale == 1.0
    assert np.array_equal(p.mask(lay), lay.inject_mask())  # nothing recomputed
    with pytest.raises(ValueError, match="only the JAX engine"):
        connector_policy(p)


def test_combined_policies_and_what_a_plan_recomputes():
    """`a+b` recomputes what either part does; the plan of `heads:N+last:M` stops after the last
    injected fact and names the heads before it as recompute runs."""
    from inferscale.common.prompt.recovery import connector_policy, memory_end, recompute_runs

    lay = layout()
    p = RecoveryPolicy.parse("heads:1+last:1")
    assert str(p) == "heads:1+last:1" and not p.prefix_compatible and [q.name for q in p.parts] == ["heads", "last"]
    mask = p.mask(lay)
    assert bits(mask) == "iii" "ciii" "ci" "ccccc" "cc" "ccc"
    assert memory_end(lay, mask) == 9 and recompute_runs(mask, 9) == ((3, 1), (7, 1))
    heads = RecoveryPolicy.parse("heads:3").mask(lay)
    assert memory_end(lay, heads) == 14 and recompute_runs(heads, 14) == ((3, 3), (7, 5))  # b is all head: runs merge
    assert recompute_runs(RecoveryPolicy().mask(lay), 14) == ()
    assert str(connector_policy("heads:4+last:2")) == "heads:4+last:2"
    for bad, msg in (("heads:1+keys:80", "combine"), ("last:1+last:2", "twice"), ("none+last:1", "combine")):
        with pytest.raises(ValueError, match=msg):
            RecoveryPolicy.parse(bad)
    for jax_only in ("blend:20", "heads:2+blend:10", "ape:90:80"):
        with pytest.raises(ValueError, match="only the JAX engine"):
            connector_policy(jax_only)


def test_ape_policy_parses_both_numbers():
    p = RecoveryPolicy.parse("ape:90:80")
    assert str(p) == "ape:90:80" and p.key_scale == pytest.approx(1 / 0.9) and p.memory_mass == pytest.approx(0.72)
    assert RecoveryPolicy.parse("ape:100:100").memory_mass == 1.0 and RecoveryPolicy().memory_mass == 1.0
    for bad in ("ape:90", "keys:80:2", "ape:90:80:1"):
        with pytest.raises(ValueError):
            RecoveryPolicy.parse(bad)


def test_a_plans_recompute_runs_round_trip_and_are_checked():
    from inferscale.common.prompt.plan import MemoryPlan, PlanError, PlanSegment

    plan = MemoryPlan("u", 1, (PlanSegment("shared", "h", 0, 3), PlanSegment("user", "a", 3, 4)), "inc", ((3, 2),))
    back = MemoryPlan.from_params(plan.to_params())
    assert back == plan and back.num_injected == 5 and back.positions_to_recompute() == [3, 4]
    assert "recompute" not in MemoryPlan("u", 1, plan.segments).to_params()["inferscale"]  # plain plans as before
    back.check_recompute()
    for runs in (((5, 3),), ((3, 2), (4, 1)), ((3, 0),)):
        with pytest.raises(PlanError, match="recompute run"):
            MemoryPlan("u", 1, plan.segments, "inc", runs).check_recompute()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), lengths=st.lists(st.integers(1, 6), min_size=0, max_size=10),
       heads=st.sampled_from([None, 1, 3]), kind=st.sampled_from(["top", "near"]))
def test_top_recomputes_the_most_relevant_facts_moved_next_to_the_question(n, lengths, heads, kind):
    """`top:n` lays the n most relevant facts (the first n in retrieval's order) last, the most
    relevant right before the question, and recomputes exactly them; the rest keep their order and
    stay injected (but for what `heads` adds); it stays prefix-compatible on its own. `near:n` lays
    them out the same way and recomputes nothing: `top:n` is `near:n+last:n`."""
    text = f"{kind}:{n}" + (f"+heads:{heads}" if heads else "")
    p = RecoveryPolicy.parse(text)
    assert str(p) == text and p.prefix_compatible == (heads is None)
    ids = [f"f{i}" for i in range(len(lengths))]  # retrieval's order: f0 most relevant
    order = p.arrange(ids)
    top = ids[:n]
    assert sorted(order) == sorted(ids) and order[len(ids) - len(top):] == top[::-1]
    assert order[: len(ids) - len(top)] == ids[len(top):]
    segs, pos = [Segment("header", (0, 1), 0, "inject", None)], 2
    size = dict(zip(ids, lengths))
    for fid in order:
        segs.append(Segment("fact", tuple(range(size[fid])), pos, "inject", fid))
        pos += size[fid]
    segs.append(Segment("question", (0, 1, 2), pos, "compute", None))
    lay = PromptLayout(tuple(segs))
    mask = p.mask(lay)
    for s in lay.facts:
        head = min(heads or 0, len(s.token_ids))
        want = [(kind == "near" or s.fact_id not in top) and i >= head for i in range(len(s.token_ids))]
        assert mask[s.start:s.end].tolist() == want, s.fact_id
    assert p.reorders and not RecoveryPolicy.parse(f"last:{n}").reorders
    assert RecoveryPolicy.parse(f"last:{n}").arrange(ids) == ids  # every other policy keeps the order
    both = RecoveryPolicy.parse(f"near:{n}+last:{n}")
    top_n = RecoveryPolicy.parse(f"top:{n}")
    assert both.arrange(ids) == top_n.arrange(ids) and both.mask(lay).tolist() == top_n.mask(lay).tolist()
