"""Recovery policies as plain Python: parsing, validation and the masks they put on a layout."""

import numpy as np
import pytest

from inferscale.common.layout import PromptLayout, Segment
from inferscale.common.recovery import RecoveryPolicy, injected_prefix, recompute_share


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
    from inferscale.common.recovery import connector_policy

    lay = layout()
    p = RecoveryPolicy.parse("keys:80")
    assert p.key_scale == 0.8 and RecoveryPolicy.parse("last:2").key_scale == 1.0
    assert np.array_equal(p.mask(lay), lay.inject_mask())  # nothing recomputed
    with pytest.raises(ValueError, match="only the JAX engine"):
        connector_policy(p)
