"""The prefix-cache salt: exact prompts share it per user (a chat's turns reuse their conversation);
injected KV shares it only with requests that inject the same stored facts, in the same order, at
the same memory version and policy (vLLM keys blocks by tokens, and two facts may hold the same
tokens with different KV)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")  # the composer module imports the torch encoder

from inferscale.common.prompt.plan import MemoryPlan, PlanSegment  # noqa: E402
from inferscale.serving.composer import MemoryComposer  # noqa: E402

salt = MemoryComposer.salt


def _plan(keys, user="alice", version=3, incarnation="i1", start=40):
    segs, pos = [], start
    for k in keys:
        segs.append(PlanSegment("user", k, pos, 5))
        pos += 5
    gaps = ((0, start),) if start else ()
    return MemoryPlan(user, version, tuple(segs), incarnation, gaps)


_keys = st.lists(st.sampled_from(["f1~1", "f2~1", "f3~4", "f4~2"]), min_size=1, max_size=4, unique=True)


@settings(max_examples=100, deadline=None)
@given(a=_keys, b=_keys, start_a=st.integers(0, 60), start_b=st.integers(0, 60))
def test_injected_blocks_are_shared_only_by_the_same_facts(a, b, start_a, start_b):
    same = salt(_plan(a, start=start_a)) == salt(_plan(b, start=start_b))
    assert same == (a == b)  # where the memory sits (the conversation before it) does not matter


def test_every_other_part_of_an_injection_separates_salts():
    base = salt(_plan(["f1~1", "f2~1"]))
    assert salt(_plan(["f1~1", "f2~1"], user="bob")) != base
    assert salt(_plan(["f1~1", "f2~1"], version=4)) != base
    assert salt(_plan(["f1~1", "f2~1"], incarnation="i2")) != base
    assert salt(_plan(["f1~1", "f2~1"]), policy="last:1") != base
    assert salt(_plan(["f1~1", "f2~1"]), policy="none") == base
    assert salt(_plan(["f1~1", "f2~1"]), "text") != base  # exact content never shares injected blocks


def test_exact_prompts_share_a_salt_per_user_whatever_the_memory():
    text = {salt(_plan(k, version=v), "text") for k in (["f1~1"], ["f2~1", "f3~4"]) for v in (1, 9)}
    assert len(text) == 1  # a text chat reuses its conversation across turns and memory versions
    assert salt(MemoryPlan("alice", 3, (), "i1"), "inject") in text  # nothing injected: exact
    assert salt(_plan(["f1~1"], user="bob"), "text") not in text
