"""`HostTier`, the one KV tier (the vLLM connector's host and device tiers): repeat reads are served
from memory, within a byte budget, least recently used first out, and dropped KV is gone."""

import numpy as np
import pytest

from inferscale.common.storage.format import CompactKV, FactKV
from inferscale.common.storage.tiers import HostTier


def kv(key, n=4):
    k = np.ones((2, n, 1, 4), np.float32)
    return FactKV(key, np.arange(n), k, -k)  # 2 * 2*n*4*4 bytes: 256 for n=4


def test_repeat_reads_are_hits_within_the_budget():
    tier = HostTier(600)
    assert tier.get(("ann", "a")) is None
    tier.put(("ann", "a"), kv("a"))
    tier.put(("ann", "b"), kv("b"))
    assert tier.get(("ann", "a")).fact_id == "a" and tier.get(("ann", "a")) is tier.get(("ann", "a"))
    assert (tier.stats.hits, tier.stats.misses, tier.used) == (3, 1, 512)
    assert tier.stats.hit_rate == 0.75
    tier.put(("ben", "c"), kv("c"))  # over budget: the least recently used ("b") goes
    assert tier.keys() == [("ann", "a"), ("ben", "c")] and tier.stats.evictions == 1 and tier.used == 512
    tier.put(("ann", "a"), kv("other"))  # KV under a key never changes: the held entry stays
    assert tier.get(("ann", "a")).fact_id == "a"
    tier.put(("ann", "huge"), kv("huge", 40))  # larger than the whole budget: not kept, nothing evicted
    assert tier.keys() == [("ben", "c"), ("ann", "a")]


def test_dropped_kv_is_gone_and_its_bytes_freed():
    tier = HostTier(1 << 20)
    for owner, key in (("ann", "a"), ("ann", "b"), ("ben", "a"), ("<shared>", "h")):
        tier.put((owner, key), kv(key))
    tier.drop([("ann", "a"), ("ann", "missing")])
    assert tier.get(("ann", "a")) is None and tier.used == 3 * 256
    tier.drop_user("ann")
    assert tier.keys() == [("ben", "a"), ("<shared>", "h")] and tier.used == 2 * 256


def test_compact_kv_counts_its_scales():
    codes = np.ones((2, 4, 1, 4), np.int8)
    scales = np.ones((2, 1, 4), np.float32)
    tier = HostTier(1 << 20)
    tier.put(("ann", "q"), CompactKV("q", np.arange(4), codes, codes, "int8", scales, scales))
    assert tier.used == 2 * codes.nbytes + 2 * scales.nbytes


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        HostTier(-1)
    assert HostTier(0).put(("a", "b"), kv("b")) is None and HostTier(0).keys() == []
