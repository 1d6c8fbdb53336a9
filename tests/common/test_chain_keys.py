"""The memory chain's keys and extension items (`common.prompt.chain_links`): a key names one exact token prefix,
so a change to a fact renames its link and every later one and nothing before it; an extension
from any link encodes exactly the links a joint pass over the whole memory would."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from doubles import ChainEncoder
from inferscale.common.prompt.chain_links import (
    chain_keys,
    extension_item,
    is_chain_key,
    split_links,
    stored_prefix,
    within_budget,
)

HEADER = (7, 8, 9)
facts_st = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=4), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(facts=facts_st, data=st.data())
def test_a_change_renames_the_changed_link_and_every_later_one(facts, data):
    keys = chain_keys(HEADER, "i1", facts)
    assert len(set(keys)) == len(keys) and all(is_chain_key(k) for k in keys)
    n = data.draw(st.integers(0, len(facts)))
    assert chain_keys(HEADER, "i1", facts[:n]) == keys[:n]  # an append keeps every key before it
    j = data.draw(st.integers(0, len(facts) - 1))
    changed = [list(f) for f in facts]
    changed[j] = changed[j] + [51]
    other = chain_keys(HEADER, "i1", changed)
    assert other[:j] == keys[:j] and not set(other[j:]) & set(keys)
    deleted = facts[:j] + facts[j + 1:]
    for i, key in enumerate(chain_keys(HEADER, "i1", deleted)):  # a key is its token prefix, nothing else
        assert (key in keys) == any(deleted[:i + 1] == facts[:i2 + 1] for i2 in range(len(facts)))
    assert not set(chain_keys(HEADER, "i2", facts)) & set(keys)  # a re-created user shares no link
    assert not set(chain_keys((7, 8), "i1", facts)) & set(keys)  # nor a prompt of another header


@settings(max_examples=100, deadline=None)
@given(facts=facts_st, data=st.data())
def test_an_extension_from_any_link_is_the_joint_encoding(facts, data):
    start = data.draw(st.integers(0, len(facts) - 1))
    ctx, ids = extension_item(HEADER, facts, start)
    ((k, v),) = ChainEncoder().encode_ids([(ctx, ids)])
    joint_k, joint_v = ChainEncoder.joint(list(HEADER) + [t for f in facts for t in f])
    pos = len(HEADER) + sum(len(f) for f in facts[:start])
    for f, (lk, lv) in zip(facts[start:], split_links(k, v, [len(f) for f in facts[start:]])):
        np.testing.assert_array_equal(lk, joint_k[:, pos:pos + len(f)])
        np.testing.assert_array_equal(lv, joint_v[:, pos:pos + len(f)])
        pos += len(f)


@settings(max_examples=100, deadline=None)
@given(facts=facts_st, budget=st.integers(0, 40), gone=st.sets(st.integers(0, 7)))
def test_the_budget_and_the_stored_prefix(facts, budget, gone):
    n = within_budget(facts, budget)
    assert sum(len(f) for f in facts[:n]) <= budget
    assert n == len(facts) or sum(len(f) for f in facts[:n + 1]) > budget
    keys = chain_keys(HEADER, "i1", facts)
    m = stored_prefix(keys, [keys[i] for i in gone if i < len(keys)])
    assert m == min([i for i in gone if i < len(keys)], default=len(keys))
